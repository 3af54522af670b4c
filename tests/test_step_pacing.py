"""Pacing of pipelined Steps (scheduler_service/step_pacing.py): the fit and the hold as
pure logic, then the iteration loop against a worker whose Steps take real time, where a
request arriving during a Step must be prefilled by the next one. Counted in Steps."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from scheduler_service.chunking import Chunk
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.sequence import FinishEvent
from scheduler_service.step_pacing import MIN_SAMPLES, StepPacer, step_size
from scheduler_service.worker_client import StepAnswer, StepToken, WorkerInfo
from tests.conftest import tiny_model
from tests.loop_driver import greedy_sequence


def test_the_fit_recovers_a_steps_cost_in_rows_and_prompt_tokens():
    pacer = StepPacer(lead_s=0.002)
    cost = lambda rows, tokens: 0.020 + 0.001 * rows + 0.0005 * tokens  # noqa: E731
    sizes = [(r, t) for r in (1, 4, 9, 16) for t in (0, 0, 0, 100, 300)]
    for rows, tokens in sizes[:MIN_SAMPLES - 1]:
        pacer.observe(rows, tokens, cost(rows, tokens))
        assert pacer.expected(8, 0) is None  # too few answers: each Step goes at once
    for rows, tokens in sizes[MIN_SAMPLES - 1:]:
        pacer.observe(rows, tokens, cost(rows, tokens))
    assert pacer.expected(8, 0) == pytest.approx(cost(8, 0), rel=1e-3)
    assert pacer.expected(32, 500) == pytest.approx(cost(32, 500), rel=1e-3)


def test_a_window_without_prompts_still_fits_and_prices_prompts_at_zero():
    pacer = StepPacer(lead_s=0.0)
    for rows in (1, 2, 3, 4) * 4:
        pacer.observe(rows, 0, 0.010 * rows)
    assert pacer.expected(5, 0) == pytest.approx(0.050, rel=1e-3)
    assert pacer.expected(5, 1000) == pytest.approx(0.050, rel=1e-3)  # too early is safe


def test_the_hold_ends_a_lead_before_the_steps_in_flight_should_end():
    pacer = StepPacer(lead_s=0.003, lead_fraction=0.1)
    for _ in range(MIN_SAMPLES):
        pacer.observe(4, 0, 0.050)
    # Begun at t=10.0, two Steps of 50 ms: the next goes 90% of 100 ms less 3 ms after.
    assert pacer.delay(10.0, [(4, 0), (4, 0)], now=10.0) == pytest.approx(0.087, abs=1e-6)
    assert pacer.delay(10.0, [(4, 0)], now=10.040) == pytest.approx(0.002, abs=1e-6)
    assert pacer.delay(10.0, [(4, 0)], now=10.060) == 0.0  # late already: send now
    assert StepPacer(lead_s=-1.0).delay(10.0, [(4, 0)], now=10.0) == 0.0  # pacing off


def test_off_it_learns_nothing_and_zero_times_are_ignored():
    off = StepPacer(lead_s=-1.0)
    on = StepPacer(lead_s=0.0)
    for _ in range(MIN_SAMPLES):
        off.observe(1, 0, 0.01)
        on.observe(1, 0, 0.0)  # a fake worker that reports no time
    assert off.expected(1, 0) is None and on.expected(1, 0) is None


def test_step_size_counts_group_rows_and_chunk_or_prompt_tokens():
    seq = SimpleNamespace(prompt_ids=[1] * 40)
    chunked = SimpleNamespace(groups=[[1, 2], [3]], chunks={3: Chunk(8, 24)}, prefill=[seq],
                              prefill_tokens=16)
    whole = SimpleNamespace(groups=[[1, 2], [3]], chunks={}, prefill=[seq], prefill_tokens=0)
    assert step_size(chunked) == (3, 16)
    assert step_size(whole) == (3, 40)


STEP_S = 0.08  # every Step's time on the fake worker
TOKEN = 5


class TimedStream:
    """A worker that runs one Step at a time, each STEP_S long, in arrival order, and
    reports that time as its own; records which Step first prefilled each sequence."""

    def __init__(self, worker):
        self.worker = worker
        self.step_s, self.reported_s = worker.step_s, worker.reported_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.answers: asyncio.Queue = asyncio.Queue()
        self.runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        while True:
            step_id, plan = await self.queue.get()
            self.worker.started[step_id] = time.perf_counter()
            await asyncio.sleep(self.step_s)
            for s in plan.prefill:
                self.worker.prefilled_in.setdefault(s.seq_id, step_id)
            tokens = [StepToken(sid, TOKEN, cached_tokens=0) for sid in plan.token_ids()]
            await self.answers.put(StepAnswer(step_id, tokens, worker_seconds=self.reported_s))

    async def send(self, step_id, plan):
        self.worker.sent[step_id] = time.perf_counter()
        self.worker.handed_out[step_id] = self.worker.tokens_handed_out()
        await self.queue.put((step_id, plan))

    async def receive(self):
        return await self.answers.get()

    def close(self):
        self.runner.cancel()


class TimedWorker:
    address = "timed-worker"

    def __init__(self, step_s: float = STEP_S, reported_s: float = STEP_S):
        self.info = WorkerInfo("fake", "FakeForCausalLM", vocab_size=1000,
                               eos_token_ids=frozenset([0]), max_position_embeddings=2048,
                               dtype="float32", device="cpu", kv_capacity_tokens=100000)
        self.step_s, self.reported_s = step_s, reported_s
        self.tokens_handed_out = lambda: 0  # the test points it at its sequence
        self.handed_out: dict[int, int] = {}  # Step id -> tokens handed out when it was sent
        self.sent: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self.prefilled_in: dict[int, int] = {}

    def open_steps(self):
        return TimedStream(self)

    async def wait_ready(self, timeout):
        return self.info


@pytest.mark.parametrize("lead_ms, steps_later", [(3.0, 1), (-1.0, 2)])
def test_a_request_arriving_during_a_step_is_prefilled_by_the_next_one(lead_ms, steps_later):
    """Paced, the Step after the one running when a request arrives prefills it; sent as
    soon as the previous one (pacing off), that Step was already planned without it, so the
    request waits one Step more. The worker never waits for a paced Step."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    worker = TimedWorker()

    async def finish(seq):
        while not isinstance(await seq.events.get(), FinishEvent):
            pass

    async def scenario():
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=256, steps_in_flight=2,
                             step_send_lead_ms=lead_ms)
        long = greedy_sequence(loop, tok, "a request that keeps the worker busy", 24)
        loop.submit(long)
        task = asyncio.create_task(loop.run())
        # Past the fit's first answers, a request arrives 10 ms into a Step's run.
        while len(worker.started) < MIN_SAMPLES + 3:
            await asyncio.sleep(0.005)
        running = max(worker.started)
        await asyncio.sleep(max(worker.started[running] + 0.010 - time.perf_counter(), 0))
        late = greedy_sequence(loop, tok, "a request that arrives while a step runs", 2)
        loop.submit(late)
        await asyncio.wait_for(asyncio.gather(finish(late), finish(long)), 30)
        loop.stop()
        task.cancel()
        return running, late

    running, late = asyncio.run(scenario())
    assert worker.prefilled_in[late.seq_id] == running + steps_later
    if lead_ms >= 0:
        # Paced Steps reach the worker before it ends the one before (a lead of 11 ms; the
        # bound leaves room for a loaded machine's late timers).
        paced = [i for i in worker.started if i > MIN_SAMPLES + 2 and i - 1 in worker.started]
        early = [i for i in paced if worker.sent[i] < worker.started[i - 1] + STEP_S]
        assert len(early) >= 0.7 * len(paced)


def test_when_the_worker_answers_before_the_hold_ends_the_next_step_goes_first():
    """A worker 10x quicker than its reported times: every hold ends with the answer, and
    the next Step is still sent before that answer's token is handed out (as without
    pacing), so the worker waits only for the planning, and every token arrives."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    worker = TimedWorker(step_s=0.01, reported_s=0.1)

    async def scenario():
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=256, steps_in_flight=2,
                             step_send_lead_ms=3.0)
        seq = greedy_sequence(loop, tok, "a request the worker is quick with", 30)
        worker.tokens_handed_out = lambda: len(seq.output_ids)
        loop.submit(seq)
        task = asyncio.create_task(loop.run())
        while not isinstance(await seq.events.get(), FinishEvent):
            pass
        loop.stop()
        task.cancel()
        return seq

    seq = asyncio.run(scenario())
    assert seq.output_ids == [TOKEN] * 30
    paced = [i for i in sorted(worker.sent) if MIN_SAMPLES + 2 < i <= 30]
    assert paced
    # Step i goes out while Step i-1's answer is in but not handed out: i-2 tokens.
    assert all(worker.handed_out[i] == i - 2 for i in paced), worker.handed_out
