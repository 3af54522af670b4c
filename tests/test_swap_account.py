"""The scheduler's account of the worker's swap space against the worker's own: the
iteration loop drives a real engine in process through the servicer's Step path (the
StepRequest and StepResponse messages, no gRPC). After every Step the bytes the
scheduler's Swapper counts as swapped out equal the bytes the engine's swap space holds,
whatever the Steps in flight, and both sides' gauges say so; a swap space that fits one
victim and not two is used to the byte; and every output equals model.generate."""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.params import DecodingConfig
from scheduler_service.policies.priority import PriorityAdmission
from scheduler_service.sequence import Sequence
from scheduler_service.worker_client import StepAnswer, StepFailed, WorkerInfo, encode_step
from seqserve_common.decoding import DecodingStrategy
from tests.conftest import tiny_model
from tests.test_engine import _reference
from tests.test_kv_swap import DEVICES
from worker_service.engine import Engine
from worker_service.kv_swap import swap_space
from worker_service.metrics import WorkerMetrics
from worker_service.model_runner import ModelRunner
from worker_service.sequence import DecodingParams
from worker_service.servicer import WorkerServicer
from worker_service.step import PrefillSpec

LOW, URGENT = 5, 0
MAX_NEW = 24


class InProcessSteps:
    """A Steps stream into the engine: each Step runs when its answer is awaited, as a
    worker runs them one after the other, and the two accounts are compared then."""

    def __init__(self, worker: InProcessWorker):
        self.worker = worker
        self.sent: list = []

    async def send(self, step_id, plan):
        # What the scheduler counts as held once this Step's swap-outs and swap-ins ran.
        loop = self.worker.loop
        held = sum(loop.swapper.held.values())
        self.sent.append((encode_step(step_id, plan), held, set(loop.swapper.prefetched)))
        # The scheduler's gauge, as of the last answer.
        self.worker.swapped_gauge.append(loop.metrics.swapped._value.get())

    async def receive(self):
        await asyncio.sleep(0)
        w = self.worker
        request, held, prefetched = self.sent.pop(0)
        result = w.servicer._submit(w.engine, request).result()
        answer = StepAnswer.from_proto(w.servicer._response(request, result))
        w.requests.append(request)
        w.accounts.append((held, w.engine.swap.used_bytes))
        w.prefetch_accounts.append((prefetched, {sid for sid, e in w.engine.swap._held.items()
                                                 if e.device_kv is not None}))
        w.most_swapped = max(w.most_swapped, len(w.engine.swap))
        m = w.servicer.metrics
        assert (m.swap_bytes._value.get(), m.swapped._value.get()) == \
            (w.engine.swap.used_bytes, len(w.engine.swap))
        return answer

    def close(self):
        pass


class InProcessWorker:
    address = "in-process"

    def __init__(self, model_dir, swap_bytes: int, device: str = "cpu"):
        runner = ModelRunner(str(model_dir), device=device)
        self.engine = Engine(runner, swap=swap_space(swap_bytes, runner.device))
        self.servicer = WorkerServicer(kv_cache_bytes=64 << 20, metrics=WorkerMetrics())
        self.servicer.attach(self.engine)
        self.info = WorkerInfo.from_proto(self.servicer.Info(None, None))
        self.loop: IterationLoop | None = None
        self.requests: list = []  # the Steps run, as sent
        self.accounts: list[tuple[int, int]] = []  # (scheduler's, worker's) after each Step
        # The same of the swapped-out sequences with a device copy (prefetched).
        self.prefetch_accounts: list[tuple[set[int], set[int]]] = []
        self.most_swapped = 0
        self.swapped_gauge: list[float] = []  # seqserve_num_requests_swapped at each send

    def open_steps(self):
        return InProcessSteps(self)

    async def wait_ready(self, timeout):
        return self.info


def _request(loop: IterationLoop, tokenizer, prompt: list[int], priority: int) -> Sequence:
    return Sequence(seq_id=loop.new_seq_id(), request_id=str(len(prompt)), prompt_ids=prompt,
                    # ignore_eos: a sequence that ended early would leave the scenario
                    # waiting for tokens that never come.
                    params=DecodingConfig(max_new_tokens=MAX_NEW, ignore_eos=True,
                                          strategy=DecodingStrategy.GREEDY),
                    detokenizer=IncrementalDetokenizer(tokenizer, []), stops=StopMatcher(()),
                    priority=priority)


def _loop(worker: InProcessWorker, in_flight: int) -> IterationLoop:
    """Two slots, priorities, and victims swapped whenever the swap space has room."""
    loop = IterationLoop(worker, max_rolling_batch_size=2, max_queue=16, max_sparsity=0.3,
                         max_splits=2, worker_timeout=30, metrics=SchedulerMetrics(),
                         max_num_batched_tokens=4096, steps_in_flight=in_flight,
                         policy=PriorityAdmission(aging_steps=1000), preemption_mode="swap")
    worker.loop = loop
    return loop


