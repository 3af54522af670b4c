"""The priority policy's urgent shield (scheduler_service/policies/urgent_shield.py): less
urgent prompts' chunks are capped, stay out of an urgent prompt's Step and out from behind
each other in flight. Pure planning checks, then the loop on the fake worker of
test_preemption_loop, counted in Steps and prompt tokens, never seconds."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_service.admission import WaitingQueue
from scheduler_service.chunking import ChunkLimit, StepBudget
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.policies import make_policy
from scheduler_service.policies.priority import PriorityAdmission
from scheduler_service.sequence import Status
from seqserve_common.config import ServingConfig
from tests.test_preemption_loop import Stream, Worker, request, token

CAP = 64


def seqs_of(loop_like, *specs):
    """Sequences (prompt length, priority), waiting in a fresh queue."""
    q = WaitingQueue(64)
    out = [request(loop_like, n, 4, priority=p) for n, p in specs]
    for s in out:
        q.push(s)
    return q, out


class Ids:
    def __init__(self):
        self.n = 0

    def new_seq_id(self):
        self.n += 1
        return self.n


def begin(s, prefilled: int, step: int):
    """`s` running, its prompt begun: `prefilled` tokens in Steps sent, admitted at `step`."""
    s.start_running(0.0)
    s.status, s.prefilled, s.admitted_step = Status.RUNNING, prefilled, step


def test_take_caps_limited_chunks_together_and_gives_a_new_prompt_a_token():
    q, (a, b, c, d) = seqs_of(Ids(), (300, 0), (300, 0), (300, 0), (300, 0))
    for s in (a, b, c, d):
        s.start_running(0.0)
    a.prefilled = b.prefilled = 32  # begun; c and d are new on the worker
    budget = StepBudget(2048, True)
    chunks = budget.take([a, b, c, d], ChunkLimit(frozenset({a.seq_id, b.seq_id, c.seq_id}), 100))
    assert chunks[a.seq_id] == (32, 128) and chunks[b.seq_id] == (32, 36)  # 96 + 4 of 100
    assert chunks[c.seq_id] == (0, 1)  # none left: a new prompt's one token
    assert chunks[d.seq_id] == (0, 300)  # not limited
    c.prefilled = 0  # new again
    zero = StepBudget(2048, True).take([a, c], ChunkLimit(frozenset({a.seq_id, c.seq_id}), 0))
    assert a.seq_id not in zero and zero[c.seq_id].end - zero[c.seq_id].start == 1


def shield_policy(window: int = 1024) -> PriorityAdmission:
    return PriorityAdmission(aging_steps=64, background_chunk_tokens=CAP, window_steps=window)


def test_no_limit_until_a_more_urgent_request_was_seen():
    p = shield_policy()
    q, (a, b) = seqs_of(Ids(), (300, 0), (300, 0))
    p.shield.see(q)
    assert p.chunk_limit([a, b], q, False) is None  # one priority: nothing is background


def test_background_is_capped_held_beside_urgent_and_behind_itself():
    p = shield_policy()
    q, (bg, urgent) = seqs_of(Ids(), (600, 0), (100, -10))
    p.shield.see(q)
    assert p.chunk_limit([urgent, bg], q, False) == ChunkLimit(frozenset({bg.seq_id}), 0)
    assert p.chunk_limit([bg], q, False) == ChunkLimit(frozenset({bg.seq_id}), CAP)
    assert p.chunk_limit([bg], q, True) == ChunkLimit(frozenset({bg.seq_id}), 0)


def test_the_window_forgets_an_urgent_request():
    p = shield_policy(window=10)
    q, (bg, urgent) = seqs_of(Ids(), (600, 0), (100, -10))
    p.shield.see(q)
    q.remove(urgent)
    for _ in range(9):
        q.tick()
    assert p.chunk_limit([bg], q, False) is not None
    q.tick()
    assert p.chunk_limit([bg], q, False) is None


def test_a_prompt_begun_aging_steps_ago_is_no_longer_held():
    p = shield_policy()
    q, (bg, urgent) = seqs_of(Ids(), (600, 0), (100, -10))
    p.shield.see(q)
    q.remove(bg)
    begin(bg, 64, step=q.steps)
    for _ in range(63):
        q.tick()
    assert p.chunk_limit([urgent, bg], q, False).tokens == 0
    q.tick()
    assert p.chunk_limit([urgent, bg], q, False) is None


def test_admission_takes_no_background_request_into_an_urgent_step():
    from scheduler_service.admission import Budget
    p = shield_policy()
    q, (urgent, bg) = seqs_of(Ids(), (100, -10), (100, 0))
    budget = Budget(free_slots=4, free_kv_tokens=10000, prefill_tokens=2048, chunked=True)
    assert p.admit(q, budget) == [urgent]
    assert p.admit(q, budget) == [bg]  # the urgent prompt is no longer waiting nor begun
    q2, (bg2,) = seqs_of(Ids(), (100, 0))
    p.shield.see(q2)  # (it remembers -10)
    from dataclasses import replace
    assert p.admit(q2, replace(budget, background_in_flight=True)) == []


def test_make_policy_reads_the_option():
    assert make_policy(ServingConfig(scheduling_policy="priority")).shield is not None
    off = make_policy(ServingConfig(scheduling_policy="priority",
                                    priority_background_chunk_tokens=0))
    assert off.shield is None


class Recorder(Worker):
    """The fake worker, keeping every Step's plan in order."""

    def __init__(self):
        super().__init__()
        self.plans = []

    def open_steps(self):
        stream = Stream(self)
        send = stream.send

        async def record(step_id, plan):
            self.plans.append(plan)
            await send(step_id, plan)
        stream.send = record
        return stream


