"""Policy length-aware and its predictor: as pure planning logic, predictions learned
online (with the fallback before any data), shortest-predicted-first admission with
aging, KV reserved by predicted length, grown or preempted when a sequence outgrows it;
and on the real processes, preemption of outgrown sequences with unchanged outputs."""

from __future__ import annotations

import asyncio
import random

from transformers import AutoTokenizer

from bench.metrics import scrape
from client import AsyncClient, Client
from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.params import DecodingConfig
from scheduler_service.policies.length_aware import GROW_MARGIN, LengthAwareAdmission
from scheduler_service.policies.length_predictor import (
    Accuracy,
    LengthPredictor,
    PredictorConfig,
    prefix_keys,
)
from scheduler_service.sequence import FinishReason, Sequence, Status
from seqserve_common.decoding import DecodingStrategy
from tests import reference


def seq(sid: int, prompt: list[int], max_new: int = 500) -> Sequence:
    return Sequence(seq_id=sid, request_id=str(sid), prompt_ids=prompt,
                    params=DecodingConfig(max_new_tokens=max_new, strategy=DecodingStrategy.GREEDY),
                    detokenizer=None, stops=None, arrival_time=float(sid))


def finish(s: Sequence, generated: int, reason=FinishReason.EOS) -> None:
    s.output_ids = [5] * generated
    s.status, s.finish_reason = Status.FINISHED, reason


def test_predictor_falls_back_then_learns_by_shared_prefix_then_length():
    p = LengthPredictor(PredictorConfig(block_tokens=4, min_samples=3))
    chat_a, chat_b = [1, 2, 3, 4, 9, 9], [7, 7, 7, 7, 9, 9]
    assert p.predict(6, prefix_keys(chat_a, 4), 300) == 300  # no data: max_new_tokens
    for n in (20, 30, 25):
        p.learn(6, prefix_keys(chat_a, 4), n)
    p.learn(6, prefix_keys(chat_b, 4), 200)
    assert p.predict(6, prefix_keys(chat_a + [1, 1], 4), 300) == 25  # its prefix's median
    assert p.predict(6, prefix_keys(chat_b, 4), 300) == 200
    assert p.predict(6, prefix_keys(chat_b, 4), 100) == 100  # clipped to max_new_tokens
    # A new prefix: the median of its prompt-length bin (4 samples).
    assert p.predict(6, prefix_keys([8, 8, 8, 8], 4), 300) == 30
    assert p.bucket(1) == 50 and p.bucket(50) == 50 and p.bucket(51) == 100


def test_accuracy_measures_as_the_paper():
    acc = Accuracy()
    for pred, real in [(10, 10), (100, 40), (300, 150), (0, 101)]:
        acc.add(pred, real)
    assert acc.summary() == {"n": 4, "error": (0 + 60 + 150 + 101) / 4, "acc50": 0.25,
                             "acc100": 0.5}


def learned_policy() -> LengthAwareAdmission:
    """A policy whose predictor learned: prompts starting [1]*8 answer 10 tokens, [2]*8
    answer 400."""
    policy = LengthAwareAdmission(LengthPredictor(PredictorConfig(block_tokens=8)), 1000)
    q = WaitingQueue(10)
    for sid, prompt, n in [(100, [1] * 8, 10), (101, [2] * 8, 400)]:
        s = seq(sid, prompt)
        q.push(s)
        assert policy.admit(q, Budget(1, 10_000)) == [s]
        finish(s, n)
    policy.admit(q, Budget(0, 0))  # learns from the finished ones
    return policy


def test_shortest_predicted_first_with_reservation_by_prediction():
    policy = learned_policy()
    q = WaitingQueue(10)
    long_, short = seq(1, [2] * 8), seq(2, [1] * 8)
    q.push(long_)
    q.push(short)
    # 8 + 50 reserved for the short one (10 rounded up to a bucket), 8 + 400 for the long.
    admitted = policy.admit(q, Budget(1, 10_000))
    assert admitted == [short] and short.reserved_tokens == 8 + 50
    assert long_.predicted_tokens == 400 and long_.reserved_tokens == 8 + 400
    # Without prediction it would reserve 8 + 500 each; 466 fits both by prediction.
    q.push(short)
    short.status = Status.WAITING
    assert policy.admit(q, Budget(2, 466)) == [short, long_]


