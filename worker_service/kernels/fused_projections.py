"""One product for an attention layer's query, key and value projections, and for an MLP's
gate and up projections (bfloat16 weights, CPU).

Eager attention multiplies the same hidden states by three weights; on CPU each product is
a oneDNN call with its own dispatch and OpenMP region (about 25 us of overhead a call here,
and on a shared machine a region can wait out another process's time slice). With the
three weights stacked into one prepacked weight, one call computes all three: oneDNN
reduces every output column in the same order whatever the weight's height, so the bits
equal the three products (tests/test_fused_layers.py checks it on the fixtures' shapes;
vLLM stacks them the same way, as QKVParallelLinear).

Over bfloat16 weights computed in float32 (bf16_weights.py, CPUs without native bfloat16)
q, k and v are stacked too: one stream of weight rows for a decoding step's few rows.

The model's own attention code is kept: `q_proj`, `k_proj` and `v_proj` become slices of
one shared product, computed when the first of them is called with a hidden-states
tensor and handed out to the other two for that same tensor. Only attention classes whose
forward is known to call the three on one input are changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from worker_service.kernels import fused_layers
from worker_service.kernels.fused_layers import same_code

# Makes the stacked product's module from the stacked nn.Linear (PrepackedLinear,
# Bf16WeightLinear).
Make = Callable[[nn.Linear], nn.Module]

# Attention forwards that call q_proj, k_proj and v_proj once each on the same tensor.
KNOWN_FORWARDS = (modeling_llama.LlamaAttention.forward,
                  modeling_mistral.MistralAttention.forward,
                  modeling_qwen2.Qwen2Attention.forward)
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@dataclass(slots=True)
class _Memo:
    """The product of the tensor last seen, until every slice of it was taken."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    served: int = 0


class SharedProduct(nn.Module):
    """The stacked product, computed once per input tensor for the slices that share it."""

    def __init__(self, linear: nn.Module, parts: int):
        super().__init__()
        self.linear = linear
        self._parts = parts
        # A plain object: assigning nn.Module attributes (three per slice, in every
        # layer) took 1 ms of a thin 30-layer step.
        self._memo = _Memo()
        self._product = linear.__call__  # a bound method: no second submodule

    def take(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        memo = self._memo
        if x is not memo.input:  # identity: a new tensor, whatever its values
            memo.input, memo.output, memo.served = x, self._product(x), 0
        out = memo.output[..., lo:hi]
        memo.served += 1
        if memo.served == self._parts:  # every slice taken: hold nothing between layers
            memo.input = memo.output = None
        return out


class ProductSlice(nn.Module):
    """Stands for one projection: columns [lo, hi) of the shared product."""

    def __init__(self, product: SharedProduct, lo: int, hi: int):
        super().__init__()
        self.product, self.lo, self.hi = product, lo, hi
        self.in_features, self.out_features = product.linear.in_features, hi - lo
        self._take = product.take  # not through nn.Module.__getattr__ on every call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._take(x, self.lo, self.hi)


def _stack(module: nn.Module, names: tuple[str, ...], make: Make) -> bool:
    """Replace `module`'s linears `names` by slices of one stacked product, `make` of the
    stacked nn.Linear, if they are plain bfloat16 CPU linears over the same input width,
    all with or all without a bias."""
    linears = [getattr(module, n, None) for n in names]
    if any(type(p) is not nn.Linear for p in linears):
        return False
    if (any(p.weight.dtype != torch.bfloat16 or p.weight.device.type != "cpu"
            for p in linears)
            or len({p.in_features for p in linears}) != 1
            or len({p.bias is None for p in linears}) != 1):
        return False
    stacked = nn.Linear(linears[0].in_features, sum(p.out_features for p in linears),
                        bias=linears[0].bias is not None, dtype=torch.bfloat16)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([p.weight.detach() for p in linears]))
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([p.bias.detach() for p in linears]))
    product = SharedProduct(make(stacked), len(linears))
    lo = 0
    for name, p in zip(names, linears):
        setattr(module, name, ProductSlice(product, lo, lo + p.out_features))
        lo += p.out_features
    return True


def fuse_qkv(model: nn.Module, make: Make) -> int:
    """Stack the q/k/v weights of `model`'s known attention layers into one product each
    (bfloat16 on CPU, before the other linears are replaced); returns how many layers."""
    return sum(_stack(m, QKV, make) for m in model.modules()
               if any(same_code(type(m).forward, ref) for ref in KNOWN_FORWARDS))


def fuse_gate_up(model: nn.Module, make: Make) -> int:
    """Stack the gate and up weights of `model`'s Llama-style gated SiLU MLPs into one
    product each (their forward calls both on one tensor; fused_layers.install_mlp's C
    product reads both halves of it); returns how many. Call it before install_mlp and
    before the other linears are replaced."""
    return sum(_stack(m, GATE_UP, make) for m in model.modules()
               if fused_layers.gated_silu_mlp(m))
