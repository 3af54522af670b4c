"""Preemption by recompute and by swap in the iteration loop, against a fake worker that
keeps the real worker's rules (release only live or swapped-out sequences, every live one
in exactly one group, swap out only sequences past their prompt, swap in only swapped-out
ones) and whose token is a function of the prompt and the position, as greedy decoding
is. A preempted sequence must come out unchanged, and an urgent request sent into a full
batch must get its first token within a few Steps. No gRPC, no model."""

from __future__ import annotations

import asyncio
import zlib

import pytest
from transformers import AutoTokenizer

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.params import DecodingConfig
from scheduler_service.policies.mlfq import MLFQAdmission, MLFQConfig
from scheduler_service.policies.priority import PriorityAdmission
from scheduler_service.preemption import SwapFacts
from scheduler_service.sequence import Sequence
from scheduler_service.worker_client import (
    StepAnswer,
    StepFailed,
    StepToken,
    WorkerInfo,
)
from seqserve_common.decoding import DecodingStrategy
from tests.conftest import tiny_model

EOS = 0
TOKENIZER = AutoTokenizer.from_pretrained(str(tiny_model("llama")))


def token(prompt: list[int], position: int) -> int:
    return 1 + zlib.crc32(bytes(f"{prompt}:{position}", "ascii")) % 997


class Stream:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.queued: list = []

    async def send(self, step_id, plan):
        self.queued.append((step_id, plan))

    async def receive(self):
        await asyncio.sleep(0)
        w = self.worker
        step_id, plan = self.queued.pop(0)
        for sid in plan.release:
            if sid not in w.live and sid not in w.swapped:
                raise StepFailed("FAILED_PRECONDITION", f"release of unknown sequence {sid}")
            w.live.pop(sid, None) or w.swapped.pop(sid)
        for sid in plan.swap_out:
            if sid not in w.live or sid not in w.decoding:
                raise StepFailed("FAILED_PRECONDITION", f"swap_out of {sid}, not decoding")
            w.swapped[sid] = w.live.pop(sid)
            w.swap_outs += 1
        for sid in plan.swap_in:
            if sid not in w.swapped:
                raise StepFailed("FAILED_PRECONDITION", f"swap_in of {sid}, not swapped out")
            w.live[sid] = w.swapped.pop(sid)
        for s in plan.prefill:
            if s.seq_id in plan.swap_in:
                continue
            if s.seq_id in w.live or s.seq_id in w.swapped:
                raise StepFailed("FAILED_PRECONDITION", f"sequence {s.seq_id} exists")
            w.decoding.discard(s.seq_id)
            # (prompt, position of the next token): the re-prefill resumes after the tokens
            # the scheduler sends with the prompt.
            w.live[s.seq_id] = [list(s.prompt_ids), len(s.output_ids)]
            w.prefills += 1
        grouped = [sid for g in plan.groups for sid in g]
        if sorted(grouped) != sorted(w.live):
            raise StepFailed("FAILED_PRECONDITION", f"groups {grouped} != live {sorted(w.live)}")
        tokens = []
        for sid in grouped:
            if sid in plan.no_token:
                continue  # a prompt chunk that leaves part of the prompt: no token yet
            prompt, pos = w.live[sid]
            w.live[sid][1] += 1
            w.decoding.add(sid)
            tokens.append(StepToken(sid, token(prompt, pos), cached_tokens=0))
        return StepAnswer(step_id, tokens, worker_seconds=0.0)

    def close(self):
        pass


class Worker:
    address = "fake-worker"

    def __init__(self, swap_capacity_bytes: int = 0):
        # Measured rates that make a swap cheaper than a recompute (option auto swaps).
        swap = SwapFacts(kv_bytes_per_token=1000, capacity_bytes=swap_capacity_bytes,
                         copy_bytes_per_second=1e10, prefill_tokens_per_second=1e4)
        self.info = WorkerInfo("fake", "FakeForCausalLM", vocab_size=1000,
                               eos_token_ids=frozenset([EOS]), max_position_embeddings=4096,
                               dtype="float32", device="cpu", kv_capacity_tokens=100000,
                               swap=swap)
        self.live: dict[int, list] = {}
        self.swapped: dict[int, list] = {}
        self.decoding: set[int] = set()  # gave a token since its (re-)prefill
        self.prefills = 0
        self.swap_outs = 0

    def open_steps(self):
        return Stream(self)

    async def wait_ready(self, timeout):
        self.live.clear()
        self.swapped.clear()
        return self.info


