"""The benchmark's load generator (bench/loadgen.py) against a real deployment."""

from __future__ import annotations

import asyncio
import gc
import random

from transformers import AutoTokenizer

from bench.loadgen import send_requests
from bench.workload import BenchRequest, make_prompt, round_trip_tokens
from tests.conftest import tiny_model


def test_the_driver_freezes_its_objects_out_of_the_collector_and_streams_every_token(deploy):
    """The driver shares the CPU with the server it measures, so its full collections must
    not walk everything it imported during a run."""
    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    safe = round_trip_tokens(tokenizer)
    requests = [BenchRequest(i, *make_prompt(tokenizer, n, rng, safe), output_len=m)
                for i, (n, m) in enumerate([(5, 3), (17, 6), (9, 1)])]
    d = deploy(model)
    gc.unfreeze()
    made_before = [[] for _ in range(100)]
    try:
        results = asyncio.run(send_requests(d.address, requests))
        in_passes = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() >= len(made_before)
        assert not any(id(o) in in_passes for o in made_before)
    finally:
        gc.unfreeze()
    assert [len(r.token_times) for r in results] == [3, 6, 1]
    assert all(r.prompt_tokens == r.prompt_len for r in results)


def test_the_load_generator_sends_token_ids_as_the_peers_get_them():
    """vLLM and the HF baselines are given token ids; seqserve is too, except where a
    cached_prompt needs the text (the server takes one only with a text prompt)."""
    sent = []

    class Client:
        async def stream(self, prompt, **params):
            sent.append((prompt, params.get("cached_prompt")))
            yield type("Chunk", (), dict(token_id=7, finish_reason="length", generated_tokens=1,
                                         prompt_tokens=2, cached_tokens=0))()

    from bench.loadgen import _stream_one
    asyncio.run(_stream_one(Client(), BenchRequest(0, "a b", [1, 2], 1)))
    asyncio.run(_stream_one(Client(), BenchRequest(1, "x a b", [5, 1, 2], 1, cached_prompt="x")))
    assert sent == [([1, 2], None), ("x a b", "x")]
