"""Every causal LM architecture the worker claims, over real processes: greedy output equals
`model.generate` (float32), and contrastive search equals its definition recomputed from
scratch, for small random-weight models of odd sizes (hidden 72, 3 layers, head size 12,
grouped or multi-query heads, sliding windows of 8 to 24 tokens, chunks of 8: worker_service/fixtures.py,
size "odd").

Each architecture gets one deployment: four prompts of different lengths (shorter and
longer than the windows) batched together, then one that extends the longest (a
prefix-cache hit), 16 new tokens each. The worker's log must name the path the README
promises: the packed forward, or the FALLBACK through the model's own attention.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from client import AsyncClient
from tests import reference
from tests.conftest import MODELS
from tests.test_decoding import contrastive_reference
from worker_service.fixtures import make_model

# Architecture -> the path the worker takes for it (README, "Architectures").
PATHS = {
    "llama": "packed", "mistral": "packed", "mixtral": "packed", "qwen2": "packed",
    "qwen3": "packed", "gemma2": "packed", "gemma3": "packed", "phi": "packed",
    "phi3": "packed", "gpt2": "packed", "gpt_neox": "packed", "opt": "packed",
    "stablelm": "packed", "starcoder2": "packed", "llama4": "packed",
    "gptj": "fallback", "falcon": "fallback", "bloom": "fallback",
}
# Also checked for contrastive search (candidates as a tree on the packed path, as a batch
# of k rows on the fallback).
CONTRASTIVE = ("gemma2", "qwen2", "gptj", "bloom", "starcoder2")
# Run by `make test`; the rest are marked slow (the whole sweep took 2.5 minutes on two
# idle cores, 4.8 to 8 on the shared ones tests usually get): a fallback, softcapped and
# alternating windows, mixed full/sliding layers, mixture of experts, multi-query with a
# window.
FAST = ("gemma2", "gptj", "qwen2", "mixtral", "starcoder2")
PROMPT_TOKENS = (2, 9, 23, 41)
NEW_TOKENS = 16
TIMEOUT = 300


def odd_model(arch: str):
    return make_model(MODELS / f"odd-{arch}", arch=arch, size="odd", dtype="float32", seed=0)


def _params():
    return [pytest.param(a, marks=() if a in FAST else pytest.mark.slow) for a in PATHS]


async def _generate_all(address: str, jobs: list[tuple[str, dict]]) -> list:
    async with AsyncClient(address, timeout=TIMEOUT) as c:
        return await asyncio.gather(*(c.generate(p, max_new_tokens=NEW_TOKENS, **params)
                                      for p, params in jobs))


@pytest.mark.parametrize("arch", _params())
def test_architecture_matches_reference(arch, deploy):
    model_dir = odd_model(arch)
    # A small prefill budget keeps the start-up warm-up (one step of that many tokens) short.
    d = deploy(model_dir, {"max_num_batched_tokens": 256}, max_num_batched_tokens=256)
    log = d.worker.log.read_text()
    assert ("FALLBACK" in log) == (PATHS[arch] == "fallback"), log[-3000:]
    assert "Traceback" not in log, log[-3000:]

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(sum(map(ord, arch)))
    prompts = [reference.prompt_of_tokens(tok, n, rng) for n in PROMPT_TOKENS]
    jobs = [(p, {}) for p in prompts]
    contrastive = dict(decoding_strategy="contrastive", penalty_alpha=0.6, top_k=4)
    if arch in CONTRASTIVE:
        jobs += [(prompts[1], contrastive), (prompts[3], contrastive)]
    replies = asyncio.run(_generate_all(d.address, jobs))
    # A prompt whose first 32 tokens are cached from the round above.
    longer = prompts[3] + " the king"
    (again,) = asyncio.run(_generate_all(d.address, [(longer, {})]))

    for (prompt, params), reply in zip(jobs + [(longer, {})], replies + [again]):
        if params:
            expected = contrastive_reference(model_dir, prompt, NEW_TOKENS, 4, 0.6)
        else:
            expected = reference.greedy(model_dir, prompt, NEW_TOKENS)
        assert reply.token_ids == expected, (
            f"{arch} {'contrastive' if params else 'greedy'} prompt of "
            f"{len(tok(prompt).input_ids)} tokens")


def test_layer_attention_follows_the_config():
    """Each layer's window or chunk as transformers' masks read the config: layer_types
    where it has them (Gemma 2 alternates, Qwen2 slides above max_window_layers, Llama 4
    chunks), else one sliding_window for all (Mistral); Gemma 2's softcap comes from the
    load-time probe, not from here."""
    import transformers as tf

    from worker_service.attention import LayerAttention, layer_attention

    specs, reason = layer_attention(tf.Gemma2Config(num_hidden_layers=3, sliding_window=8,
                                                    layer_types=["sliding_attention",
                                                                 "full_attention",
                                                                 "sliding_attention"]))
    assert reason is None
    assert specs == (LayerAttention(window=8), LayerAttention(), LayerAttention(window=8))
    specs, _ = layer_attention(tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True,
                                              sliding_window=8, max_window_layers=1))
    assert [s.window for s in specs] == [None, 8, 8]
    assert layer_attention(tf.Qwen2Config(num_hidden_layers=2))[0] == (LayerAttention(),) * 2
    assert layer_attention(tf.MistralConfig(sliding_window=16)) == ((LayerAttention(window=16),),
                                                                    None)
    specs, _ = layer_attention(tf.Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8))
    assert [s.chunk for s in specs] == [8, 8, 8, None] and not specs[0].native
    _, reason = layer_attention(tf.LlamaConfig(layer_types=["full_attention", "mamba"],
                                               num_hidden_layers=2))
    assert reason and "not attention the packed path computes" in reason
