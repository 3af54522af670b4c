"""Greedy tokens of float32 or bfloat16 logits on CPU in one vectorized pass (`greedy.c`):
the same indices as `logits.argmax(-1)`, first index of the maximum and NaN as the largest,
without torch's element-at-a-time reduction."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker_service.kernels import native_build

SOURCE = Path(__file__).with_name("greedy.c")
_P, _I = native_build.P, native_build.I64
FUNCTIONS = {"argmax_rows_bf16": ([_P, _I, _I, _I, _P], None),
             "argmax_rows_f32": ([_P, _I, _I, _I, _P], None),
             "greedy_vectorized": ([], ctypes.c_int)}
_KERNELS = {torch.bfloat16: "argmax_rows_bf16", torch.float32: "argmax_rows_f32"}


@functools.cache
def library():
    """The C library, built on first use; None where it cannot be built or has no AVX-512
    loop (torch's argmax runs instead)."""
    lib = native_build.build(SOURCE, "SEQSERVE_GREEDY", "greedy tokens by torch's argmax",
                             FUNCTIONS)
    return lib if lib is not None and lib.greedy_vectorized() else None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value of `logits` [m, V], as
    `logits.argmax(-1).tolist()` gives it."""
    kernel = _KERNELS.get(logits.dtype) if logits.device.type == "cpu" else None
    lib = library() if kernel else None
    if lib is None or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[-1] == 0 \
            or logits.shape[0] == 0:
        return logits.argmax(-1).tolist()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    getattr(lib, kernel)(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr())
    return out.tolist()

