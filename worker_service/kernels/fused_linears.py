"""One prepacked product for sibling linear layers that read the same input.

A Llama-family layer runs q, k and v as three products over the same hidden states, and
gate and up as two. oneDNN's product over the concatenated weights gives each output
element the same bits as the separate products (its reduction over the input dimension
does not depend on the output width; the unit test checks this on the fixtures' shapes),
in one call instead of three, and a wider product runs closer to the GEMM peak when a
step has few rows: a bfloat16 [1, 576] x [576, 960] product runs at about 38 GFLOP/s,
576 x 192 at far less (docs/benchmarks.md, issue 21).

The model's own code still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` in turn, so no
modeling code is replaced: each member is a `FusedPart` that hands out its slice of the
group's product. The first member called on an input computes the whole product; the
others take their slices when they are called on the very same tensor object (and,
outside inference mode, unmodified: torch's in-place version counter). Any other call order or input
recomputes the product for that input, so a model whose siblings read different inputs
stays correct, only slower.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_service.kernels.linear_prepack import PrepackedLinear

# Sibling names whose layers read the same hidden states in the architectures transformers
# writes this way (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3's split variants, ...).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProduct(nn.Module):
    """The prepacked product of a group's concatenated weights, and the last input's result
    until every member has taken its slice."""

    def __init__(self, linears: list[nn.Linear], min_rows: int):
        super().__init__()
        first = linears[0]
        bias = None if first.bias is None else torch.cat([m.bias.detach() for m in linears])
        joined = nn.Linear(first.in_features, sum(m.out_features for m in linears),
                           bias=bias is not None, device="meta")
        joined.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]),
                                     requires_grad=False)
        if bias is not None:
            joined.bias = nn.Parameter(bias, requires_grad=False)
        self.product = PrepackedLinear(joined, min_rows)
        self.sizes = [m.out_features for m in linears]
        self._source: torch.Tensor | None = None
        self._version: int | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: list[bool] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for input `x`."""
        version = _version(x)
        if x is not self._source or version != self._version or self._taken[index]:
            self._parts = self.product(x).split(self.sizes, -1)
            self._source, self._version = x, version
            self._taken = [False] * len(self.sizes)
        self._taken[index] = True
        out = self._parts[index]
        if all(self._taken):  # drop the references: nothing more will be taken
            self._source, self._parts = None, ()
        return out


def _version(x: torch.Tensor) -> int | None:
    """torch's in-place version counter of `x`; None for tensors made under inference mode,
    which keep none (there identity alone says it is the same input: the modeling code
    passes its siblings the one tensor and writes nothing into it between their calls)."""
    return None if x.is_inference() else x._version


class FusedPart(nn.Module):
    """Stands where one of the group's nn.Linear layers stood; its output is a slice (a
    view, last dimension contiguous) of the group's product."""

    def __init__(self, shared: FusedProduct, index: int, linear: nn.Linear, owner: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.index = index
        if owner:  # registered once, so model.modules() (and state) see the product once
            self.shared = shared
        else:
            object.__setattr__(self, "shared", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(self.index, x)


def fuse_siblings(model: nn.Module, min_rows: int = 1) -> int:
    """Replace each group of GROUPS that a module holds as plain nn.Linear children (same
    input width, dtype and device; all with or all without bias) by FusedParts over one
    prepacked product; returns the number of groups fused. Call it before
    linear_prepack.prepack_linears, which then packs the remaining layers."""
    fused = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(parent, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            first = linears[0]
            if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                   or m.weight.device != first.weight.device
                   or (m.bias is None) != (first.bias is None) for m in linears):
                continue
            shared = FusedProduct(linears, min_rows)
            for i, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, FusedPart(shared, i, linear, owner=i == 0))
            fused += 1
    return fused
