"""kernels/bf16_weights.py: float32 products over bfloat16 weights (CPUs without native
bfloat16) give the float32 copy's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker_service.kernels import bf16_weights, linear_prepack

pytestmark = pytest.mark.skipif(bf16_weights.library() is None,
                                reason="no C compiler or no AVX2 and FMA on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16, 17, 24, 25, 64, 129])
@pytest.mark.parametrize("k,n,bias,large", [(576, 960, False, False), (100, 13, True, False),
                                            (7, 5, True, False), (576, 960, False, True)])
@pytest.mark.parametrize("copy", [False, True])
def test_product_equals_the_float32_copys(monkeypatch, rows, k, n, bias, large, copy):
    if large:  # the output layer's rule: the C loop up to LARGE_WEIGHT_ROWS rows
        monkeypatch.setattr(bf16_weights, "LARGE_WEIGHT", k * n)
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    # A strided input: every other row of a larger tensor, as a packed batch's slices are.
    x = torch.randn(1, 2 * rows, k, generator=g)[:, ::2]
    module = bf16_weights.Bf16WeightLinear(linear, copy)
    assert module.packed == (copy and linear_prepack.runs(torch.float32))
    wide, wide_bias = linear.weight.float(), None if not bias else linear.bias.float()
    with torch.inference_mode():
        expected = F.linear(x, wide, wide_bias)
        got = module(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    small = module.large_rows if large else bf16_weights.SMALL_ROWS
    if rows > small and module.packed:
        # oneDNN's float32 product over the prepacked copy, bit for bit.
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(wide, bf16_weights.PACK_HINT)
            direct = torch.ops.mkldnn._linear_pointwise(x, packed, wide_bias, "none", [], "")
        assert torch.equal(got, direct)
    elif rows > small:
        assert torch.equal(got, expected)  # torch's float32 product on the float32 weight
    # The C loop and oneDNN sum in another order than F.linear: float32 rounding of a
    # k-term sum, no more.
    scale = (x.abs() @ wide.abs().T) + 1
    assert ((got - expected).abs() / scale).max() < 1e-5


@pytest.mark.parametrize("copy", [False, True])
def test_install_keeps_bfloat16_weights_once_and_computes_in_float32(copy):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=300,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert bf16_weights.install(model, copy) == 2 * 7 + 2  # 7 products a layer, lm_head, embedding
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embed.weight.dtype == head.weight.dtype == torch.bfloat16
    assert embed.weight.data_ptr() == head.weight.data_ptr()  # tied: one table
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (head.wide is not None) == copy
    ids = torch.tensor([[(i * 37) % 300 for i in range(40)]])  # 40 rows: the many-row path
    with torch.inference_mode():
        got = model(ids).logits
        expected = reference(ids).logits
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("rows", [1, 5, 24, 40])
def test_stacked_qkv_over_bfloat16_weights(rows):
    """q, k and v stacked into one bfloat16-weight product (fused_projections) give the
    separate products' results: the same bits through the C loop, whose sum for an output
    column does not depend on the other weight rows, and float32 rounding past it."""
    from transformers import Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2

    from worker_service.kernels import fused_projections

    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)
    attn = modeling_qwen2.Qwen2Attention(config, 0).to(torch.bfloat16)
    torch.manual_seed(rows)
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    for p in projections:
        torch.nn.init.normal_(p.bias)  # Qwen2 has q/k/v biases
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        expected = [bf16_weights.Bf16WeightLinear(p, True)(x) for p in projections]
        assert fused_projections.fuse_qkv(
            attn, lambda linear: bf16_weights.Bf16WeightLinear(linear, True)) == 1
        got = [p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    for g, e in zip(got, expected):
        if rows <= bf16_weights.SMALL_ROWS:
            assert torch.equal(g, e)
        else:
            assert (g - e).abs().max() < 1e-4