def test_aging_lets_a_long_request_pass_fresh_short_ones():
    policy = learned_policy()
    policy.aging_steps = 2
    q = WaitingQueue(100)
    long_ = seq(1, [2] * 8)
    q.push(long_)
    for step in range(100):
        q.push(seq(1000 + step, [1] * 8))
        if long_ in policy.admit(q, Budget(1, 10_000)):
            break
        q.tick()
    assert step == (8 - 1) * 2  # 8 buckets of 50 against 1: 7 buckets of aging


def test_outgrown_reservation_grows_or_preempts():
    policy = learned_policy()
    q = WaitingQueue(10)
    a, b = seq(1, [1] * 8), seq(2, [1] * 8)
    for s in (a, b):
        q.push(s)
    assert policy.admit(q, Budget(2, 10_000)) == [a, b]
    for s in (a, b):
        s.status = Status.RUNNING
        s.output_ids = [5] * (50 - GROW_MARGIN)
    # Room for one bucket more: the earlier one grows, the other is preempted.
    victims = policy.preempt(q, [a, b], Budget(0, 60))
    assert victims == [b]
    assert a.reserved_tokens == 8 + 100 and b.reserved_tokens == 8 + 100
    # Both growths are taken off the budget admit sees (the loop hands b's back).
    q.push(seq(3, [1] * 8))
    assert policy.admit(q, Budget(1, 100 + 58 - 1)) == []
    # A sequence below its margin is left alone.
    a.output_ids = [5] * 10
    assert policy.preempt(q, [a], Budget(0, 0)) == []


def test_the_latest_outgrown_make_room_for_the_earlier():
    policy = learned_policy()
    q = WaitingQueue(10)
    seqs = [seq(i, [1] * 8) for i in (1, 2, 3)]
    for s in seqs:
        q.push(s)
    assert policy.admit(q, Budget(3, 10_000)) == seqs
    for s in seqs:
        s.status = Status.RUNNING
        s.output_ids = [5] * 45
    # 42 free: the first cannot grow by 50 until the last (58 reserved) is preempted;
    # then the second fits too (42 + 58 = 2 buckets).
    assert policy.preempt(q, seqs, Budget(0, 42)) == [seqs[2]]
    assert [s.reserved_tokens for s in seqs] == [108, 108, 108]


def test_serving_reserves_by_prediction_and_outgrown_sequences_stay_identical(llama_dir,
                                                                            deploy):
    """On the real processes with a KV budget of 240 tokens: the predictor learns that
    ~20-token prompts answer 5 tokens, so three such prompts that then run 80 tokens each
    reserve 20 + 50 and run together (by max_new_tokens, 20 + 80 each, only two would
    fit); when they outgrow the bucket the latest is preempted and recomputed. Greedy
    outputs equal model.generate."""
    small = {"max_num_batched_tokens": 128}
    d = deploy(llama_dir, {**small, "kv_cache_bytes": 240 * 512}, **small,
               scheduling_policy="length-aware", max_rolling_batch_size=4)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(5)
    with Client(d.address) as c:
        assert c.model_info().kv_budget_tokens == 240
        for _ in range(3):  # learn: ~20-token prompts answer 5 tokens
            c.generate(reference.prompt_of_tokens(tok, 20, rng), max_new_tokens=5,
                       ignore_eos=True)
    prompts = [reference.prompt_of_tokens(tok, 20, rng) for _ in range(3)]
    run_together_with_a_preemption(d, llama_dir, tok, prompts, 80)


def run_together_with_a_preemption(d, model_dir, tok, prompts, max_new_tokens):
    """Sends `prompts` at once; at least one sequence is preempted, and every greedy
    output still equals model.generate on its prompt alone."""
    async def together():
        async with AsyncClient(d.address) as c:
            return await asyncio.gather(*(c.generate(p, max_new_tokens=max_new_tokens,
                                                     ignore_eos=True) for p in prompts))

    replies = asyncio.run(together())
    assert scrape(d.metrics_url)["seqserve_num_preemptions_total"] >= 1
    for p, r in zip(prompts, replies):
        assert reference.same_until_eos(
            r.token_ids, reference.greedy(model_dir, p, max_new_tokens), tok.eos_token_id)
