"""Chunked prefill on the worker engine (no gRPC): prompts prefilled piece by piece over
steps, beside decoding rows, across regroupings and after prefix-cache hits, give the same
tokens as model.generate, and no token before their last piece."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from bench.metrics import scrape
from client import AsyncClient

from seqserve_common.decoding import DecodingStrategy
from tests import reference
from tests.test_beam import beam_reference
from tests.test_decoding import contrastive_reference
from tests.test_engine import _reference
from worker_service.engine import Engine, StepError
from worker_service.model_runner import ModelRunner
from worker_service.prefix_cache import PrefixCache
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec


@pytest.fixture(scope="module")
def runner(llama_dir):
    return ModelRunner(str(llama_dir))


@dataclass
class Job:
    prompt: list[int]
    new_tokens: int
    params: DecodingParams
    sent: int = 0  # prompt tokens asked for so far


def drive(engine: Engine, jobs: list[Job], seed: int,
          max_chunk: int | None) -> dict[int, list[int]]:
    """One job joins per step; each prefilling job gets a random piece of at most
    `max_chunk` tokens (None: its whole prompt) or, now and then, none; the live sequences
    are shuffled into 1-2 groups every step."""
    rng = random.Random(seed)
    got: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    pending, live = list(range(len(jobs))), []
    while pending or live:
        new, chunks = [], {}
        for i in live:
            j = jobs[i]
            if j.sent < len(j.prompt) and rng.random() < 0.8:
                j.sent = min(len(j.prompt), j.sent + rng.randint(1, max_chunk))
                chunks[i] = j.sent
        if pending:
            i = pending.pop(0)
            j = jobs[i]
            first = len(j.prompt) if max_chunk is None else rng.randint(1, max_chunk)
            j.sent = min(len(j.prompt), first)
            new.append(PrefillSpec(i, j.prompt, 0, j.params,
                                   prefill_end=0 if j.sent == len(j.prompt) else j.sent))
            live.append(i)
        ids = list(live)
        rng.shuffle(ids)
        k = rng.randint(1, 2)
        plan = [p for p in (ids[x::k] for x in range(k)) if p]
        result = engine.step([], new, plan, chunks)
        for t in result.tokens:
            assert jobs[t.seq_id].sent == len(jobs[t.seq_id].prompt), \
                f"sequence {t.seq_id} got a token before its prompt was prefilled"
            got[t.seq_id].append(t.token_id)
            if len(got[t.seq_id]) == jobs[t.seq_id].new_tokens:
                live.remove(t.seq_id)
                engine.release(t.seq_id)
    return got


def test_chunked_prompts_match_generate(runner, llama_dir):
    """Prompts of 1-150 tokens in pieces of 1-40 (the first piece of a prompt shorter
    than its cached prefix, too), while other rows decode in the same groups."""
    rng = random.Random(3)
    system = [rng.randint(3, 999) for _ in range(70)]
    prompts = [[rng.randint(3, 999) for _ in range(rng.randint(1, 150))] for _ in range(6)]
    for at, n in ((0, 9), (4, 30), (7, 0)):  # others arrive in between: pieces get cached
        prompts.insert(at, system + [rng.randint(3, 999) for _ in range(n)])
    jobs = [Job(p, rng.randint(1, 12), DecodingParams()) for p in prompts]
    engine = Engine(runner, PrefixCache(runner.kv_shape, 64 << 20, 16))
    got = drive(engine, jobs, seed=1, max_chunk=40)
    stats = engine.prefix_cache.stats
    # Two prompts reused more cached tokens than any first piece (<= 40) asks for.
    assert stats.hits == 2 and stats.hit_tokens >= 2 * 48, stats
    eos = runner.facts.eos_token_ids[0]
    for i, j in enumerate(jobs):
        expected = _reference(llama_dir, j.prompt, j.new_tokens)
        assert reference.same_until_eos(got[i], expected, eos), f"job {i}"


def test_chunked_contrastive_equals_whole_prompts(runner):
    """Contrastive search keeps every prompt token's hidden state: pieces give it the same
    context as one whole prefill, so the same tokens."""
    rng = random.Random(4)
    params = DecodingParams(strategy=DecodingStrategy.CONTRASTIVE, top_k=4, penalty_alpha=0.6)
    prompts = [[rng.randint(3, 999) for _ in range(rng.randint(20, 120))] for _ in range(4)]
    runs = []
    for max_chunk in (None, 16):
        jobs = [Job(p, 8, params) for p in prompts]
        runs.append(drive(Engine(runner), jobs, seed=2, max_chunk=max_chunk))
    assert runs[0] == runs[1]


def test_bad_chunks_are_refused(runner):
    engine = Engine(runner)
    prompt = list(range(5, 45))
    with pytest.raises(StepError, match="prefill_end 41 is not in"):
        engine.step([], [PrefillSpec(1, prompt, 0, DecodingParams(), prefill_end=41)], [[1]])
    engine.step([], [PrefillSpec(1, prompt, 0, DecodingParams(), prefill_end=16)], [[1]])
    with pytest.raises(StepError, match="does not hold"):
        engine.step([], [], [[1]], {2: 20})
    with pytest.raises(StepError, match="past the 16 tokens"):
        engine.step([], [], [[1]], {1: 16})
    with pytest.raises(StepError, match="at most its 40 prompt tokens"):
        engine.step([], [], [[1]], {1: 41})
    assert engine.step([], [], [[1]], {1: 40}).tokens[0].seq_id == 1
    with pytest.raises(StepError, match="past the 40 tokens"):
        engine.step([], [], [[1]], {1: 40})  # decoding now: nothing left to prefill


# --- over the real processes ----------------------------------------------------------------

async def _generate_all(address: str, jobs: list[tuple[str, dict]], n: int) -> list:
    async with AsyncClient(address, timeout=300) as c:
        return await asyncio.gather(*(c.generate(p, max_new_tokens=n, **params)
                                      for p, params in jobs))


def test_chunked_prefill_over_real_processes_matches_generate(llama_dir, deploy):
    """A 64-token step budget: prompts up to 3x longer are prefilled over several steps
    while short ones and decoding rows share them; greedy replies equal generate, a
    contrastive one equals its definition, and a prompt whose prefix the worker cached
    is chunked from where the cache ends. A beam search prefills its prompt in chunks in
    one row before it becomes one row per beam, and equals generate(num_beams=3)."""
    budget = {"max_num_batched_tokens": 64}
    d = deploy(llama_dir, budget, prompt_cache_block_tokens=16, **budget)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(7)
    prompts = [reference.prompt_of_tokens(tok, n, rng) for n in (190, 3, 130, 20, 70)]
    contrastive = dict(decoding_strategy="contrastive", penalty_alpha=0.6, top_k=4)
    beams = dict(num_beams=3, num_return_sequences=2)
    jobs = [(p, {}) for p in prompts] + [(prompts[4], contrastive), (prompts[2], beams)]
    replies = asyncio.run(_generate_all(d.address, jobs, 12))
    sched = scrape(d.metrics_url)
    assert sched["seqserve_prefill_partial_chunks_total"] >= 4, "long prompts were split"
    # The longest prompt again, plus a turn: its cached prefix, then the rest in chunks.
    longer = prompts[0] + " the king said"
    (again,) = asyncio.run(_generate_all(d.address, [(longer, {})], 12))
    assert again.cached_tokens >= 176
    for (prompt, params), reply in zip(jobs + [(longer, {})], replies + [again]):
        if "num_beams" in params:
            expected = [ids for ids, _ in beam_reference(llama_dir, prompt, 12, **params)]
            assert [s.token_ids for s in reply.sequences] == expected
            continue
        if params:
            expected = contrastive_reference(llama_dir, prompt, 12, 4, 0.6)
        else:
            expected = reference.greedy(llama_dir, prompt, 12)
        assert reply.token_ids == expected, f"{params} prompt of {len(tok(prompt).input_ids)}"
