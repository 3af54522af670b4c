"""The one-pass C norm, rotary embedding and SiLU gate product, and the stacked q/k/v
product, against transformers' eager code."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from tests.conftest import needs_onednn_bf16, tiny_model
from worker_service.engine import Engine
from worker_service.fixtures import make_model
from worker_service.kernels import fused_layers, fused_projections
from worker_service.kernels.linear_prepack import PrepackedLinear
from worker_service.model_runner import ModelRunner
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec


def bf16_model(arch: str):
    return make_model(tiny_model(arch).parent / f"tiny-{arch}-bf16", arch=arch, size="tiny",
                      dtype="bfloat16", seed=0)


@pytest.fixture(scope="module")
def eager_rotary():
    fused_layers.install(ModelRunner(str(bf16_model("llama")), dtype="bfloat16").model)
    fn = modeling_llama.apply_rotary_pos_emb
    assert hasattr(fn, "seqserve_original"), "installing patched the Llama rotary embedding"
    return fn, fn.seqserve_original


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 768, 100])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_norm_matches_eager_llama_rmsnorm(n, rows, dtype):
    """Widths with and without a tail past the 16-lane blocks, one row (decoding) to many
    (over the threshold where it splits rows over threads); bfloat16 and float32."""
    assert fused_layers.library() is not None, "the test machine has a C compiler"
    g = torch.Generator().manual_seed(n + rows)
    norm = modeling_llama.LlamaRMSNorm(n, eps=1e-5).to(dtype)
    norm.weight.data = (torch.randn(n, generator=g) * 0.5 + 1).to(dtype)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        want = norm(x)
        assert fused_layers.install(torch.nn.Sequential(norm))[0] == 1
        got = norm(x)
    assert got.dtype == dtype and got.shape == want.shape
    # Only the float32 sum of squares runs in another order: in bfloat16 a last-bit
    # difference at most, in float32 a few of its last bits.
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 1e-3
    bound = 1 / 128 if dtype == torch.bfloat16 else 1e-6
    assert ((got.float() - want.float()).abs() <= want.float().abs() * bound + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("tokens", [1, 19, 600])
def test_rotary_gives_the_eager_bits(eager_rotary, dim, tokens, dtype):
    """Bit-identical to transformers' apply_rotary_pos_emb, for head sizes with and without
    a tail past the 16-lane blocks, on the transposed views the attention passes in;
    bfloat16 and float32."""
    fused, eager = eager_rotary
    g = torch.Generator().manual_seed(dim + tokens)
    q = torch.randn(1, tokens, 6, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, 2, dim, generator=g).to(dtype).transpose(1, 2)
    cos = torch.randn(1, tokens, dim, generator=g).to(dtype)
    sin = torch.randn(1, tokens, dim, generator=g).to(dtype)
    with torch.inference_mode():
        got, want = fused(q, k, cos, sin), eager(q, k, cos, sin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # Other dtypes go to the original.
        got = fused(q.half(), k.half(), cos.half(), sin.half())
        want = eager(q.half(), k.half(), cos.half(), sin.half())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _mlp(hidden: int, inter: int, seed: int) -> modeling_llama.LlamaMLP:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                         num_key_value_heads=4)
    torch.manual_seed(seed)
    return modeling_llama.LlamaMLP(config).to(torch.bfloat16)


@pytest.mark.parametrize("hidden,inter,rows", [(64, 96, 1), (48, 100, 7), (64, 1536, 300),
                                               (32, 17, 5)])
def test_silu_gate_product_gives_the_eager_bits(hidden, inter, rows):
    """The MLP through the C product has the bits of transformers' eager MLP: one row
    (decoding) to many (over the threshold where it splits over threads), widths with a
    tail past the 16-lane blocks; float32 input runs the eager code."""
    mlp = _mlp(hidden, inter, rows)
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(inter)) * 4)
    with torch.inference_mode():
        want, want32 = mlp(x.bfloat16()), mlp.float()(x)
        mlp.bfloat16()
        assert fused_layers.install_mlp(torch.nn.Sequential(mlp)) == 1
        got = mlp(x.bfloat16())
        assert torch.equal(got, want)
        assert torch.equal(mlp.float()(x), want32)


def test_silu_gate_product_over_every_bfloat16_gate():
    """Every bfloat16 bit pattern as the gate (infinities, subnormals, both zeros), odd
    length: the product has eager's bits wherever eager's is not NaN, and is NaN there."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    gate = gate[torch.randperm(gate.numel(), generator=g)][:-3]  # finite values in the tail
    up = (torch.randn(gate.numel(), generator=g) * 8).bfloat16()
    with torch.inference_mode():
        want = torch.nn.functional.silu(gate) * up
    got = gate.clone()
    fused_layers.library().silu_mul_bf16(got.data_ptr(), up.data_ptr(), got.data_ptr(),
                                         fused_layers.silu_table().data_ptr(), got.numel())
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.skipif(not fused_layers.mlp_product_builds(torch.float32),
                    reason="no AVX2 and FMA: float32 MLPs keep torch's SiLU")
