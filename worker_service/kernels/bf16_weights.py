"""bfloat16 models on CPUs without native bfloat16: float32 arithmetic over bfloat16 weights.

Where oneDNN has no bfloat16 path (AVX2 without AVX512: Zen 3 and older EPYCs, Intel before
Skylake-X), torch's own bfloat16 products run at 5-20 GFLOP/s, 4-6x slower than float32
at 16-64 rows. Computing in float32 is exact for the weights (float32 holds every bfloat16
value) but doubles their bytes, and a decoding step of few rows is all weight reads: on
an AVX2 EPYC, SmolLM2's one-row step took 77 ms in float32 against 36 ms in bfloat16.

So the weights of the linear layers and the embeddings stay bfloat16 and everything
computes in float32: products of few rows run `bf16_weights.c`, which reads each weight
once as bfloat16 and widens it in registers; larger products run torch's float32 product,
whose time is arithmetic, over a float32 copy of the weight where memory allows it (see
cpu_dtype.py; prepacked in oneDNN's blocked layout where oneDNN runs float32, which
multiplies 1.1-2.3x faster than MKL over the plain copy at these shapes), else over the
weight widened per product into a scratch buffer. The model
then computes what its float32 copy computes, up to the order of float32 sums in the C
loop.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.kernels import linear_prepack, native_build

SOURCE = Path(__file__).with_name("bf16_weights.c")
_P, _I = native_build.P, native_build.I64
FUNCTIONS = {"linear_bf16w": ([_P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
             "bf16w_vectorized": ([], ctypes.c_int)}
# Rows up to which the C loop beats torch's float32 product, over a float32 copy of the
# weight (kept where memory allows) or over the weight widened per call: 24, and for
# weights too large to stay in cache (an output layer) 128, or 32 over a copy in oneDNN's
# layout. Measured on an AVX2 EPYC, 2 threads, at SmolLM2's shapes (docs/benchmarks.md).
SMALL_ROWS = 24
LARGE_WEIGHT, LARGE_WEIGHT_ROWS, PACKED_LARGE_WEIGHT_ROWS = 1 << 22, 128, 32
# The row count oneDNN lays the float32 copy out for. Against MKL's product over the plain
# copy, at SmolLM2's shapes: 1.1-1.5x at 8-256 rows, 0.87-1.24x at 2048, 2.3x for the
# output layer at 64 rows; the hint 1 layout gained less at 8-64 rows.
PACK_HINT = 32


@functools.cache
def library():
    """The C library, built on first use; None where it cannot be built or has no AVX2
    loop (then the model computes in float32 with float32 weights)."""
    lib = native_build.build(SOURCE, "SEQSERVE_BF16_WEIGHTS",
                             "bfloat16 weights are widened to float32 at load", FUNCTIONS)
    return lib if lib is not None and lib.bf16w_vectorized() else None


class _Scratch:
    """One float32 buffer the large products widen their weight into (a forward runs one
    product at a time), grown to the largest weight."""

    buffer = torch.empty(0)

    @classmethod
    def widen(cls, weight: torch.Tensor) -> torch.Tensor:
        if cls.buffer.numel() < weight.numel():
            cls.buffer = torch.empty(weight.numel(), dtype=torch.float32)
        return cls.buffer[: weight.numel()].view(weight.shape).copy_(weight)


class Bf16WeightLinear(nn.Module):
    """nn.Linear over a bfloat16 weight, in float32: float32 inputs and outputs. `copy`:
    also keep the weight in float32 for products of many rows."""

    def __init__(self, linear: nn.Linear, copy: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().contiguous())
        # The copy in oneDNN's blocked layout where oneDNN runs float32 here.
        self.packed = copy and linear_prepack.runs(torch.float32)
        self.wide = None
        if copy:
            wide = self.weight.float()
            self.wide = (torch.ops.mkldnn._reorder_linear_weight(wide, PACK_HINT)
                         if self.packed else wide)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().float(), requires_grad=False))
        self.large_rows = PACKED_LARGE_WEIGHT_ROWS if self.packed else LARGE_WEIGHT_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        rows = x.numel() // self.in_features
        if rows > (self.large_rows if self.weight.numel() >= LARGE_WEIGHT else SMALL_ROWS):
            if self.packed:
                return torch.ops.mkldnn._linear_pointwise(x, self.wide, self.bias, "none",
                                                          [], "")
            wide = self.wide if self.wide is not None else _Scratch.widen(self.weight)
            return F.linear(x, wide, self.bias)
        flat = x.reshape(rows, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = library().linear_bf16w(
            flat.data_ptr(), self.weight.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows,
            self.out_features, self.in_features, flat.stride(0))
        if status != 0:
            raise MemoryError(f"bfloat16-weight product of {rows} rows x {self.in_features} "
                              f"-> {self.out_features}: out of memory for its buffer "
                              f"(status {status})")
        return out.view(*x.shape[:-1], self.out_features)


class Bf16WeightEmbedding(nn.Module):
    """nn.Embedding over a bfloat16 table, giving float32 rows (the widening is exact)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.register_buffer("weight", embedding.weight.detach())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).float()


def copy_bytes(model: nn.Module) -> int:
    """Bytes a float32 copy of `model`'s bfloat16 nn.Linear weights takes."""
    return sum(m.weight.numel() * 4 for m in model.modules()
               if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16)


def install(model: nn.Module, copy: bool) -> int:
    """Make a bfloat16 CPU `model` compute in float32 with its nn.Linear and nn.Embedding
    weights kept bfloat16 (every other parameter and buffer becomes float32; `copy`: the
    linear weights also in float32, for products of many rows); returns how many modules
    keep bfloat16 weights, 0 where the C library is missing (nothing is changed then)."""
    if library() is None:
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16)
             or (type(child) is nn.Embedding and child.weight.dtype == torch.bfloat16
                 and child.max_norm is None)]
    for parent, name, child in swaps:
        setattr(parent, name, Bf16WeightLinear(child, copy) if isinstance(child, nn.Linear)
                else Bf16WeightEmbedding(child))
    for module in model.modules():
        if isinstance(module, (Bf16WeightLinear, Bf16WeightEmbedding)):
            continue
        for key, p in module._parameters.items():
            if p is not None and p.dtype == torch.bfloat16:
                module._parameters[key] = nn.Parameter(p.detach().float(), requires_grad=False)
        for key, b in module._buffers.items():
            if b is not None and b.dtype == torch.bfloat16:
                module._buffers[key] = b.float()
    return len(swaps)
