"""oneDNN-prepacked weights (linear_prepack.py) for a tensor-parallel model's linear layers.

Under transformers' tensor-parallel plan a linear layer holds DTensor weights and its
`forward` is wrapped by its style (column-wise: this rank's output features; row-wise:
this rank's input features, then an all-reduce and the bias). For inference each style
takes a local path for any `nn.Linear`: it calls the layer's own forward on plain local
tensors. So a layer can keep its style and compute with a prepacked copy of its local
shard: `ShardPrepackedLinear` is an `nn.Linear` (that is what the styles test for) whose
forward runs the packed product, and the style is installed on it again. The bias stays
the style's: column-wise hands over this rank's slice, row-wise hides it and adds it once
after the all-reduce.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from worker_service.kernels.linear_prepack import BATCH_HINT


class ShardPrepackedLinear(nn.Linear):
    """This rank's shard of `linear` in oneDNN's blocked layout; global in/out features
    (what the styles read), no `weight` (the packed buffer replaces it)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        local = linear.weight.to_local().detach()
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(local, BATCH_HINT))
        self.bias = linear.bias  # a DTensor parameter (or None): its style handles it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (shard)"


def prepack_sharded_linears(model: nn.Module) -> int:
    """Swap each tensor-parallel `nn.Linear` of `model` (DTensor weight, a style in the
    model's plan) for a ShardPrepackedLinear with the same style; returns how many."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    swaps = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear or not isinstance(child.weight, DTensor):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            style = plan.get(re.sub(r"\.\d+\.", ".*.", full))
            if style is not None:
                swaps.append((parent, name, child, style))
    for parent, name, child, style in swaps:
        packed = ShardPrepackedLinear(child)
        ALL_PARALLEL_STYLES[style].install_forward(packed, child.weight.device_mesh)
        setattr(parent, name, packed)
    return len(swaps)
