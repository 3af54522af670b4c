"""kernels/bf16_weights.py: float32 products over bfloat16 weights (CPUs without native
bfloat16) give the float32 copy's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker_service.kernels import bf16_weights

pytestmark = pytest.mark.skipif(bf16_weights.library() is None,
                                reason="no C compiler or no AVX2 and FMA on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13, 16, 17, 64, 129])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (100, 13, True), (7, 5, True),
                                      (64, 48, True), (1536, 40, False), (2821, 20, True)])
def test_product_equals_the_float32_copys(rows, k, n, bias):
    """Every row rule (packed tiles up to 8 rows, widened blocks from 9; tiles of 4 and 6
    rows with their remainders; blocks widened in pieces, the last one shorter; rows in
    several chunks), columns that end inside a block, biases, strided inputs."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    # A strided input: every other row of a larger tensor, as a packed batch's slices are.
    x = torch.randn(1, 2 * rows, k, generator=g)[:, ::2]
    module = bf16_weights.Bf16WeightLinear(linear)
    wide, wide_bias = linear.weight.float(), None if not bias else linear.bias.float()
    with torch.inference_mode():
        expected = F.linear(x, wide, wide_bias)
        got = module(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # Summed position by position in float32, one fused multiply-add each: the exact sum
    # (float64) within float32 rounding of a k-term sum.
    exact = x.double() @ wide.double().T + (0 if wide_bias is None else wide_bias.double())
    scale = (x.abs() @ wide.abs().T).double() + 1
    assert ((got.double() - exact).abs() / scale).max() < k * 2**-24
    assert ((got - expected).abs() / scale).max() < 1e-5
    # Each row's bits are its own, whatever the row count: row by row, and in the other
    # loop (one row reads the packed weight; more than 8 widen it).
    with torch.inference_mode():
        for r in {0, rows // 2, rows - 1}:
            assert torch.equal(module(x[:, r : r + 1]), got[:, r : r + 1])
        if rows <= 8:
            many = module(x.repeat(1, 3, 1))
            assert torch.equal(many[:, :rows], got)


def test_packed_blocks_hold_the_columns_where_the_loop_unpacks_them():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3).bfloat16()
    packed = bf16_weights.pack(weight)
    assert packed.shape == (2, 3, 16)
    assert packed[0, 1].tolist() == [weight[c, 1].item() for c in bf16_weights.SLOT_COLUMNS]
    assert packed[1, 2, :4].tolist() == [weight[16 + c, 2].item() for c in range(4)]
    assert packed[1, 2, 4:].abs().sum() == 0 and packed[1, 0, 8:12].abs().sum() == 0


def test_install_keeps_bfloat16_weights_once_and_computes_in_float32():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=300,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert bf16_weights.install(model) == 2 * 7 + 2  # 7 products a layer, lm_head, embedding
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embed.weight.dtype == head.weight.dtype == torch.bfloat16
    assert embed.weight.data_ptr() == head.weight.data_ptr()  # tied: one table
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert head.packed.dtype == torch.bfloat16 and not hasattr(head, "wide")
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
    separate products' bits: the C loop's sum for an output column does not depend on the
    other weight rows."""
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
        expected = [bf16_weights.Bf16WeightLinear(p)(x) for p in projections]
        assert fused_projections.fuse_qkv(attn, bf16_weights.Bf16WeightLinear) == 1
        got = [p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
