"""The iteration loop: admit, plan, one Step on the worker, stream tokens, finish.

Orca-style iteration-level scheduling: requests join and leave the running batch at
every step. The pure decisions live in admission.py and batch_plan.py; this module does
the I/O around them and keeps the request bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from scheduler_service.admission import AdmissionPolicy, Budget, FCFSAdmission
from scheduler_service.batch_plan import BatchPlanner, StepPlan
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.sequence import (FinishEvent, FinishReason, Sequence, Status,
                                        TokenEvent)
from scheduler_service.waiting_queue import WaitingQueue
from scheduler_service.worker_client import (StepFailed, StepStream, WorkerClient,
                                             WorkerUnavailable)
from seqserve.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)
# A sequence that was in this many failed Steps in a row, with no token in between, is
# failed instead of re-admitted (see _recover).
MAX_STEP_FAILURES = 3


@dataclass
class _InFlight:
    """A Step sent to the worker and not yet answered."""

    plan: StepPlan
    step_id: int
    sent: float  # perf_counter when it was handed to the stream
    plan_seconds: float


_STRATEGY = {"greedy": worker_pb2.SamplingParams.STRATEGY_GREEDY,
             "sample": worker_pb2.SamplingParams.STRATEGY_SAMPLE,
             "contrastive": worker_pb2.SamplingParams.STRATEGY_CONTRASTIVE}


class IterationLoop:
    def __init__(self, worker: WorkerClient, *, max_rolling_batch_size: int, max_queue: int,
                 max_sparsity: float, max_splits: int, worker_timeout: float,
                 metrics: SchedulerMetrics, policy: AdmissionPolicy | None = None,
                 max_prefill_tokens: int = 4096, steps_in_flight: int = 2):
        assert worker.info is not None, "connect the worker before starting the loop"
        self.worker = worker
        self.info = worker.info
        self.eos_ids = frozenset(self.info.eos_token_ids)
        self.max_batch = max_rolling_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget = int(self.info.kv_capacity_tokens)
        self.worker_timeout = worker_timeout
        self.metrics = metrics
        self.waiting = WaitingQueue(max_queue)
        self.running: dict[int, Sequence] = {}
        self.to_release: list[int] = []
        self.policy = policy or FCFSAdmission()
        self.planner = BatchPlanner(max_sparsity, max_splits)
        self.step_id = 0
        self.admitting = True
        self._wakeup = asyncio.Event()
        self._next_id = 1
        self._stopped = False
        self._step_failures: dict[int, int] = {}  # seq_id -> failed Steps since its last token
        self._one_at_a_time = 0  # admissions left to make singly after a failed Step
        # Steps sent ahead of their predecessors' answers (vLLM's async scheduling): with 2,
        # the worker finds the next Step queued when it ends one, instead of idling for the
        # answer's round trip and the scheduler's bookkeeping.
        self.steps_in_flight = steps_in_flight
        self._inflight: deque[_InFlight] = deque()
        self._stream: StepStream | None = None
        self._last_answer = 0.0

    # --- called by the RPC handlers ------------------------------------------------------

    def new_seq_id(self) -> int:
        sid, self._next_id = self._next_id, self._next_id + 1
        return sid

    def submit(self, seq: Sequence) -> None:
        """Queue a request (raises QueueFull)."""
        self.waiting.push(seq)
        self.metrics.requests_received.inc()
        self.metrics.queue_size.set(len(self.waiting))
        self._wakeup.set()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the request now; its KV is released next step."""
        if seq.finished:
            return
        if self.waiting.remove(seq):
            self.metrics.queue_size.set(len(self.waiting))
        self._finish(seq, FinishReason.CANCELLED, emit=False)
        self._wakeup.set()

    def idle(self) -> bool:
        return not self.running and not len(self.waiting)

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while not self._stopped:
                try:
                    sent = await self._send_next()
                    if sent and len(self._inflight) < self.steps_in_flight:
                        continue  # plan the next step while this one runs
                    if self._inflight:
                        await self._receive()
                        continue
                    if not sent and not self._has_work():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                except StepFailed as exc:
                    await self._recover(exc)
        finally:
            self._close_stream()

    def _has_work(self) -> bool:
        return bool(self.running or self.to_release or (self.admitting and len(self.waiting)))

    async def _send_next(self) -> bool:
        """Plan and send the next Step if there is one to send now; returns whether one went."""
        advancing = [s for s in self.running.values() if s.advancing]
        if not advancing and not (self.admitting and len(self.waiting)):
            if self.to_release and not self._inflight:
                await self._send(self._plan([], []))  # free the worker's KV now
                return True
            return False
        admitted = self._admit() if self.admitting else []
        if not advancing and not admitted:
            if not self.running:
                # The head request cannot fit even an empty batch: it never will.
                head = self.waiting.pop()
                self._fail(head, f"request needs {head.reserved_tokens} KV tokens; the "
                                 f"worker holds {self.kv_budget}")
            return False  # else wait for the steps in flight to end sequences
        await self._send(self._plan(advancing, admitted))
        return True

    def _admit(self) -> list[Sequence]:
        reserved = sum(s.reserved_tokens for s in self.running.values())
        slots = self.max_batch - len(self.running)
        if self._one_at_a_time > 0:
            slots = min(slots, 1)  # isolate the re-admitted sequences (see _recover)
        budget = Budget(slots, self.kv_budget - reserved, self.max_prefill_tokens)
        admitted = self.policy.admit(self.waiting, budget)
        self._one_at_a_time = max(0, self._one_at_a_time - len(admitted))
        now = time.monotonic()
        for s in admitted:
            s.status = Status.RUNNING
            if s.scheduled_time is None:
                s.scheduled_time = now
                self.metrics.queue_time.observe(now - s.arrival_time)
            if s.sampling_seed is None:
                s.sampling_seed = random.getrandbits(63)
        self.metrics.queue_size.set(len(self.waiting))
        return admitted

    def _plan(self, advancing: list[Sequence], admitted: list[Sequence]) -> StepPlan:
        release, self.to_release = self.to_release, []
        # A sequence whose last token is in flight leaves the worker now: the worker keeps
        # every sequence it holds in some group, and this one needs no more forwards. It
        # stays running here until that token arrives.
        for s in self.running.values():
            if not s.advancing and not s.released:
                s.released = True
                release.append(s.seq_id)
        plan = self.planner.plan(advancing, admitted, release)
        for s in admitted:
            self.running[s.seq_id] = s
        return plan

    def _request(self, plan: StepPlan) -> worker_pb2.StepRequest:
        self.step_id += 1
        prefill = []
        for s in plan.prefill:
            p = s.params
            prefill.append(worker_pb2.NewSequence(
                sequence_id=s.seq_id, token_ids=s.prompt_ids + s.output_ids,
                num_generated=len(s.output_ids), pin_tokens=s.pin_tokens,
                params=worker_pb2.SamplingParams(
                    strategy=_STRATEGY[p.strategy], temperature=p.temperature, top_k=p.top_k,
                    top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
                    seed=s.sampling_seed, penalty_alpha=p.penalty_alpha, logprobs=p.logprobs)))
        return worker_pb2.StepRequest(
            step_id=self.step_id, release=plan.release, prefill=prefill,
            groups=[worker_pb2.Group(sequence_ids=g) for g in plan.groups])

    async def _send(self, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        request = self._request(plan)
        for members in plan.groups:
            for sid in members:
                self.running[sid].pending += 1
        if self._stream is None:
            self._stream = self.worker.open_steps()
        t1 = time.perf_counter()
        self._inflight.append(_InFlight(plan, request.step_id, t1, t1 - t0))
        await self._stream.send(request)

    async def _receive(self) -> None:
        """Wait for the oldest Step in flight and hand out its tokens."""
        step = self._inflight[0]
        response = await self._stream.receive()
        t2 = time.perf_counter()
        if response.step_id != step.step_id:
            raise StepFailed("INTERNAL", f"the worker answered step {response.step_id} where "
                                         f"step {step.step_id} was due")
        self._inflight.popleft()
        for tok in response.tokens:
            self._on_token(tok)
        t3 = time.perf_counter()
        # The loop's wait for this answer, from when it could first have come (the step was
        # sent, and the one before it answered); what the worker did not spend is the RPC.
        waited = t2 - max(step.sent, self._last_answer)
        self._last_answer = t3
        self._observe(step.plan, response, step.plan_seconds, waited, t3 - t2)

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._inflight.clear()

    def _observe(self, plan: StepPlan, response, plan_s: float, rpc_s: float, post_s: float):
        m = self.metrics
        worker_s = response.worker_seconds
        m.step_time.labels("plan").observe(plan_s)
        m.step_time.labels("worker").observe(worker_s)
        m.step_time.labels("rpc").observe(max(rpc_s - worker_s, 0.0))
        m.step_time.labels("postprocess").observe(post_s)
        if plan.groups:
            m.batch_size.observe(sum(len(g) for g in plan.groups))
            m.splits.observe(len(plan.groups))
            m.sparsity.observe(plan.partition.sparsity)
        if plan.regrouped:
            m.regroups.inc()
        m.prefix_cache_bytes.set(response.prefix_cache_bytes)
        m.padded_slots.set(response.kv_slots)
        m.real_tokens.set(response.kv_tokens)
        m.regroup_bytes.inc(response.regroup_bytes)
        m.running.set(len(self.running))
        reserved = sum(s.reserved_tokens for s in self.running.values())
        m.kv_budget_used.set(reserved / self.kv_budget if self.kv_budget else 0.0)

    # --- tokens and endings -----------------------------------------------------------------

    def _on_token(self, tok: worker_pb2.SequenceToken) -> None:
        seq = self.running.get(tok.sequence_id)
        if seq is None:
            return  # ended (cancelled, EOS, stop string) while this step was in flight
        seq.pending -= 1
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival_time)
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
            seq.cached_tokens = tok.cached_tokens
            self.metrics.prefix_hit_tokens.inc(tok.cached_tokens)
        elif seq.last_token_time is not None:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        if self._step_failures:
            self._step_failures.pop(seq.seq_id, None)
        self.metrics.generation_tokens.inc()
        token = tok.token_id
        seq.output_ids.append(token)
        text, stopped = seq.stops.feed(seq.detokenizer.add(token))
        logprob = tok.logprob if tok.HasField("logprob") else None
        top = [(t.id, t.logprob) for t in tok.top_logprobs] if logprob is not None else None
        seq.events.put_nowait(TokenEvent(token, text, logprob, top))
        if stopped:
            self._finish(seq, FinishReason.STOP)
        elif token in self.eos_ids and not seq.params.ignore_eos:
            self._finish(seq, FinishReason.EOS)
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason, emit: bool = True,
                error: str | None = None) -> None:
        tail = ""
        if reason in (FinishReason.EOS, FinishReason.LENGTH):
            tail, stopped = seq.stops.feed(seq.detokenizer.flush())
            if stopped:
                reason = FinishReason.STOP
            else:
                tail += seq.stops.flush()
        was_running = self.running.pop(seq.seq_id, None) is not None
        self._step_failures.pop(seq.seq_id, None)
        if was_running and not seq.released:
            self.to_release.append(seq.seq_id)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        now = time.monotonic()
        self.metrics.requests_finished.labels(reason.value).inc()
        if seq.first_token_time is not None:
            self.metrics.e2e.observe(now - seq.arrival_time)
        if emit:
            seq.events.put_nowait(FinishEvent(reason, tail, len(seq.prompt_ids),
                                              len(seq.output_ids), seq.cached_tokens, error))

    def _fail(self, seq: Sequence, error: str) -> None:
        self._finish(seq, FinishReason.ERROR, error=error)

    # --- worker failure ---------------------------------------------------------------------

    async def _recover(self, exc: StepFailed) -> None:
        """The worker failed a Step: wait for it, then re-admit every running sequence by
        prefilling its prompt plus the tokens already sent, so no token is lost."""
        failed = self._inflight[0] if self._inflight else None
        logger.warning("step %d failed (%s: %s); re-admitting %d running sequences",
                       failed.step_id if failed else self.step_id, exc.code, exc.details,
                       len(self.running))
        # Only the failed Step's sequences are suspects: those first sent in a later Step
        # never ran.
        suspects = ({sid for members in failed.plan.groups for sid in members} if failed
                    else set(self.running))
        self.metrics.worker_up.set(0)
        self._close_stream()  # the Steps sent after the failed one are void
        readmit = list(self.running.values())
        for s in readmit:
            s.pending, s.released = 0, False
        self.running.clear()
        self.to_release.clear()
        self.planner.forget()
        # Why: a request that makes the worker's Step raise (found by tests/test_fuzz.py:
        # sampling with temperature=1e-300, which is 0 in float32, gives NaN probabilities)
        # failed its re-prefill too, so recovery re-admitted it forever in a hot loop and
        # no other request progressed. Now the re-admitted sequences are prefilled one per
        # Step, so the culprit fails alone, and a sequence in MAX_STEP_FAILURES failed
        # Steps in a row with no token in between is failed instead of re-admitted.
        poisoned = []
        for s in readmit:
            if s.seq_id not in suspects:
                continue
            n = self._step_failures.get(s.seq_id, 0) + 1
            self._step_failures[s.seq_id] = n
            if n >= MAX_STEP_FAILURES:
                poisoned.append(s)
        gone = {s.seq_id for s in poisoned}
        readmit = [s for s in readmit if s.seq_id not in gone]
        for s in poisoned:
            self._fail(s, f"generation failed: the worker failed {MAX_STEP_FAILURES} steps in a "
                          f"row with this request ({exc.code}: {exc.details})")
        for s in readmit:
            s.status = Status.WAITING
        self.waiting.push_front(readmit)
        self._one_at_a_time = len(readmit)
        try:
            self.info = await self.worker.wait_ready(self.worker_timeout)
        except WorkerUnavailable as err:
            logger.error("%s; failing %d requests", err, len(self.waiting))
            while len(self.waiting):
                self._fail(self.waiting.pop(), f"no worker available: {err}")
            self.metrics.queue_size.set(0)
            # Keep serving: a worker may come back later for new requests.
            try:
                self.info = await self.worker.wait_ready(None)
            except asyncio.CancelledError:
                raise
        self.metrics.worker_up.set(1)
