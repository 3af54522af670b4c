"""The iteration loop: admit, plan, one Step on the worker, hand out tokens, finish.

Orca-style iteration-level scheduling: requests join and leave the running batch at
every step. The pure decisions live in admission.py and batch_plan.py, the worker's wire
format in worker_client.py, tokens-to-text in output.py and the metrics in metrics.py;
this module keeps the request bookkeeping and the pipeline of Steps; recovery.py takes
over when the worker fails a Step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Callable

from scheduler_service.admission import (
    AdmissionPolicy,
    Budget,
    FCFSAdmission,
    WaitingQueue,
    urgent_admissions,
)
from scheduler_service.batch_plan import BatchPlanner, StepPlan
from scheduler_service.chunking import Chunk, StepBudget
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.output import LOCAL
from scheduler_service.preemption import Swapper, preempt, prefetch_limit
from scheduler_service.recovery import recover
from scheduler_service.sequence import FinishReason, Sequence, Status
from scheduler_service.step_pipeline import StepPipeline
from scheduler_service.worker_client import (
    StepFailed,
    StepToken,
    WorkerClient,
    WorkerInfo,
)

logger = logging.getLogger(__name__)


class IterationLoop:
    def __init__(self, worker: WorkerClient, *, max_rolling_batch_size: int, max_queue: int,
                 max_sparsity: float, max_splits: int, worker_timeout: float,
                 metrics: SchedulerMetrics, max_num_batched_tokens: int, steps_in_flight: int,
                 policy: AdmissionPolicy | None = None,  # None: FCFS
                 enable_chunked_prefill: bool = True, length_labels: bool = True,
                 step_send_lead_ms: float = 3.0, preemption_mode: str = "auto",
                 swap_prefetch: int = -1):
        assert worker.info is not None, "connect the worker before starting the loop"
        self.worker = worker
        self.name = worker.address  # the `worker` label of its metrics
        self.preemption_mode = preemption_mode
        self.swap_prefetch = swap_prefetch
        self.max_batch = max_rolling_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy or FCFSAdmission()
        self._use(worker.info)
        self.chunked = enable_chunked_prefill
        self.worker_timeout = worker_timeout
        self.metrics = metrics
        self.waiting = WaitingQueue(max_queue)
        self.running: dict[int, Sequence] = {}
        self.to_release: list[int] = []
        self._finished: list[tuple[int, int, bool]] = []  # for the next Step (StepPlan)
        self.length_labels = length_labels  # does the worker's length probe learn from them
        self.planner = BatchPlanner(max_sparsity, max_splits)
        self.step_id = 0
        self.admitting = True
        self._wakeup = asyncio.Event()
        self._next_id = 1
        self._stopped = False
        self._step_failures: dict[int, int] = {}  # seq_id -> failed Steps since its last token
        self._one_at_a_time = 0  # admissions left to make singly after a failed Step
        self.steps = StepPipeline(worker, steps_in_flight, step_send_lead_ms)
        # Whether a worker serves: readiness, as health checks and /ping report it.
        self.worker_up = True
        self.on_worker_state: Callable[[bool], None] = lambda up: None
        # Called with the waiting requests when the worker is unreachable; True when it
        # placed them on other workers (worker_pool.py), which takes them off this loop.
        self.on_orphans: Callable[[list[Sequence]], bool] = lambda seqs: False
        self._recovering = False

    def _use(self, info: WorkerInfo) -> None:
        """Take up what the loop plans with from a (re)connected worker's Info."""
        self.info = info
        # Urgent Steps where both the policy and the worker take them.
        self.urgent_steps = info.urgent_steps and self.policy.urgent_steps
        self.eos_ids = info.eos_token_ids
        self.kv_budget = info.kv_capacity_tokens
        # It holds no swapped KV yet.
        self.swapper = Swapper(self.preemption_mode, info.swap,
                               prefetch_limit(self.swap_prefetch, info.device))

    # --- called by the front end -----------------------------------------------------------

    def new_seq_id(self) -> int:
        sid, self._next_id = self._next_id, self._next_id + 1
        return sid

    def submit(self, seq: Sequence) -> None:
        """Queue a request (raises QueueFull)."""
        self.waiting.push(seq)
        self.metrics.requests_received.inc()
        self.metrics.set_waiting(self.name, len(self.waiting))
        self._wakeup.set()
        if self.steps.inflight and self.urgent_steps:
            self.steps.urgent_arrival.set()

    def adopt(self, seqs: list[Sequence]) -> None:
        """Take requests another worker's loop could not run, ahead of this one's queue:
        they arrived earlier. Those that ran are prefilled with the tokens already sent."""
        self.waiting.push_front(seqs)
        self.metrics.set_waiting(self.name, len(self.waiting))
        self._wakeup.set()

    def reserved_tokens(self) -> int:
        """KV tokens reserved by the running and the waiting requests (placement's load)."""
        return (sum(s.reserved_tokens for s in self.running.values())
                + sum(s.reserved_tokens for s in self.waiting))

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """The client went away (or, for a front-end process, a stop string matched: reason
        STOP): drop the request now; its KV is released next step."""
        if seq.finished:
            return
        if self.waiting.remove(seq):
            self.metrics.set_waiting(self.name, len(self.waiting))
        self._finish(seq, reason, emit=False)
        self._wakeup.set()

    def idle(self) -> bool:
        return not self.running and not len(self.waiting)

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    def _set_worker_up(self, up: bool) -> None:
        if up != self.worker_up:
            self.worker_up = up
            self.metrics.set_worker_up(self.name, up)
            self.on_worker_state(up)

    def hand_off_waiting(self, offer: Callable[[list[Sequence]], bool] | None = None) -> None:
        """Offer the waiting requests to `on_orphans` (unreachable) or `offer` (drain)."""
        seqs = list(self.waiting)
        if seqs and (offer or self.on_orphans)(seqs):
            for s in seqs:
                self.waiting.remove(s)
                if s.swapped:  # another worker re-prefills it; this one frees its KV
                    self.swapper.drop(s)
                    self.to_release.append(s.seq_id)
            self._one_at_a_time = 0
            self.metrics.set_waiting(self.name, len(self.waiting))
            self.publish_load()

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while not self._stopped:
                try:
                    # The next Step is planned while the worker runs those in flight,
                    # shortly before it needs it; if an answer comes first it waits until
                    # the next Step is sent, as it would have without the hold.
                    # Urgent Steps come on top: an urgent answer that comes first leaves
                    # the pipeline as deep as before.
                    regular = self.steps.regular()
                    if 0 < regular < self.steps.depth:
                        await self.steps.hold(self._on_urgent())
                    sent = regular < self.steps.depth and await self._send_next()
                    if sent and self.steps.regular() < self.steps.depth:
                        continue  # plan the next step while this one runs
                    if self.steps.inflight:
                        await self._receive()
                        continue
                    if not sent and not self._has_work():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                except StepFailed as exc:
                    await recover(self, exc)
        finally:
            self.steps.close()

    def _on_urgent(self):
        """What a wait for an answer does with an urgent arrival (None: nothing)."""
        return self._send_urgent if self.urgent_steps else None

    async def _send_urgent(self) -> None:
        """Prefill the waiting requests that the policy says should not wait for the next
        Step, where they fit without preempting anyone, in an urgent Step (StepPlan.urgent)."""
        if (not self.admitting or self._one_at_a_time or self.steps.stream is None
                or not self.steps.inflight):
            return
        reserved = sum(s.reserved_tokens for s in self.running.values())
        budget = Budget(self.max_batch - len(self.running), self.kv_budget - reserved,
                        self.max_num_batched_tokens, self.chunked)
        releasing = set(self.to_release).union(*(f.plan.release for f in self.steps.inflight))
        admitted = urgent_admissions(
            self.policy.urgent(self.waiting, self.running.values(),
                               self.steps.prefilling(self.running)), budget, releasing)
        if not admitted:
            return  # no room: the next Step preempts for it, as before
        now = time.monotonic()
        for s in admitted:
            self.waiting.remove(s)
            if s.start_running(now):
                self.metrics.observe_admission(s, now)
        self.metrics.set_waiting(self.name, len(self.waiting))
        prompts = StepBudget(self.max_num_batched_tokens, self.chunked)
        prompts.take(admitted)
        plan = self.planner.urgent(admitted, prompts.chunks)
        for s in admitted:
            self.running[s.seq_id] = s
            s.admitted_step = self.step_id + 1  # the Step _send numbers next
        self.metrics.urgent_steps.inc()
        await self._send(plan)

    def _has_work(self) -> bool:
        return bool(self.running or self.to_release or (self.admitting and len(self.waiting)))

    async def _send_next(self) -> bool:
        """Plan and send the next Step if there is one to send now; returns whether one went."""
        if self.steps.inflight and len(self.waiting) and self.urgent_steps:
            # An urgent arrival the waits for answers did not see (it came with one) goes
            # ahead of the Steps in flight rather than behind them.
            self.steps.urgent_arrival.clear()
            await self._send_urgent()
        advancing = [s for s in self.running.values() if s.advancing]
        if not advancing and not (self.admitting and len(self.waiting)):
            if self.to_release and not self.steps.inflight:
                await self._send(self._plan([], []))  # free the worker's KV now
                return True
            return False
        # The decoding rows first; the prompts' chunks after the admission and its
        # preemptions, in the policy's order, so a victim's chunk takes no budget and an
        # urgent request's can go before those of prompts begun earlier.
        # Under `priority`, less urgent prompts' chunks are capped, and none go beside an
        # urgent prompt's or behind a Step in flight that pays such chunks
        # (policies/urgent_shield.py).
        budget = StepBudget.for_decoding(self.max_num_batched_tokens, self.chunked, advancing)
        background_in_flight = self.steps.background
        admitted = self._admit(budget, background_in_flight) if self.admitting else []
        advancing = [s for s in advancing if s.seq_id in self.running]  # less the preempted
        order = self.policy.prefill_order([s for s in advancing if s.prefilling], admitted,
                                          self.waiting)
        limit = self.policy.chunk_limit(order, self.waiting, background_in_flight)
        budget.take(order, limit)
        background = (self.chunked and limit is not None
                      and any(sid in limit.seq_ids for sid in budget.chunks))
        if not advancing and not admitted:
            if not self.running:
                for head in [s for s in self.waiting if s.reserved_tokens > self.kv_budget]:
                    self.waiting.remove(head)  # it cannot fit even an empty batch: never will
                    self._fail(head, f"request needs {head.reserved_tokens} KV tokens; the "
                                     f"worker holds {self.kv_budget}")
            return False  # else wait for the steps in flight to end sequences
        await self._send(self._plan(advancing, admitted, budget.chunks), background)
        return True

    def _admit(self, prefill: StepBudget, background_in_flight: bool) -> list[Sequence]:
        if not len(self.waiting) and not self.policy.watches_running:
            return []  # nothing to admit, nor to preempt for: most Steps under load
        reserved = sum(s.reserved_tokens for s in self.running.values())
        slots = self.max_batch - len(self.running)
        if self._one_at_a_time > 0:
            slots = min(slots, 1)  # isolate the re-admitted sequences (see recovery.py)
        budget = Budget(slots, self.kv_budget - reserved, prefill.left, prefill.chunked,
                        background_in_flight=background_in_flight)
        victims, budget = preempt(self.policy, self.waiting, self.running, budget,
                                  self.swapper)
        budget = replace(budget, started=tuple(s for s in self.running.values()
                                               if s.advancing and s.prefilling))
        self.to_release += [s.seq_id for s in victims if not s.swapped]
        self.metrics.preemptions.inc(len(victims))
        self.metrics.swapped_preemptions.inc(sum(s.swapped for s in victims))
        admitted = self.policy.admit(self.waiting, budget)
        self.waiting.push_front(victims)  # released by this Step, prefilled by a later one
        self._one_at_a_time = max(0, self._one_at_a_time - len(admitted))
        now = time.monotonic()
        for s in admitted:
            if s.start_running(now):
                self.metrics.observe_admission(s, now)
        self.metrics.set_waiting(self.name, len(self.waiting))
        return admitted

    def _plan(self, advancing: list[Sequence], admitted: list[Sequence],
              chunks: dict[int, Chunk] | None = None) -> StepPlan:
        release, self.to_release = self.to_release, []
        # A sequence whose last token is in flight leaves the worker now: the worker keeps
        # every sequence it holds in some group, and this one needs no more forwards. It
        # stays running here until that token arrives.
        for s in self.running.values():
            if not s.advancing and not s.released:
                s.released = True
                release.append(s.seq_id)
        plan = self.planner.plan(advancing, admitted, release, chunks)
        plan.finished, self._finished = self._finished, []
        plan.swap_out = self.swapper.take_pending()
        for s in admitted:
            self.running[s.seq_id] = s
            if s.swapped:
                # Its KV and state come back as they were: tokens of earlier Steps count.
                plan.swap_in.append(s.seq_id)
                self.swapper.back(s)
            else:
                s.admitted_step = self.step_id + 1  # the Step _send numbers next
        # Victims about to run again get their KV copied back ahead, with one Step's
        # prompt tokens of the budget kept free for arrivals (as FastServe keeps slots).
        plan.prefetch, plan.unprefetch = self.swapper.prefetches(
            lambda: self.policy.order(self.waiting), self.running.values(), self.max_batch,
            self.kv_budget - self.max_num_batched_tokens, plan.swap_out)
        return plan

    async def _send(self, plan: StepPlan, background: bool = False) -> None:
        t0 = time.perf_counter()
        self.step_id += 1
        if not plan.urgent:  # aging counts the regular Steps
            self.waiting.tick()
        for sid in plan.token_ids():
            self.running[sid].in_flight += 1
        await self.steps.send(self.step_id, plan, t0, background)

    async def _receive(self) -> None:
        """Wait for the next answer and hand out its tokens."""
        step, answer, t2 = await self.steps.answer(self._on_urgent())
        for tok in answer.tokens:
            self._on_token(tok, answer.step_id)
        t3 = time.perf_counter()
        # The loop's wait for this answer, from when it could first have come (the step was
        # sent, and the one before it answered); what the worker did not spend is the RPC.
        waited = t2 - max(step.sent, self.steps.last_answer)
        self.steps.last_answer = t3
        self.metrics.observe_step(self.name, step.plan, answer, step.plan_seconds, waited, t3 - t2)
        self.steps.pacer.observe(*step.size, answer.worker_seconds)
        self.publish_load()

    def publish_load(self) -> None:
        """The running, reserved and swapped-out gauges, as of now."""
        reserved = sum(s.reserved_tokens for s in self.running.values())
        self.metrics.set_load(self.name, len(self.running), reserved, self.kv_budget,
                              len(self.swapper.out))

    # --- tokens and endings -----------------------------------------------------------------

    def _on_token(self, tok: StepToken, step_id: int) -> None:
        seq = self.running.get(tok.seq_id) or self.swapper.out.get(tok.seq_id)
        if seq is None or step_id < seq.admitted_step:
            return  # ended while this step was in flight, or from a preempted run
        seq.in_flight -= 1
        now = time.monotonic()
        self.metrics.observe_token(seq, tok, now)
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.cached_tokens = tok.cached_tokens
        if tok.predicted_tokens is not None:
            seq.hidden_predicted_tokens = tok.predicted_tokens
        seq.last_token_time = now
        if self._step_failures:
            self._step_failures.pop(seq.seq_id, None)
        if tok.beam_running:
            seq.beam_steps += 1  # a beam search advanced; its tokens come when it ends
            return
        reason = (seq.sink or LOCAL).token(seq, tok, self.eos_ids)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason, emit: bool = True,
                error: str | None = None) -> None:
        if emit:
            reason = (seq.sink or LOCAL).finish(seq, reason, error)
        if reason == FinishReason.ERROR:
            self.metrics.requests_failed.labels("UNAVAILABLE").inc()
        was_running = self.running.pop(seq.seq_id, None) is not None
        self._step_failures.pop(seq.seq_id, None)
        if was_running and not seq.released:
            self.to_release.append(seq.seq_id)
        if seq.swapped:  # ended (a token in flight, or cancelled) while swapped out
            if self.waiting.remove(seq):
                self.metrics.set_waiting(self.name, len(self.waiting))
            self.swapper.drop(seq)
            self.to_release.append(seq.seq_id)
        if self.length_labels and seq.admitted_step and reason != FinishReason.ERROR:
            # The worker's length probe learns from it (a cut or cancelled one is a bound).
            # Sent for every sequence a worker may have prefilled, also one cancelled
            # before its first token came back or one that ends waiting after a
            # preemption: the worker holds its prompt's features until a label frees them
            # (one that teaches nothing, 0 tokens, only frees them).
            self._finished.append((seq.seq_id, seq.generated,
                                   reason in (FinishReason.EOS, FinishReason.STOP)))
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.metrics.observe_finish(seq, reason, time.monotonic())

    def _fail(self, seq: Sequence, error: str) -> None:
        self._finish(seq, FinishReason.ERROR, error=error)