async def _preempt_both(loop: IterationLoop, tokenizer, prompts: list[list[int]]):
    """Start the loop with two low-priority requests (both slots); once both have 4 or
    more tokens, send two urgent ones, which preempt both. Returns (low, urgent, the
    loop's task)."""
    low = [_request(loop, tokenizer, p, LOW) for p in prompts[:2]]
    for s in low:
        loop.submit(s)
    task = asyncio.create_task(loop.run())
    while min(len(s.output_ids) for s in low) < 4:
        await asyncio.sleep(0)
    urgent = [_request(loop, tokenizer, p, URGENT) for p in prompts[2:]]
    for s in urgent:
        loop.submit(s)
    return low, urgent, task


def _run(in_flight: int, swap_tokens: int, device: str = "cpu", prefetch: int = 0,
         kv_budget: int | None = None):
    """_preempt_both with 12-token low prompts (15 KV tokens or more when preempted), to
    the end; the swap space holds `swap_tokens` tokens; up to `prefetch` victims are
    copied back ahead of their turn; `kv_budget`: the scheduler's KV budget in tokens
    (None: the worker's)."""
    model_dir = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    worker = InProcessWorker(model_dir, 0, device)
    worker.engine.swap = swap_space(swap_tokens * worker.info.swap.kv_bytes_per_token,
                                    worker.engine.device)
    worker.info = WorkerInfo.from_proto(worker.servicer.Info(None, None))
    rng = random.Random(3)
    prompts = [[rng.randint(3, 200) for _ in range(n)] for n in (12, 12, 5, 6)]

    async def run():
        loop = _loop(worker, in_flight)
        loop.swapper.prefetch_limit = prefetch
        if kv_budget is not None:
            loop.kv_budget = kv_budget
        low, urgent, task = await _preempt_both(loop, tokenizer, prompts)
        for s in [*low, *urgent]:
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return [*low, *urgent], loop

    seqs, loop = asyncio.run(asyncio.wait_for(run(), 120))
    return model_dir, seqs, loop, worker


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_the_scheduler_counts_the_swap_space_as_the_worker_fills_it(in_flight, device):
    model_dir, seqs, loop, worker = _run(in_flight, swap_tokens=1000, device=device)
    assert worker.most_swapped == 2, "both victims are swapped out at once"
    assert max(worker.swapped_gauge) == 2 and worker.swapped_gauge[-1] == 0
    mismatched = [(i, a) for i, a in enumerate(worker.accounts) if a[0] != a[1]]
    assert not mismatched, f"(Step, (scheduler's bytes, worker's bytes)): {mismatched}"
    assert worker.engine.swap.used_bytes == 0 and not loop.swapper.held
    for s in seqs:
        assert s.output_ids == _reference(model_dir, s.prompt_ids, len(s.output_ids))


def test_a_swap_space_for_one_victim_takes_one_and_recomputes_the_other():
    """Room for one victim's KV (15-24 tokens) and not for two: the scheduler swaps one
    and recomputes the other (a worker asked to swap more than fits fails the Step)."""
    model_dir, seqs, loop, worker = _run(1, swap_tokens=24)
    assert worker.most_swapped == 1
    assert loop.metrics.swapped_preemptions._value.get() == 1
    assert loop.metrics.preemptions._value.get() == 2
    assert all(a == b for a, b in worker.accounts)
    for s in seqs:
        assert s.output_ids == _reference(model_dir, s.prompt_ids, len(s.output_ids))


def test_a_reset_zeroes_the_workers_swap_gauges():
    """Every scheduler (re)connect sends Reset, which empties the swap space: an idle
    worker must not go on exporting KV it no longer holds."""
    worker = InProcessWorker(tiny_model("llama"), 1 << 30)
    engine, metrics = worker.engine, worker.servicer.metrics
    engine.step([], [PrefillSpec(1, [3, 4, 5, 6, 7], 0, DecodingParams())], [[1]])
    metrics.observe_step(engine.step([], [], [], swap_out=[1]), 0)
    assert metrics.swapped._value.get() == 1 and metrics.swap_bytes._value.get() > 0
    worker.servicer.Reset(None, None)
    assert (metrics.swapped._value.get(), metrics.swap_bytes._value.get()) == (0, 0)
    assert len(engine.swap) == 0


def test_a_failed_step_clears_the_schedulers_swapped_gauge_while_the_worker_is_down():
    """Recovery forgets the swapped-out sequences (they are prefilled again); the gauges
    say so at once, not at the next answer, which a worker that stays down never gives."""
    model_dir = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    worker = InProcessWorker(model_dir, 1 << 30)
    failing = {"now": False}

    class FailingSteps(InProcessSteps):
        async def receive(self):
            if failing["now"]:
                raise StepFailed("UNAVAILABLE", "the worker died")
            return await super().receive()

    async def stays_down(timeout):
        await asyncio.sleep(3600)

    worker.open_steps = lambda: FailingSteps(worker)

    async def run():
        loop = _loop(worker, 1)
        prompts = [[5] * 12, [6] * 12, [50] * 5, [51] * 5]
        _, _, task = await _preempt_both(loop, tokenizer, prompts)
        while loop.metrics.swapped._value.get() < 2:
            await asyncio.sleep(0)
        worker.wait_ready = stays_down
        failing["now"] = True
        while loop.worker_up:
            await asyncio.sleep(0.01)
        gauges = (loop.metrics.swapped._value.get(), loop.metrics.running._value.get())
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return gauges, len(loop.swapper.out)

    (swapped, running), out = asyncio.run(asyncio.wait_for(run(), 60))
    assert out == 0 and (swapped, running) == (0, 0)