def request(loop: IterationLoop, n_prompt: int, max_new: int, priority: int) -> Sequence:
    sid = loop.new_seq_id()
    return Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[sid + 2] * n_prompt,
                    params=DecodingConfig(max_new_tokens=max_new, strategy=DecodingStrategy.GREEDY),
                    detokenizer=IncrementalDetokenizer(TOKENIZER, []), stops=StopMatcher(()),
                    priority=priority)


def scenario(policy, in_flight: int, mode: str = "auto", swap_capacity_bytes: int = 0):
    worker = Worker(swap_capacity_bytes)
    metrics = SchedulerMetrics()

    async def run():
        loop = IterationLoop(worker, max_rolling_batch_size=2, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=metrics,
                             max_num_batched_tokens=4096, steps_in_flight=in_flight, policy=policy,
                             preemption_mode=mode)
        low = [request(loop, 8, 40, priority=5), request(loop, 12, 40, priority=5)]
        for s in low:
            loop.submit(s)
        task = asyncio.create_task(loop.run())
        while len(low[0].output_ids) < 6:
            await asyncio.sleep(0)
        urgent = request(loop, 5, 4, priority=0)
        loop.submit(urgent)
        sent_at = loop.step_id
        while not urgent.output_ids:
            await asyncio.sleep(0)
        first_token_steps = loop.step_id - sent_at
        for s in [*low, urgent]:
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return low, urgent, first_token_steps

    return asyncio.run(asyncio.wait_for(run(), 30)), metrics, worker


@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("name", ["priority", "mlfq"])
def test_urgent_request_preempts_and_outputs_stay_identical(name, in_flight):
    policy = (PriorityAdmission(aging_steps=1000) if name == "priority" else
              MLFQAdmission(MLFQConfig(base_quantum=2, prefill_tokens_per_step=64)))
    (low, urgent, steps), metrics, worker = scenario(policy, in_flight)
    # The urgent one was planned into the next Step sent and answered with it.
    assert steps <= in_flight + 1
    assert metrics.preemptions._value.get() >= 1
    assert worker.prefills >= 4  # two low, the urgent one, at least one re-prefill
    for s in [*low, urgent]:
        expected = [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]
        assert s.output_ids == expected, f"sequence {s.seq_id} changed under preemption"
    assert not worker.live


@pytest.mark.timeout(30)  # a broken loop may spin without yielding to wait_for
@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("name", ["priority", "mlfq"])
@pytest.mark.parametrize("mode", ["auto", "swap"])
def test_urgent_request_preempts_by_swap_and_outputs_stay_identical(name, in_flight, mode):
    """With swap space the victim's KV goes to host memory and comes back: no re-prefill,
    and the token it had in flight when stopped still counts (were it dropped, or drawn
    again at the wrong position, the output would change)."""
    policy = (PriorityAdmission(aging_steps=1000) if name == "priority" else
              MLFQAdmission(MLFQConfig(base_quantum=2, prefill_tokens_per_step=64)))
    (low, urgent, steps), metrics, worker = scenario(policy, in_flight, mode, 1 << 30)
    assert steps <= in_flight + 1
    assert metrics.swapped_preemptions._value.get() == metrics.preemptions._value.get() >= 1
    assert worker.swap_outs >= 1 and worker.prefills == 3  # no victim prefilled again
    for s in [*low, urgent]:
        expected = [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]
        assert s.output_ids == expected, f"sequence {s.seq_id} changed under swapping"
    assert not worker.live and not worker.swapped


@pytest.mark.parametrize("mode, capacity", [("recompute", 1 << 30), ("swap", 10_000)])
def test_recompute_mode_or_a_full_swap_space_recomputes(mode, capacity):
    """`recompute` never swaps; nor does `swap` when the victim's KV (here 1000 bytes a
    token, more than 10 tokens) does not fit the worker's swap space."""
    policy = PriorityAdmission(aging_steps=1000)
    (low, urgent, _), metrics, worker = scenario(policy, 2, mode, capacity)
    assert metrics.preemptions._value.get() >= 1
    assert metrics.swapped_preemptions._value.get() == 0 and worker.swap_outs == 0
    for s in [*low, urgent]:
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]


def test_fcfs_makes_the_urgent_request_wait():
    """The control: without preemption the urgent request waits for a low one to end."""
    (_, _, steps), metrics, _ = scenario(None, 2)
    assert steps > 30 and metrics.preemptions._value.get() == 0


