"""q/k/v and gate/up as one prepacked product (kernels/fused_linears.py): the same bits as
the separate products, whatever order or inputs the members are called with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_service.kernels import fused_linears, linear_prepack

pytestmark = pytest.mark.skipif(not linear_prepack.runs(torch.bfloat16),
                                reason="no oneDNN bfloat16 prepacking on this CPU")


def siblings(names, hidden, widths, bias, seed):
    g = torch.Generator().manual_seed(seed)
    parent = nn.Module()
    for name, width in zip(names, widths):
        linear = nn.Linear(hidden, width, bias=bias).to(torch.bfloat16)
        linear.weight.data = (torch.randn(width, hidden, generator=g) * 0.05).bfloat16()
        if bias:
            linear.bias.data = torch.randn(width, generator=g).bfloat16()
        setattr(parent, name, linear)
    return parent


@pytest.mark.parametrize("names,hidden,widths,bias", [
    (("q_proj", "k_proj", "v_proj"), 576, (576, 192, 192), False),   # SmolLM2
    (("q_proj", "k_proj", "v_proj"), 1024, (1024, 256, 256), True),  # the Qwen2-GQA fixture
    (("gate_proj", "up_proj"), 768, (3072, 3072), False),            # the mid fixture
    (("q_proj", "k_proj", "v_proj"), 64, (64, 32, 32), True),        # tiny
])
@pytest.mark.parametrize("rows", [1, 33])
def test_fused_parts_give_the_separate_products_bits(names, hidden, widths, bias, rows):
    parent = siblings(names, hidden, widths, bias, seed=hidden + rows)
    with torch.inference_mode():  # inference tensors, as in the worker: no version counter
        x = (torch.randn(1, rows, hidden, generator=torch.Generator().manual_seed(rows)) * 2
             ).bfloat16()
        want = [linear_prepack.PrepackedLinear(getattr(parent, n))(x) for n in names]
        assert fused_linears.fuse_siblings(parent) == 1
        parts = [getattr(parent, n) for n in names]
        assert all(isinstance(p, fused_linears.FusedPart) for p in parts)
        got = [p(x) for p in parts]  # the model's order: the first computes, the rest slice
        other = x * -1.5
        # Out of order, repeated, and on another input: each recomputes where it must.
        shuffled = [parts[-1](other), parts[0](x), parts[0](other)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    fresh = siblings(names, hidden, widths, bias, seed=hidden + rows)
    with torch.inference_mode():
        alone = [linear_prepack.PrepackedLinear(getattr(fresh, n))(other) for n in names]
    assert torch.equal(shuffled[0], alone[-1])
    assert torch.equal(shuffled[1], want[0])
    assert torch.equal(shuffled[2], alone[0]) and not torch.equal(alone[0], want[0])


def test_only_matching_plain_linears_fuse():
    """Mixed bias, other input widths, or a member missing: those siblings stay alone; the
    fused product is registered once (so batch invariance checks its shape once)."""
    mixed = siblings(("q_proj", "k_proj", "v_proj"), 64, (64, 32, 32), False, 0)
    mixed.k_proj = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    partial = siblings(("gate_proj",), 64, (128,), False, 0)
    fine = siblings(("gate_proj", "up_proj"), 64, (128, 128), False, 0)
    assert fused_linears.fuse_siblings(nn.ModuleList([mixed, partial])) == 0
    assert fused_linears.fuse_siblings(fine) == 1
    packed = [m for m in fine.modules() if isinstance(m, linear_prepack.PrepackedLinear)]
    assert len(packed) == 1 and packed[0].out_features == 256
