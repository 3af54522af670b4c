"""Worker-crash recovery for an iteration loop (loop.py): when the worker fails a Step, wait
for it to serve again and re-admit every running sequence by prefilling its prompt plus the
tokens already sent, so no token is lost; a request that keeps failing Steps is failed.
Between Steps, `watch_worker` keeps readiness in step with a worker that dies or returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from scheduler_service.preemption import take_off_worker
from scheduler_service.worker_client import StepFailed, WorkerInfo, WorkerUnavailable

if TYPE_CHECKING:
    from scheduler_service.loop import IterationLoop

logger = logging.getLogger(__name__)
# A sequence that was in this many failed Steps in a row, with no token in between, is
# failed instead of re-admitted.
MAX_STEP_FAILURES = 3


async def recover(loop: IterationLoop, exc: StepFailed) -> None:
    """The worker failed a Step: wait for it, then re-admit every running sequence by
    prefilling its prompt plus the tokens already sent, so no token is lost."""
    failed = loop.steps.inflight[0] if loop.steps.inflight else None
    logger.warning("step %d failed (%s: %s); re-admitting %d running sequences",
                   failed.step_id if failed else loop.step_id, exc.code, exc.details,
                   len(loop.running))
    # Only the failed Step's sequences are suspects: those first sent in a later Step
    # never ran. An urgent Step runs ahead of the oldest: its sequences are suspects too.
    suspects = ({sid for members in failed.plan.groups for sid in members}
                | set(failed.plan.swap_out) if failed else set(loop.running))
    suspects |= {sid for f in loop.steps.inflight if f.plan.urgent
                 for members in f.plan.groups for sid in members}
    loop._recovering = True
    loop._set_worker_up(False)
    loop.steps.close()  # the Steps sent after the failed one are void
    readmit = list(loop.running.values())
    take_off_worker(readmit)
    loop.swapper.forget()
    loop.running.clear()
    loop.to_release.clear()
    loop.planner.forget()
    loop.publish_load()  # the gauges too: no Step answers while the worker is down
    # A request that makes the worker's Step raise (e.g. a temperature that is 0 in
    # float32 gives NaN probabilities) fails its re-prefill too and would be re-admitted
    # forever, starving everyone else. So the re-admitted sequences are prefilled one
    # per Step, and the culprit, failing alone MAX_STEP_FAILURES times in a row with no
    # token in between, is failed instead of re-admitted.
    for s in readmit:
        if s.seq_id in suspects:
            loop._step_failures[s.seq_id] = loop._step_failures.get(s.seq_id, 0) + 1
    poisoned = [s for s in readmit
                if loop._step_failures.get(s.seq_id, 0) >= MAX_STEP_FAILURES]
    gone = {s.seq_id for s in poisoned}
    readmit = [s for s in readmit if s.seq_id not in gone]
    for s in poisoned:
        loop._fail(s, f"generation failed: the worker failed {MAX_STEP_FAILURES} steps in a "
                      f"row with this request ({exc.code}: {exc.details})")
    loop.waiting.push_front(readmit)
    loop._one_at_a_time = len(readmit)
    try:
        loop._use(await wait_for_worker(loop))
    finally:
        loop._recovering = False
    loop._set_worker_up(True)


async def wait_for_worker(loop: IterationLoop) -> WorkerInfo:
    """Until a worker serves again. Meanwhile a request fails UNAVAILABLE once it has
    waited worker_timeout (counted from the failure for those already running), so
    nothing hangs on a worker that does not come back."""
    down_since = time.monotonic()
    while True:
        try:
            return await loop.worker.wait_ready(1.0)
        except WorkerUnavailable as err:
            loop.hand_off_waiting()
            now = time.monotonic()
            expired = [s for s in loop.waiting
                       if now - max(s.arrival_time, down_since) >= loop.worker_timeout]
            if expired:
                logger.error("%s; failing %d requests that waited %g s", err, len(expired),
                             loop.worker_timeout)
            for s in expired:
                loop.waiting.remove(s)
                loop._fail(s, f"no worker has served for {loop.worker_timeout:g} s "
                              f"({err}); retry later")
            loop.metrics.set_waiting(loop.name, len(loop.waiting))


async def watch_worker(loop: IterationLoop, interval: float = 1.0, misses: int = 2) -> None:
    """Ask the worker for Info every `interval` s while no recovery is running: readiness
    follows a worker that dies or returns between Steps, and each answer renews this
    scheduler's lease on the worker's sequences."""
    missed = 0
    while not loop._stopped:
        await asyncio.sleep(interval)
        if loop._recovering:
            missed = 0
            continue
        try:
            info = await loop.worker.fetch_info(timeout=max(2 * interval, 2.0))
            missed = 0
            loop._set_worker_up(True)
            if info.swap != loop.swapper.facts and not loop.swapper.held:
                # A worker restarted between Steps with other swap space or rates: the
                # choice follows it (with KV swapped out, the next Step fails first and
                # recovery re-reads everything).
                loop.swapper.facts = info.swap
        except grpc.aio.AioRpcError as exc:
            missed += 1
            if missed >= misses and loop.worker_up:
                logger.error("worker %s does not answer (%s: %s)", loop.worker.address,
                             exc.code().name, exc.details())
                loop._set_worker_up(False)
                loop.hand_off_waiting()
