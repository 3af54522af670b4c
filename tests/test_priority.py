"""Policies `priority` and `mlfq` on the real processes: an urgent request (more urgent
priority; under mlfq a new job) sent into a full batch of running work gets its first
token within a few Steps (counted by the scheduler's
step counter, not by a clock), the preempted work comes out token-identical to
model.generate (greedy) and to the same request alone (seeded sampling), and every API
takes a priority and refuses one out of range."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request

import grpc
import pytest
from transformers import AutoTokenizer

from bench.metrics import scrape
from client import AsyncClient, Client
from tests import reference
from tests.background import Background

STEPS = "seqserve_batch_size_count"  # Steps answered (one observation per Step)


def _steps(d) -> float:
    return scrape(d.metrics_url, names=[STEPS])[STEPS]


# mlfq: the low requests are demoted after 2 + 4 Steps; the new short one joins queue 0.
@pytest.mark.parametrize("policy", [{"scheduling_policy": "priority"},
                                    {"scheduling_policy": "mlfq", "mlfq_quantum_steps": 2}],
                         ids=["priority", "mlfq"])
# swap: the victims' KV goes to the worker's host memory and back (kv_swap.py); prefetch:
# and is copied back ahead of the Step that re-admits them (on CPU only when asked).
@pytest.mark.parametrize("mode", ["recompute", "swap", "prefetch"])
def test_urgent_request_preempts_a_full_batch(llama_dir, deploy, policy, mode):
    worker_options = {"swap_space_bytes": 64 << 20} if mode != "recompute" else {}
    d = deploy(llama_dir, worker_options, max_rolling_batch_size=2,
               preemption_mode="swap" if mode == "prefetch" else mode,
               swap_prefetch=2 if mode == "prefetch" else -1, **policy)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(3)
    greedy_prompt = reference.prompt_of_tokens(tok, 40, rng)
    sample_prompt = reference.prompt_of_tokens(tok, 30, rng)
    urgent_prompt = reference.prompt_of_tokens(tok, 12, rng)
    sample_params = {"decoding_strategy": "sample", "seed": 11, "top_k": 50,
                     "temperature": 0.9, "max_new_tokens": 60, "ignore_eos": True,
                     "priority": 5}

    async def scenario():
        async with AsyncClient(d.address) as c:
            background = Background(c, 2)

            async def urgent():
                await background.started.wait()
                before = await asyncio.to_thread(_steps, d)
                ids, first_at = [], None
                async for chunk in c.stream(urgent_prompt, max_new_tokens=6, priority=-5):
                    if chunk.token_id is not None:
                        if first_at is None:
                            first_at = await asyncio.to_thread(_steps, d)
                        ids.append(chunk.token_id)
                return ids, first_at - before

            return await asyncio.gather(
                background.stream(0, greedy_prompt, max_new_tokens=60, ignore_eos=True,
                                  priority=5),
                background.stream(1, sample_prompt, **sample_params), urgent())

    greedy_ids, sampled_ids, (urgent_ids, steps) = asyncio.run(scenario())
    # Under FCFS it would wait for a low one to end (over 50 Steps). The scheduler plans it
    # into the next Step it sends (exactly: tests/test_preemption_loop.py); the counter
    # read here also moves while the test reads /metrics, as a tiny model's Step takes
    # milliseconds, hence the margin.
    assert steps <= 12, f"the urgent request waited {steps} Steps for its first token"
    metrics = scrape(d.metrics_url)
    assert metrics["seqserve_num_preemptions_total"] >= 1
    swapped = metrics["seqserve_num_swapped_preemptions_total"]
    assert swapped >= 1 if mode != "recompute" else swapped == 0
    hits = scrape(d.worker_metrics_url)["seqserve_worker_prefetched_swap_ins_total"]
    assert hits >= 1 if mode == "prefetch" else hits == 0  # CPU: none unless asked
    assert urgent_ids == reference.greedy(llama_dir, urgent_prompt, 6)
    assert reference.same_until_eos(greedy_ids, reference.greedy(llama_dir, greedy_prompt, 60),
                                     tok.eos_token_id)
    with Client(d.address) as c:
        alone = c.generate(sample_prompt, **sample_params)
    assert sampled_ids == alone.token_ids


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_every_api_takes_a_priority_and_refuses_a_bad_one(llama_dir, deploy):
    d = deploy(llama_dir, scheduling_policy="priority")
    with Client(d.address) as c:
        assert c.generate("hello", max_new_tokens=2, priority=-100).generated_tokens == 2
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hello", max_new_tokens=2, priority=101)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be in [-100, 100]" in err.value.details()

    url = d.http_url + "/invocations"
    status, body = _post(url, {"inputs": "hello", "parameters": {"max_new_tokens": 2},
                               "priority": 7})
    assert status == 200 and "generated_text" in body
    status, body = _post(url, {"inputs": "hello", "priority": -101})
    assert status == 400 and "priority must be in [-100, 100]" in json.dumps(body)
    status, body = _post(url, {"inputs": "hello", "priority": "high"})
    assert status == 400 and "priority must be an integer" in json.dumps(body)

    completions = d.openai_url + "/completions"
    status, body = _post(completions, {"prompt": "hello", "max_tokens": 2, "priority": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body = _post(completions, {"prompt": "hello", "max_tokens": 2, "priority": 500})
    assert status == 400 and body["error"]["param"] == "priority"
    assert "priority must be in [-100, 100]" in body["error"]["message"]


@pytest.mark.slow
def test_urgent_shield_keeps_outputs_identical(llama_dir, deploy):
    """The urgent shield on the real processes (a 64-token Step budget, background chunks
    of 16 tokens together): once an urgent request was seen, long less urgent prompts are
    prefilled in small chunks, none beside the urgent prompts' Steps; every greedy reply
    equals model.generate."""
    d = deploy(llama_dir, max_num_batched_tokens=64, scheduling_policy="priority",
               priority_background_chunk_tokens=16)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(5)
    first = reference.prompt_of_tokens(tok, 10, rng)
    jobs = [(reference.prompt_of_tokens(tok, n, rng), p)
            for n, p in ((150, 0), (90, 0), (20, -5), (120, 0), (40, -5))]

    async def scenario():
        async with AsyncClient(d.address, timeout=300) as c:
            await c.generate(first, max_new_tokens=2, priority=-5)  # the shield is up

            async def one(i, prompt, priority):
                await asyncio.sleep(0.05 * i)
                return await c.generate(prompt, max_new_tokens=10, priority=priority)
            return await asyncio.gather(*(one(i, p, pr) for i, (p, pr) in enumerate(jobs)))

    replies = asyncio.run(scenario())
    # 16-token background chunks: about 23 partial ones (unshielded, 64-token ones: 7).
    assert scrape(d.metrics_url)["seqserve_prefill_partial_chunks_total"] >= 16
    for (prompt, _), reply in zip(jobs, replies):
        assert reply.token_ids == reference.greedy(llama_dir, prompt, 10)
