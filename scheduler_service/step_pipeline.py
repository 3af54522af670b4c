"""The Steps on their way to one worker and back: its stream, the Steps sent and not yet
answered, when to send the next (step_pacing.py), and the answers as they come.

Steps sent ahead of their predecessors' answers (vLLM's async scheduling): with a depth
of 2 the worker finds the next Step queued when it ends one, instead of idling for the
answer's round trip and the scheduler's bookkeeping. The worker answers in order, but for
urgent Steps (docs/scheduling.md), which it runs ahead of the others and which come on
top of the depth. While the loop waits for an answer, an urgent arrival is handed to its
`on_urgent` at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

from scheduler_service.batch_plan import StepPlan
from scheduler_service.sequence import Sequence
from scheduler_service.step_pacing import SentStep, StepPacer
from scheduler_service.worker_client import StepAnswer, StepFailed, StepStream, WorkerClient

OnUrgent = Callable[[], Awaitable[None]] | None


class StepPipeline:
    def __init__(self, worker: WorkerClient, depth: int, send_lead_ms: float):
        self.worker = worker
        self.depth = depth  # regular Steps in flight at most (option.steps_in_flight)
        self.inflight: deque[SentStep] = deque()
        self.stream: StepStream | None = None
        # A Step sent ahead waits until just before the worker should need it, so that
        # requests arriving meanwhile join it (step_pacing.py).
        self.pacer = StepPacer(send_lead_ms / 1000 if send_lead_ms >= 0 else -1.0)
        # The next answer, once a wait has asked for it.
        self._answer: asyncio.Future | None = None
        self.answered_at = 0.0  # perf_counter when the last answer arrived
        self.last_answer = 0.0  # ... and when its tokens were handed out
        # Set by an arrival that may go in an urgent Step: a wait hands it on at once.
        self.urgent_arrival = asyncio.Event()

    def regular(self) -> int:
        """Regular Steps in flight (urgent ones come on top)."""
        return sum(not f.plan.urgent for f in self.inflight)

    def prefilling(self, running: Mapping[int, Sequence]) -> list[tuple[Sequence, int]]:
        """The running sequences with a prompt chunk in a Step in flight, each with the
        prompt tokens it had left when the chunk went."""
        # At least the chunk itself: a sequence preempted and admitted again since has a
        # new target.
        return [(running[sid], max(running[sid].prefill_target - chunk.start,
                                   chunk.end - chunk.start))
                for f in self.inflight for sid, chunk in f.plan.chunks.items()
                if sid in running]

    @property
    def background(self) -> bool:
        """Whether a Step in flight pays chunks the policy capped."""
        return any(f.background for f in self.inflight)

    async def send(self, step_id: int, plan: StepPlan, planned_at: float,
                   background: bool = False) -> None:
        """Send a Step planned from `planned_at` (perf_counter) on."""
        if self.stream is None:
            self.stream = self.worker.open_steps()
        sent = time.perf_counter()
        self.inflight.append(SentStep(plan, step_id, sent, sent - planned_at, background))
        await self.stream.send(step_id, plan)

    async def hold(self, on_urgent: OnUrgent) -> None:
        """Wait until the next Step should be planned (StepPacer), or the oldest Step's
        answer arrives (the worker was quicker than expected)."""
        first = self.inflight[0]
        delay = self.pacer.delay(max(first.sent, self.answered_at),
                                 [f.size for f in self.inflight], time.perf_counter())
        if delay > 0:
            await self._wait(delay, on_urgent)

    async def answer(self, on_urgent: OnUrgent) -> tuple[SentStep, StepAnswer, float]:
        """The next answer (the oldest Step's, or an urgent one's that went ahead of it),
        its Step, out of the pipeline, and when it came (perf_counter)."""
        await self._wait(None, on_urgent)
        answer, self._answer = self._answer.result(), None
        now = time.perf_counter()
        at = next((i for i, f in enumerate(self.inflight) if f.step_id == answer.step_id),
                  None)
        if at is None or (at and not self.inflight[at].plan.urgent):
            raise StepFailed("INTERNAL", f"the worker answered step {answer.step_id} where "
                                         f"step {self.inflight[0].step_id} was due")
        step = self.inflight[at]
        del self.inflight[at]
        # Where `hold` counts the oldest Step in flight from. After an urgent answer that
        # Step (which the urgent one interrupted) still has its own rest to run, so this
        # errs late, which costs at most the planning's time: the wait also ends on its
        # answer. Counting from its earlier start instead would err early, by the urgent
        # Step's time, and queue the next Step sooner, ahead of more arrivals.
        self.answered_at = now
        return step, answer, now

    async def _wait(self, timeout: float | None, on_urgent: OnUrgent) -> None:
        """Until the next answer is in `_answer` (or `timeout` seconds pass)."""
        if self._answer is None:
            self._answer = asyncio.ensure_future(self.stream.receive())
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self._answer.done():
            if on_urgent is not None and self.urgent_arrival.is_set():
                self.urgent_arrival.clear()
                await on_urgent()
                continue
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return
            if on_urgent is None:
                await asyncio.wait({self._answer}, timeout=left)
                return
            arrival = asyncio.ensure_future(self.urgent_arrival.wait())
            try:
                await asyncio.wait({self._answer, arrival}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrival.cancel()

    def close(self) -> None:
        """End the stream; the Steps in flight count as never run."""
        if self._answer is not None:
            if self._answer.done() and not self._answer.cancelled():
                self._answer.exception()  # retrieved: the failure is being handled
            self._answer.cancel()
            self._answer = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.inflight.clear()