def test_length_aware_outgrown_reservations_preempt_and_outputs_stay_identical():
    """KV reserved by a prediction of 10 tokens (one bucket, 50) for requests that run 60:
    at the end of the bucket the budget cannot grow them all, so some are preempted and
    recomputed later with a larger reservation; every output is unchanged."""
    from scheduler_service.policies.length_aware import LengthAwareAdmission
    from scheduler_service.policies.length_predictor import LengthPredictor, prefix_keys

    predictor = LengthPredictor()
    worker = Worker()
    worker.info = WorkerInfo("fake", "FakeForCausalLM", vocab_size=1000,
                             eos_token_ids=frozenset([EOS]), max_position_embeddings=4096,
                             dtype="float32", device="cpu", kv_capacity_tokens=200)
    metrics = SchedulerMetrics()

    async def run():
        loop = IterationLoop(worker, max_rolling_batch_size=4, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=metrics,
                             max_num_batched_tokens=4096, steps_in_flight=2,
                             policy=LengthAwareAdmission(predictor, aging_steps=1000))
        seqs = [request(loop, 8, 60, priority=0) for _ in range(3)]
        for s in seqs:
            predictor.learn(8, prefix_keys(s.prompt_ids, 64), 10)
            loop.submit(s)
        task = asyncio.create_task(loop.run())
        for s in seqs:
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return seqs

    seqs = asyncio.run(asyncio.wait_for(run(), 30))
    assert metrics.preemptions._value.get() >= 1
    for s in seqs:
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(60)]
    # It learned the real lengths of those that ended before the last admission (the
    # policy learns when it next admits).
    assert predictor.learned >= 3 + 2


def test_a_preempted_sequence_that_ends_waiting_still_labels_the_length_probe():
    """The worker keeps a sequence's prompt features for its length probe until the
    sequence's length comes back (StepRequest.finished); one preempted and then cancelled
    while waiting must send it too, or the worker holds the features for nothing."""
    loop = IterationLoop(Worker(), max_rolling_batch_size=2, max_queue=16, max_sparsity=0.3,
                         max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                         max_num_batched_tokens=4096, steps_in_flight=1)
    s = request(loop, 8, 40, priority=0)
    loop.submit(s)
    s.admitted_step, s.output_ids = 1, [7, 8, 9]  # ran three tokens, was preempted
    loop.cancel(s)
    assert loop._plan([], []).finished == [(s.seq_id, 3, False)]  # a lower bound
    # Cancelled after its prefill went to the worker, before its first token came back.
    s = request(loop, 8, 40, priority=0)
    loop.submit(s)
    s.admitted_step = 2
    loop.cancel(s)
    assert loop._plan([], []).finished == [(s.seq_id, 0, False)]


def first_token_steps_behind_a_long_prompt(policy, *, in_flight: int, slots: int,
                                           urgent_prompt: int) -> tuple[int, list, Sequence]:
    """A low-priority sequence decodes and another prefills a 640-token prompt, 64 tokens a
    Step (max_num_batched_tokens 65: one decoding row and one chunk); an urgent request
    arrives in mid-prefill. Returns the Steps sent from its arrival to its first token,
    and the sequences, run to their end."""
    worker = Worker()

    async def run():
        loop = IterationLoop(worker, max_rolling_batch_size=slots, max_queue=16,
                             max_sparsity=0.3, max_splits=2, worker_timeout=5,
                             metrics=SchedulerMetrics(), max_num_batched_tokens=65,
                             steps_in_flight=in_flight, policy=policy)
        decoding = request(loop, 8, 60, priority=5)
        loop.submit(decoding)
        task = asyncio.create_task(loop.run())
        while not decoding.output_ids:
            await asyncio.sleep(0)
        long = request(loop, 640, 4, priority=5)
        loop.submit(long)
        while long.prefilled < 128:
            await asyncio.sleep(0)
        urgent = request(loop, urgent_prompt, 4, priority=0)
        loop.submit(urgent)
        sent_at = loop.step_id
        while not urgent.output_ids:
            await asyncio.sleep(0)
        steps = loop.step_id - sent_at
        for s in (decoding, long, urgent):
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return steps, [decoding, long], urgent

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("slots", [3, 2])  # a slot free; the batch full (one is preempted)
def test_urgent_prompt_chunk_goes_before_prompts_begun_earlier(in_flight, slots):
    """Counted in Steps: the urgent request is admitted into the next Step planned and its
    chunk is paid before the long prompt's, so its first token comes with that Step. (Were
    the prompts begun paid first, it would wait for the long prompt's 8 more chunks; were
    a victim's chunk paid before the preemption, the Step that stops the victim would have
    no budget left to admit it.)"""
    steps, low, urgent = first_token_steps_behind_a_long_prompt(
        PriorityAdmission(aging_steps=1000), in_flight=in_flight, slots=slots,
        urgent_prompt=5)
    assert steps <= in_flight + 1
    for s in [*low, urgent]:
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]