def test_float32_silu_gate_product_is_within_a_few_ulps_wherever_a_value_lies():
    """The float32 SiLU gate product (bfloat16 models computing in float32): against
    float64 within 3 units of float32's last place over gates from -100 to 100 (and zeros,
    infinities, subnormals), and the same bits for a value whether it falls in the 8-lane
    loop or the tail, in the flat and the stacked [gate | up] entry points."""
    g = torch.Generator().manual_seed(4)
    gate = torch.cat([torch.randn(5000, generator=g) * 30, torch.linspace(-100, 100, 2001),
                      torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), 88.0, -88.0])])
    up = torch.randn(gate.numel(), generator=g) * 4
    lib = fused_layers.library()
    got = torch.empty_like(gate)
    lib.silu_mul_f32(gate.data_ptr(), up.data_ptr(), got.data_ptr(), gate.numel())
    g64, u64 = gate.double(), up.double()
    want = g64 / (1 + torch.exp(-g64)) * u64
    ok = torch.isfinite(want) & (want.abs() > 1e-30)
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert ((got.double() - want).abs()[ok] <= 3 * ulp[ok]).all()
    assert torch.isinf(got[gate == float("inf")]).all()
    for shift in (1, 3, 7):  # every value moved to another lane, some into the tail
        moved = torch.empty(gate.numel() - shift)
        lib.silu_mul_f32(gate[shift:].contiguous().data_ptr(), up[shift:].contiguous().data_ptr(),
                         moved.data_ptr(), moved.numel())
        assert torch.equal(moved, got[shift:])
    rows, cols = 3, 1001
    stacked = torch.cat([gate[:rows * cols].view(rows, cols), up[:rows * cols].view(rows, cols)], 1)
    out = torch.empty(rows, cols)
    lib.silu_mul_rows_f32(stacked.data_ptr(), out.data_ptr(), None, rows, cols, 2 * cols)
    assert torch.equal(out.view(-1), got[:rows * cols])


@needs_onednn_bf16
def test_install_touches_only_llama_style_code_in_bfloat16_on_cpu():
    llama = ModelRunner(str(bf16_model("llama")), dtype="bfloat16", prepack=False).model
    assert fused_layers.install(llama) == (2 * 2 + 1, 1)  # 2 layers x 2 norms + final norm
    assert fused_layers.install_mlp(llama) == 2
    gpt2 = ModelRunner(str(bf16_model("gpt2")), dtype="bfloat16", prepack=False).model
    assert fused_layers.install(gpt2) == (0, 0)  # LayerNorm, learned positions
    assert fused_layers.install_mlp(gpt2) == 0  # GELU, no gate
    fp32 = ModelRunner(str(tiny_model("llama")), dtype="float32").model
    assert fused_layers.install(fp32) == (2 * 2 + 1, 1)  # float32 norms and rotary too
    assert fused_layers.install_mlp(fp32) == 0  # float32 keeps torch's SiLU unless stacked


@needs_onednn_bf16
def test_another_family_gets_the_c_rotary_after_llamas(monkeypatch):
    """Once a Llama model is installed, modeling_llama's name holds the wrapper; Qwen2's
    copy of the function must still be recognised and patched."""
    fused_layers.install(ModelRunner(str(bf16_model("llama")), dtype="bfloat16").model)
    assert hasattr(modeling_llama.apply_rotary_pos_emb, "seqserve_original")
    qwen2_fn = modeling_qwen2.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb",
                        getattr(qwen2_fn, "seqserve_original", qwen2_fn))
    qwen2 = ModelRunner(str(bf16_model("qwen2")), dtype="bfloat16", prepack=False).model
    assert fused_layers.install(qwen2)[1] == 1
    assert hasattr(modeling_qwen2.apply_rotary_pos_emb, "seqserve_original")


