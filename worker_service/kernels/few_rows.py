"""bfloat16 products of one to three rows at memory speed (`few_rows.c`), on CPUs with
AVX512-BF16.

A decoding step of a few rows is all weight reads. oneDNN's prepacked product read
SmolLM2's 30 layers (212 MB of weights, out of cache) at 11-15 GB/s on this project's
EPYC, 2 threads; the C loop at about 22 GB/s at one or two rows. Whole decoding steps of
SmolLM2, qwen2-gqa and the mid model: 1.44-1.50x faster at one and two rows, 1.18-1.28x at
three, mixed at four (0.92-1.11x), so it stops at three (docs/benchmarks.md). It needs the
weight in its plain [out, in] layout, which oneDNN's blocked copy replaces, so
`PrepackedLinear` keeps the plain weight beside the packed one where `keep_plain` allows
it (the memory of the linear weights twice over).

Each output depends on its own input row and weight row only, in a fixed order, so a
row's result is the same at one, two or three rows; it differs from oneDNN's in the last
bits of some values (another order of float32 sums), so batch-invariant mode, which needs
a row's bits to be the same at every row count, does not use it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from worker_service.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("few_rows.c")
_P, _I = native_build.P, native_build.I64
FUNCTIONS = {"linear_few_rows_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
             "few_rows_vectorized": ([], ctypes.c_int)}
MAX_ROWS = 3  # MAX_ROWS in few_rows.c
# The plain weights may take at most this share of the memory available at load.
MEMORY_SHARE = 0.25


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library, built on first use; None where it cannot be built or the CPU has no
    AVX512-BF16 (its products then all run oneDNN)."""
    lib = native_build.build(SOURCE, "SEQSERVE_FEW_ROWS", "every product runs oneDNN",
                             FUNCTIONS)
    return lib if lib is not None and lib.few_rows_vectorized() else None


def keep_plain(model: torch.nn.Module, available: int | None) -> bool:
    """Whether `model`'s bfloat16 CPU linear weights may be kept in their plain layout
    beside oneDNN's copy: the library runs here and they take at most MEMORY_SHARE of
    `available` bytes (None: not known, so not kept)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not weights or any(w.dtype != torch.bfloat16 or w.device.type != "cpu"
                          for w in weights):
        return False
    size = sum(w.numel() * w.element_size() for w in weights)
    if library() is None:
        return False
    if available is None or size > MEMORY_SHARE * available:
        logger.info("products of one to three rows run oneDNN: the plain linear weights (%d MB) "
                    "would take more than %d%% of the available memory", size >> 20,
                    round(MEMORY_SHARE * 100))
        return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor | None:
    """x [..., in] (bfloat16, at most MAX_ROWS rows) times the plain weight [out, in]
    (+ bias); None where the C loop does not take it (the caller runs oneDNN)."""
    rows = x.numel() // weight.shape[1]
    if (not 1 <= rows <= MAX_ROWS or x.dtype != torch.bfloat16
            or (bias is not None and bias.dtype != torch.bfloat16)):
        return None
    flat = x.reshape(rows, weight.shape[1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = library().linear_few_rows_bf16(
        flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), rows, out_features, weight.shape[1], flat.stride(0))
    if status != 0:
        raise ValueError(f"few_rows refused a [{rows}, {weight.shape[1]}] x "
                         f"[{weight.shape[1]}, {out_features}] product (status {status})")
    return y.reshape(*x.shape[:-1], out_features)
