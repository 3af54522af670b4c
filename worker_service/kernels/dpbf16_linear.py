"""bfloat16 linear products in C over pair-packed weights (`dpbf16_linear.c`), on CPUs
with AVX512-BF16.

oneDNN's prepacked product is fast on a warm weight, but a model's layers stream from
memory, and there it lost much of its speed: SmolLM2's 30 layers' products took 15.2 ms
at one row (14 GB/s of weights), 19.7 ms at 16 rows (172 GFLOP/s) and 44.6 ms at 64 (305
GFLOP/s) on this project's EPYC, 2 threads. The C loop (one 512-bit weight load feeds the
dot instruction for up to six rows, each thread streaming its own columns once) took 8.3,
14.8 and 36.7 ms, and stays 2-6% ahead up to 1024 rows (407 against 383-399 GFLOP/s), so
on such CPUs it runs every product of a bfloat16 model: decoding steps of any size and
prompts (docs/benchmarks.md). The packed weight replaces oneDNN's, so memory does not grow.

Every output is its own input row and weight column summed in one fixed order, so a row
has the same bits at every row count: batch-invariant mode needs no padding row with it.
Its results differ from oneDNN's in the last bits of some values (another order of float32
sums). `SEQSERVE_DPBF16_LINEAR=0` keeps oneDNN.

Where the CPU has AMX (Sapphire Rapids and later Xeons), the same packed weights feed its
tile unit instead, for every weight whose input width is a multiple of 32: on a 2-core
Sapphire Rapids guest the dot-instruction loop ran SmolLM2's products at 211-237 GFLOP/s
and oneDNN (which uses the tiles) at 1.7-2.8 TFLOP/s from 16 rows on.
`SEQSERVE_AMX=0` keeps the dot-instruction loop there.

Two more entry points serve step_layers.c, each the product and what follows it in one
pass with the same bits, on whichever loop the product itself takes: `linear_silu_dpbf16`
(the stacked gate/up product and the SiLU gate product; on the tiles from 32 rows) and
`linear_add_dpbf16` (a product added into its output, the residual adds). On the tiles
they saved 8-13% of a 2048-token prefill. On the dot loop the SiLU's table look-up is the
epilogue's cost (about 8% of the gate/up product at 2048 rows on a Zen 5 EPYC), so from 65
rows on each register tile finishes the previous tile's SiLU outputs inside its own k loop,
where the dot instructions hide it: the product with its SiLU then runs at the stored
product's rate (518 against 485 GFLOP/s on one core).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from worker_service.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("dpbf16_linear.c")
_P, _I = native_build.P, native_build.I64
FUNCTIONS = {"linear_dpbf16": ([_P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
             "linear_silu_dpbf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _P], ctypes.c_int),
             "linear_add_dpbf16": ([_P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
             "dpbf16_vectorized": ([], ctypes.c_int), "amx_enable": ([], ctypes.c_int)}
BLOCK = 16  # output columns of a packed block (the dot instruction's float32 lanes)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library, built on first use; None where it cannot be built or the CPU has no
    AVX512-BF16 (products then run oneDNN)."""
    lib = native_build.build(SOURCE, "SEQSERVE_DPBF16_LINEAR", "linear products run oneDNN",
                             FUNCTIONS)
    if lib is None or not lib.dpbf16_vectorized():
        return None
    if os.environ.get("SEQSERVE_AMX", "1") != "0" and lib.amx_enable():
        _amx_granted.append(True)
        logger.info("bfloat16 products run on the AMX tiles (SEQSERVE_AMX=0: the AVX512-BF16 "
                    "loop)")
    return lib


_amx_granted: list[bool] = []  # set once by library(): the tiles were asked for and granted


def uses_amx() -> bool:
    """Whether the C products run on AMX tiles in this process (k a multiple of 32): fixed
    when the library loaded, whatever SEQSERVE_AMX says later."""
    return library() is not None and bool(_amx_granted)


def takes(weight: torch.Tensor) -> bool:
    """Whether the C product runs this weight [out, in]: bfloat16 on CPU, an even input
    width (the loop reads inputs in pairs), and the library here."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.shape[1] % 2 == 0 and weight.shape[1] > 0
            and library() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] -> [ceil(n / 16), k / 2, 16, 2]: 16-column blocks, each pair of input
    positions' 16 x 2 weights together (the C file's layout); padding columns are zero."""
    n, k = weight.shape
    padded = -n % BLOCK
    if padded:
        weight = torch.cat([weight, weight.new_zeros(padded, k)])
    return weight.reshape(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x [..., in] (bfloat16) times the packed weight (+ bias) -> [..., out_features]."""
    k = packed.shape[1] * 2
    if x.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise TypeError(f"the C bfloat16 product got {x.dtype} inputs"
                        f"{'' if bias is None else f' and a {bias.dtype} bias'}: the "
                        "model's activations should be bfloat16 here")
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    if rows:
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        status = library().linear_dpbf16(
            flat.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), rows, out_features, k, flat.stride(0))
        if status != 0:
            raise ValueError(f"the C bfloat16 product refused a [{rows}, {k}] x [{k}, "
                             f"{out_features}] product (status {status})")
    return y.reshape(*x.shape[:-1], out_features)
