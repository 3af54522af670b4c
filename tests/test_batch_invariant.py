"""option.batch_invariant (worker_service/batch_invariance.py): in bfloat16 a request's
tokens and log-probabilities are the same alone and in a full batch of other prompts."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, Client
from seqserve_common.config import ConfigError, load_config
from tests.conftest import MODELS, needs_onednn_bf16, tiny_model
from worker_service.fixtures import make_model

# Different prompts of different lengths; the batch is full with all of them.
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three primary colors:", "Tell me an interesting fact about llamas.",
           "What is the best way to cook a steak?", "Recommend some interesting books to read.",
           "Are you familiar with the Special Theory of Relativity and can you explain it to me?"]
PARAMS = dict(max_new_tokens=32, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_bf16():
    """A tiny bfloat16 Llama whose MLP is wide enough for oneDNN's one-row product to round
    differently from its batched one (without the option, requests 4-7 above got other
    log-probabilities alone than together)."""
    return make_model(MODELS / "wide-llama-bf16", arch="llama", size="wide", dtype="bfloat16")


def test_option_is_a_validated_serving_option():
    assert load_config(env={}).batch_invariant is False
    assert load_config(env={"OPTION_BATCH_INVARIANT": "true"}).batch_invariant is True
    with pytest.raises(ConfigError, match=r"option.batch_invariant='sometimes'.*true or false"):
        load_config(env={}, overrides={"batch_invariant": "sometimes"})


@needs_onednn_bf16
def test_load_check_finds_the_one_row_product_and_the_option_removes_it(wide_bf16,
                                                                        monkeypatch):
    from worker_service import batch_invariance
    from worker_service.kernels import dpbf16_linear
    from worker_service.model_runner import ModelRunner

    if dpbf16_linear.library() is not None:
        # the C product computes a row alike at every row count: invariant as it is
        assert batch_invariance.check(ModelRunner(str(wide_bf16), dtype="bfloat16")) is None
    monkeypatch.setattr(dpbf16_linear, "library", lambda: None)  # oneDNN's products
    plain = ModelRunner(str(wide_bf16), dtype="bfloat16")
    if _onednn_rounds_one_row_otherwise(plain.model):  # the AVX512 EPYCs: it does
        assert "linear product gives a row other bits alone" in batch_invariance.check(plain)
    else:  # AMX Xeons: oneDNN's one-row product has a batched row's bits
        assert batch_invariance.check(plain) is None
    invariant = ModelRunner(str(wide_bf16), dtype="bfloat16", batch_invariant=True)
    assert batch_invariance.check(invariant) is None
    with pytest.raises(ValueError, match="option.batch_invariant cannot hold.*bfloat16 models"):
        ModelRunner(str(tiny_model("llama")), dtype="float32", batch_invariant=True)


def _onednn_rounds_one_row_otherwise(model) -> bool:
    """Whether some oneDNN product of `model` gives a row alone other bits than the same
    row among others, tried directly on random rows."""
    import torch

    from worker_service.kernels.linear_prepack import PrepackedLinear

    g = torch.Generator().manual_seed(0)
    for layer in (m for m in model.modules() if isinstance(m, PrepackedLinear)):
        rows = torch.randn(64, layer.in_features, generator=g).bfloat16()
        with torch.inference_mode():
            together = layer(rows)
            # A differing row is rare (one element's last bit): try every row of a full batch.
            if any(not torch.equal(layer(rows[i : i + 1])[0], together[i]) for i in range(64)):
                return True
    return False


@needs_onednn_bf16
def test_bf16_request_alone_equals_it_in_a_full_batch(wide_bf16, deploy):
    d = deploy(wide_bf16, {"dtype": "bf16", "batch_invariant": "true"},
               max_rolling_batch_size=len(PROMPTS))
    probe = PROMPTS.index("Recommend some interesting books to read.")
    with Client(d.address, timeout=600) as c:
        alone = c.generate(PROMPTS[probe], **PARAMS)

    async def full_batch():
        async with AsyncClient(d.address, timeout=600) as c:
            return await asyncio.gather(*(c.generate(p, **PARAMS) for p in PROMPTS))

    together = asyncio.run(full_batch())[probe]
    first = next((i for i, (a, b) in enumerate(zip(alone.logprobs, together.logprobs))
                  if a != b), None)
    assert together.token_ids == alone.token_ids, f"tokens differ from token {first} on"
    # Every bit of every token's log-probability.
    assert first is None, f"log-probabilities differ from token {first} on"