def test_a_long_urgent_prompts_later_chunks_go_first_too():
    """A 200-token urgent prompt takes 4 of the 64-token Step budgets, each ahead of the
    long prompt begun before it: its first token comes with its 4th Step."""
    steps, low, urgent = first_token_steps_behind_a_long_prompt(
        PriorityAdmission(aging_steps=1000), in_flight=1, slots=3, urgent_prompt=200)
    assert steps <= 4 + 1
    for s in [*low, urgent]:
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]


def test_fcfs_pays_the_prompts_begun_first():
    """The control: FCFS keeps arrival order in the budget too, so the urgent request waits
    for the long prompt's chunks."""
    steps, _, _ = first_token_steps_behind_a_long_prompt(None, in_flight=1, slots=3,
                                                         urgent_prompt=5)
    assert steps >= 8


@pytest.mark.timeout(30)  # a broken loop may spin without yielding to wait_for
@pytest.mark.parametrize("name", ["priority", "priority-shield", "mlfq"])
def test_random_priorities_under_a_small_step_budget_all_finish_unchanged(name):
    """Prompts of 5-300 tokens with random priorities arriving while others run, a 65-token
    Step budget (chunks in the policy's order, preemptions): every request ends, each
    output as if alone, and the fake worker (which refuses a Step that breaks its rules)
    never fails."""
    import random

    rng = random.Random(5)
    policy = (PriorityAdmission(aging_steps=16) if name == "priority" else
              PriorityAdmission(aging_steps=16, background_chunk_tokens=40)
              if name == "priority-shield" else
              MLFQAdmission(MLFQConfig(base_quantum=2, prefill_tokens_per_step=64)))
    worker, metrics = Worker(), SchedulerMetrics()

    async def run():
        loop = IterationLoop(worker, max_rolling_batch_size=3, max_queue=32, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=metrics,
                             max_num_batched_tokens=65, steps_in_flight=2, policy=policy)
        task = asyncio.create_task(loop.run())
        seqs = []
        for _ in range(12):
            s = request(loop, rng.choice([5, 40, 130, 300]), rng.randint(4, 40),
                        priority=rng.randint(-3, 3))
            seqs.append(s)
            loop.submit(s)
            for _ in range(rng.randint(0, 10)):
                await asyncio.sleep(0)
        for s in seqs:
            while not s.finished:
                await asyncio.sleep(0.001)
        loop.stop()
        await task
        return seqs

    seqs = asyncio.run(asyncio.wait_for(run(), 30))
    for s in seqs:
        assert s.finish_reason is not None and s.finish_reason.value == "length"
        assert s.output_ids == [token(s.prompt_ids, i) for i in range(s.params.max_new_tokens)]
    assert not worker.live and metrics.preemptions._value.get() >= 1


def _seq(sid: int, prompt: int, generated: int, strategy=DecodingStrategy.GREEDY,
         **params) -> Sequence:
    s = Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[3] * prompt,
                 params=DecodingConfig(max_new_tokens=500, strategy=strategy, **params),
                 detokenizer=None, stops=None)
    s.output_ids = [4] * generated
    return s


def test_swapper_weighs_the_measured_costs_and_keeps_account():
    """A 100-token KV of 1000 bytes a token: 0.2 ms to copy out and in at 1 GB/s against
    10 ms to prefill at 10k tokens/s, so auto swaps; at 1 MB/s (200 ms) it recomputes,
    where mode swap still swaps. The swap space (1 MB: 1000 tokens) takes what fits."""
    from scheduler_service.preemption import Swapper

    fast = SwapFacts(1000, 10**6, 1e9, 1e4)
    slow = SwapFacts(1000, 10**6, 1e6, 1e4)
    assert Swapper("auto", fast).choose(_seq(1, 90, 11))
    assert not Swapper("auto", slow).choose(_seq(1, 90, 11))
    assert Swapper("swap", slow).choose(_seq(1, 90, 11))
    assert not Swapper("recompute", fast).choose(_seq(1, 90, 11))
    assert not Swapper("auto", SwapFacts(1000, 10**6, 0.0, 0.0)).choose(_seq(1, 90, 11))
    assert not Swapper("swap", SwapFacts()).choose(_seq(1, 90, 11))  # no swap space
    sw = Swapper("swap", fast)
    first = _seq(1, 500, 101)
    assert sw.stop(first) and first.swapped and sw.take_pending() == [1]  # 600 tokens' KV
    assert not sw.stop(_seq(2, 500, 101))  # 1.2 MB would not fit
    sw.back(first)
    assert not first.swapped and sw.stop(_seq(2, 500, 101))
    # Only greedy or sampled sequences past their prompt.
    assert not sw.choose(_seq(3, 5, 2, DecodingStrategy.CONTRASTIVE, top_k=4))
    assert not sw.choose(_seq(4, 5, 2, DecodingStrategy.BEAM, num_beams=2))
    prefilling = _seq(5, 50, 0)
    prefilling.start_running(0.0)
    assert prefilling.prefilling and not sw.choose(prefilling)
    with pytest.raises(ValueError, match="preemption mode"):
        Swapper("sometimes", fast)


