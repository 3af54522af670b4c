"""The dtype a half-precision model computes in on a CPU without a native path for it.

float32 holds every float16 and bfloat16 value exactly, so the weights convert without loss
and only rounding inside operations changes (it shrinks). Without oneDNN's half-precision
path torch runs its own reference kernels: bfloat16 products of 16-64 rows at SmolLM2's
shapes 4-6x slower than float32 on an AVX2 EPYC, float16 twice as slow on an AVX512 one.
So such a model computes in float32: a bfloat16 one over its bfloat16 weights where the C
products build (kernels/bf16_weights.py: a decoding step costs bfloat16's bytes, and the
weights are also kept packed for the C loop, in bfloat16), else as a float32 copy; where a
float32 copy would take more than half the free memory, a model keeps its dtype and the log
says it is slow.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker_service.kernels import bf16_weights, fused_layers, fused_projections, linear_prepack

logger = logging.getLogger(__name__)

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def available_memory() -> int | None:
    """Bytes of memory Linux says a new allocation can take (MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def settle(model: nn.Module, swap_modules: bool = True) -> nn.Module:
    """`model` (on CPU) made to compute in float32 where its half precision has no oneDNN
    path on this CPU (above); returns it, or its float32 copy. `swap_modules` False (a
    tensor-parallel shard, whose plan wraps the linear layers): no bfloat16 weights kept."""
    if model.dtype not in _NAMES or linear_prepack.runs(model.dtype):
        return model
    name, why = _NAMES[model.dtype], linear_prepack.half_reason(model.dtype)
    available = available_memory()

    def fits(extra: int) -> bool:
        return available is None or extra <= available // 2

    extra = sum(p.numel() * 2 for p in model.parameters() if p.dtype == model.dtype)
    if (swap_modules and model.dtype == torch.bfloat16
            and bf16_weights.library() is not None):
        # q, k and v as one product: one call and one stream of weight blocks for the C
        # loop, where three products of a few rows each would wait on their barriers.
        qkv = fused_projections.fuse_qkv(model, bf16_weights.Bf16WeightLinear)
        # gate and up too where the float32 C SiLU product reads both halves of one
        gate_up = (fused_projections.fuse_gate_up(model, bf16_weights.Bf16WeightLinear)
                   if fused_layers.mlp_product_builds(torch.float32) else 0)
        kept = bf16_weights.install(model)
        logger.warning("this CPU has no native bfloat16 (%s): the model computes in float32, "
                       "with the weights of its linear layers and embeddings kept in "
                       "bfloat16 (kernels/bf16_weights.py: %d modules; q, k and v stacked "
                       "into one product in %d layers, gate and up in %d)", why,
                       kept + qkv + gate_up, qkv, gate_up)
        return model
    if not fits(extra):
        logger.warning("this CPU has no native %s (%s), and a float32 copy would take %.1f GiB "
                       "more of %.1f GiB available: the model stays in %s, whose products run "
                       "several times slower here than float32", name, why, extra / 2**30,
                       available / 2**30, name)
        return model
    logger.warning("this CPU has no native %s (%s): the model computes in float32 (exact "
                   "conversion, twice the memory)", name, why)
    return model.float()


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model`'s hidden states have: float32 where bf16_weights installed its
    modules (their weights are bfloat16, the rest float32), else the model's."""
    if any(isinstance(m, bf16_weights.Bf16WeightLinear) for m in model.modules()):
        return torch.float32
    return model.dtype
