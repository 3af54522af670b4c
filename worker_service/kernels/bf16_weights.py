"""bfloat16 models on CPUs without native bfloat16: float32 arithmetic over bfloat16 weights.

Where oneDNN has no bfloat16 path (AVX2 without AVX512: Zen 3 and older EPYCs, Intel before
Skylake-X), torch's own bfloat16 products run at 5-20 GFLOP/s, 4-6x slower than float32
at 16-64 rows. Computing in float32 is exact for the weights (float32 holds every bfloat16
value) but doubles their bytes, and a decoding step of few rows is all weight reads: on
an AVX2 EPYC, SmolLM2's one-row step took 77 ms in float32 against 36 ms in bfloat16.

So the weights of the linear layers and the embeddings stay bfloat16 and everything
computes in float32. Every product runs `bf16_weights.c` over the weight packed once into
blocks of 16 columns: up to 8 rows its tiles widen the bfloat16 weight in registers (the
product is the weight's bytes), from more each block is widened to float32 once per chunk
of rows and 6-row tiles of fused multiply-adds stream it from cache. On an AVX2 EPYC, 2
threads, SmolLM2's products ran 1.05-1.74x as fast as the loops before it (a C loop up to
24 rows, oneDNN's prepacked float32 copy above), and no float32 copy is kept
(docs/benchmarks.md). An output is its row and column summed in one order (position by
position), so a row has the same bits at every row count; they differ from torch's
float32 product in the last bits of some values.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.kernels import native_build

SOURCE = Path(__file__).with_name("bf16_weights.c")
_P, _I = native_build.P, native_build.I64
FUNCTIONS = {"linear_bf16p": ([_P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
             "bf16w_vectorized": ([], ctypes.c_int)}
BLOCK = 16  # output columns of a packed block: two float32 vectors of 8
# Where a block's 16 columns lie: one 256-bit load interleaved with zeros takes slots 0-3
# and 8-11 (unpacklo) and 4-7 and 12-15 (unpackhi) of it, which are to be columns 0-7
# and 8-15.
SLOT_COLUMNS = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


@functools.cache
def library():
    """The C library, built on first use; None where it cannot be built or has no AVX2
    loop (then the model computes in float32 with float32 weights)."""
    lib = native_build.build(SOURCE, "SEQSERVE_BF16_WEIGHTS",
                             "bfloat16 weights are widened to float32 at load", FUNCTIONS)
    return lib if lib is not None and lib.bf16w_vectorized() else None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] (bfloat16) -> [ceil(n / 16), k, 16]: blocks of 16 columns, each
    position's 16 weights together in the slots the C loop unpacks (SLOT_COLUMNS);
    columns past n are zero."""
    n, k = weight.shape
    padded = -n % BLOCK
    if padded:
        weight = torch.cat([weight, weight.new_zeros(padded, k)])
    return weight.reshape(-1, BLOCK, k)[:, list(SLOT_COLUMNS)].transpose(1, 2).contiguous()


class Bf16WeightLinear(nn.Module):
    """nn.Linear over a bfloat16 weight, in float32: float32 inputs and outputs."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The plain weight stays for whoever reads it (a tied embedding shares it, the
        # runner reads the vocabulary from the output layer's); the C loop reads the packed.
        self.register_buffer("weight", linear.weight.detach().contiguous())
        self.register_buffer("packed", pack(self.weight))
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            status = library().linear_bf16p(
                flat.data_ptr(), self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows,
                self.out_features, self.in_features, flat.stride(0))
            if status != 0:
                raise MemoryError(f"bfloat16-weight product of {rows} rows x "
                                  f"{self.in_features} -> {self.out_features}: out of memory "
                                  f"for its widened block (status {status})")
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


def install(model: nn.Module) -> int:
    """Make a bfloat16 CPU `model` compute in float32 with its nn.Linear and nn.Embedding
    weights kept bfloat16 (every other parameter and buffer becomes float32); returns how
    many modules keep bfloat16 weights, 0 where the C library is missing (nothing is
    changed then)."""
    if library() is None:
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16)
             or (type(child) is nn.Embedding and child.weight.dtype == torch.bfloat16
                 and child.max_norm is None)]
    for parent, name, child in swaps:
        setattr(parent, name, Bf16WeightLinear(child) if isinstance(child, nn.Linear)
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