def _loop_with_swapped() -> tuple[IterationLoop, Sequence]:
    """A loop whose worker has swap space, and a running sequence it has just swapped out
    (its swap-out not yet sent, one token of it in flight)."""
    loop = IterationLoop(Worker(1 << 30), max_rolling_batch_size=2, max_queue=16,
                         max_sparsity=0.3, max_splits=2, worker_timeout=5,
                         metrics=SchedulerMetrics(), max_num_batched_tokens=4096,
                         steps_in_flight=2, preemption_mode="swap")
    s = request(loop, 8, 40, priority=5)
    loop.submit(s)
    loop.waiting.remove(s)
    s.start_running(0.0)
    s.prefilled, s.output_ids, s.in_flight = s.prefill_target, [7, 8], 1
    assert loop.swapper.stop(s)
    loop.waiting.push_front([s])
    return loop, s


def test_a_swapped_request_handed_to_another_worker_is_released_here():
    loop, s = _loop_with_swapped()
    loop.hand_off_waiting(lambda seqs: True)
    assert not s.swapped and s.in_flight == 0 and not loop.swapper.out
    assert not loop.swapper.held and not loop.swapper.pending  # its swap-out never goes
    assert loop.to_release == [s.seq_id] and s not in list(loop.waiting)


def test_a_swapped_request_cancelled_is_released_and_a_failed_worker_forgets_them():
    loop, s = _loop_with_swapped()
    loop.cancel(s)
    assert s.finished and not s.swapped and loop.to_release == [s.seq_id]
    assert not loop.swapper.out and not loop.swapper.pending and not len(loop.waiting)
    loop, s = _loop_with_swapped()
    loop.swapper.forget()  # recovery.recover: the worker lost the swapped KV
    assert not s.swapped and s.in_flight == 0 and s in list(loop.waiting)
    s.start_running(0.0)
    assert s.prefilling and s.prefill_target == 8 + 2  # prefilled again, output included


@pytest.mark.parametrize("chunked", [False, True])
def test_a_swapped_sequence_is_admitted_for_one_token_of_the_prefill_budget(chunked):
    """It comes back with its KV: admission charges it one decoding token, not its
    length, so a 600-token one leaves a 100-token budget to the prompt behind it."""
    from scheduler_service.admission import Budget, fitting_prefix

    swapped, fresh = _seq(1, 500, 100), _seq(2, 50, 0)
    swapped.swapped = True
    budget = Budget(free_slots=4, free_kv_tokens=10**6, prefill_tokens=100, chunked=chunked)
    assert fitting_prefix([swapped, fresh], budget) == [swapped, fresh]
    swapped.swapped = False  # to be prefilled again: its 600 tokens take the budget
    assert fitting_prefix([swapped, fresh], budget) == [swapped]


def test_the_swap_choice_follows_a_worker_restarted_with_other_swap_space():
    """watch_worker reads each Info: a worker that came back with no swap space between
    two Steps is no longer sent victims to swap (nothing of it was swapped out)."""
    from scheduler_service.recovery import watch_worker

    worker = Worker(1 << 30)
    loop = IterationLoop(worker, max_rolling_batch_size=2, max_queue=16, max_sparsity=0.3,
                         max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                         max_num_batched_tokens=4096, steps_in_flight=2,
                         preemption_mode="swap")
    restarted = Worker(0).info

    async def fetch_info(timeout):
        return restarted

    worker.fetch_info = fetch_info

    async def run():
        task = asyncio.create_task(watch_worker(loop, interval=0.01))
        while loop.swapper.facts.capacity_bytes:
            await asyncio.sleep(0.01)
        loop.stop()
        await task

    asyncio.run(asyncio.wait_for(run(), 10))
    assert loop.swapper.facts == restarted.swap and not loop.swapper.choose(_seq(1, 90, 11))