def behind_long_prompts(policy, in_flight: int):
    """Four decoding low-priority sequences; an urgent request seen once; then two long
    low-priority prompts (640 and 900 tokens, budget 1024) and, in mid-prefill, a second
    urgent one. Returns the worker's plans, the index of the first Step sent after the
    second urgent request arrived, the Steps to its first token, and all sequences."""
    worker = Recorder()

    async def run():
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16,
                             max_sparsity=0.3, max_splits=2, worker_timeout=5,
                             metrics=SchedulerMetrics(), max_num_batched_tokens=1024,
                             steps_in_flight=in_flight, policy=policy)
        low = [request(loop, 8, 80, priority=0) for _ in range(4)]
        first = request(loop, 20, 2, priority=-10)
        for s in [*low, first]:
            loop.submit(s)
        task = asyncio.create_task(loop.run())
        while not first.finished:
            await asyncio.sleep(0)
        long = [request(loop, 640, 4, priority=0), request(loop, 900, 4, priority=0)]
        for s in long:
            loop.submit(s)
        while long[0].prefilled < 128:
            await asyncio.sleep(0)
        urgent = request(loop, 100, 4, priority=-10)
        loop.submit(urgent)
        sent_at = loop.step_id
        while not urgent.output_ids:
            await asyncio.sleep(0)
        steps = loop.step_id - sent_at
        for s in (*low, *long, urgent):
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return sent_at, steps, [*low, first, *long, urgent]

    sent_at, steps, seqs = asyncio.run(asyncio.wait_for(run(), 30))
    return worker.plans, sent_at, steps, seqs


@pytest.mark.parametrize("in_flight", [1, 2])
def test_urgent_prompt_gets_a_step_of_its_own_and_short_steps_ahead(in_flight):
    plans, sent_at, steps, seqs = behind_long_prompts(shield_policy(), in_flight)
    *_, long1, long2, urgent = seqs
    background = {long1.seq_id, long2.seq_id}
    # No Step pays more than CAP background prompt tokens, and no two in a row pay any
    # (A prompt new on the worker gets one token even past the cap.)
    paid = [sum(c.end - c.start for sid, c in p.chunks.items() if sid in background)
            for p in plans]
    new = [sum(1 for sid, c in p.chunks.items() if sid in background and c.start == 0)
           for p in plans]
    assert all(n <= CAP + k for n, k in zip(paid, new)) and max(paid) >= CAP
    if in_flight > 1:  # with one, nothing is in flight when a Step is planned
        assert not any(a and b for a, b in zip(paid, paid[1:]))
    # The urgent prompt's Step carries no other prompt's chunk.
    mine = [p for p in plans if urgent.seq_id in p.chunks]
    assert mine and all(set(p.chunks) == {urgent.seq_id} for p in mine)
    assert steps <= in_flight + 1
    for s in seqs:
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]


def test_without_the_shield_long_chunks_share_the_urgent_step():
    """The control: the same run without the shield packs 640 + 900 prompt tokens into
    large chunks, beside the urgent prompt's."""
    plans, _, _, seqs = behind_long_prompts(PriorityAdmission(aging_steps=64), 2)
    urgent = seqs[-1]
    assert max(p.prefill_tokens for p in plans) > 4 * CAP
    assert any(len(p.chunks) > 1 for p in plans if urgent.seq_id in p.chunks)
