"""Chunked prefill on the worker engine (no gRPC): prompts prefilled piece by piece over
steps, beside decoding rows, across regroupings and after prefix-cache hits, give the same
tokens as model.generate, and no token before their last piece."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from seqserve_common.decoding import DecodingStrategy
from tests import reference
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
        assert reference.same_until_eos(got[i], _reference(llama_dir, j.prompt, j.new_tokens), eos), f"job {i}"


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