@needs_onednn_bf16
def test_tokens_with_and_without_the_c_loops(monkeypatch):
    """A bfloat16 model decodes the same greedy tokens, with log-probabilities within
    float32 noise, through the C loops and through transformers' eager code."""
    prompts = [[5 + i * 7 + j for j in range(3 + 11 * i)] for i in range(4)]
    outs = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(fused_layers, "library", lambda: None)
        runner = ModelRunner(str(bf16_model("qwen2")), dtype="bfloat16")
        engine = Engine(runner)
        steps = [engine.step([], [PrefillSpec(i, p, 0, DecodingParams(logprobs=0))
                                  for i, p in enumerate(prompts)], [[0, 1], [2, 3]])]
        for _ in range(6):
            steps.append(engine.step([], [], [[0, 1], [2, 3]]))
        outs.append([sorted((t.seq_id, t.token_id, t.logprob) for t in s.tokens)
                     for s in steps])
    for a, b in zip(*outs):
        assert [(s, t) for s, t, _ in a] == [(s, t) for s, t, _ in b]
        assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) < 0.02


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[tuple]]:
    engine = Engine(runner)
    results = [engine.step([], [PrefillSpec(i, p, 0, DecodingParams(logprobs=0))
                                for i, p in enumerate(prompts)], [[0, 1], [2, 3]])]
    for _ in range(steps):
        results.append(engine.step([], [], [[0, 1], [2, 3]]))
    return [sorted((t.seq_id, t.token_id, t.logprob) for t in s.tokens) for s in results]


@needs_onednn_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_products_give_the_same_bits(monkeypatch, arch):
    """One product for q, k and v and one for gate and up (read by the C SiLU product's
    row loop) give the separate products' bits: the same tokens and log-probabilities to
    the last bit, prompts and decoding."""
    prompts = [[5 + i * 7 + j for j in range(3 + 11 * i)] for i in range(4)]
    stacked = ModelRunner(str(bf16_model(arch)), dtype="bfloat16")
    layer = stacked.model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, fused_projections.ProductSlice)
    assert isinstance(layer.mlp.up_proj, fused_projections.ProductSlice)
    with_stack = _decode(stacked, prompts, 6)
    for name in ("fuse_qkv", "fuse_gate_up"):
        monkeypatch.setattr(fused_projections, name, lambda model, make: 0)
    separate = ModelRunner(str(bf16_model(arch)), dtype="bfloat16")
    layer = separate.model.model.layers[0]
    assert not isinstance(layer.self_attn.k_proj, fused_projections.ProductSlice)
    assert not isinstance(layer.mlp.up_proj, fused_projections.ProductSlice)
    assert with_stack == _decode(separate, prompts, 6)


def test_qkv_stacking_leaves_other_code_and_dtypes_alone():
    fp32 = ModelRunner(str(tiny_model("llama")), dtype="float32").model
    make = PrepackedLinear
    assert fused_projections.fuse_qkv(fp32, make) == fused_projections.fuse_gate_up(fp32, make) == 0
    gpt2 = ModelRunner(str(bf16_model("gpt2")), dtype="bfloat16").model  # c_attn: its own
    assert fused_projections.fuse_qkv(gpt2, make) == fused_projections.fuse_gate_up(gpt2, make) == 0


@needs_onednn_bf16
def test_stacked_qkv_product_with_biases():
    """The fixtures' biases are zero: here Qwen2's q/k/v biases are random."""
    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)
    attn = modeling_qwen2.Qwen2Attention(config, 0).to(torch.bfloat16)
    torch.manual_seed(3)
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    for p in projections:
        torch.nn.init.normal_(p.bias)
    x = torch.randn(1, 7, 64, dtype=torch.bfloat16)
    expected = [PrepackedLinear(p)(x) for p in projections]
    assert fused_projections.fuse_qkv(attn, PrepackedLinear) == 1
    assert all(torch.equal(p(x), e) for p, e in
               zip((attn.q_proj, attn.k_proj, attn.v_proj), expected))
