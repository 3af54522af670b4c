"""Urgent Steps on the worker: a new request's prefill that runs ahead of the Steps queued,
between two layers of the forward in progress.

The scheduler sends one for a request more urgent than running work (policy `priority`,
docs/scheduling.md): new greedy or sampled sequences' prefills alone, in groups of their
own. Any thread posts it; the compute thread runs it at the next layer boundary of the
Step it runs (the C step layers and the layer loop stop where the runner's pause flag is
set), else before the next Step begins. Its sequences' groups stay out of the engine's
planned groups until a Step's plan names them: Steps planned before the urgent one leave
its sequences out.

Urgent Steps run in the order they come, but one with fewer prompt tokens than the urgent
Step in progress runs between that one's layers (shortest first, with preemption): of two
urgent prompts that meet, the longer then waits for less than its own prefill. The
scheduler never sends an urgent Step ahead of a more urgent prefill in flight
(`PriorityAdmission.urgent`), so sizes decide only among equally urgent requests; its
measure (each prompt's tokens left) may call a request shorter where this one (the Step's
prompt tokens, a first chunk at most) does not, and the Step then waits its turn.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_service import regroup, step_checks
from worker_service.kv_groups import KVGroup
from worker_service.sequence import SequenceState
from worker_service.step import PrefillSpec, StepResult

if TYPE_CHECKING:
    from worker_service.engine import Engine


def prompt_tokens(prefill: list[PrefillSpec]) -> int:
    """The prompt tokens an urgent Step prefills (before any prefix-cache hit)."""
    return sum(spec.prefill_end or len(spec.token_ids) for spec in prefill)


@dataclass
class _Posted:
    """An urgent Step posted and not yet run."""

    future: Future
    prefill: list[PrefillSpec]
    plan: list[list[int]]
    tokens: int  # prompt_tokens(prefill)


class UrgentSteps:
    """One engine's urgent Steps: those posted and not run, and the groups of those run
    that no plan has named yet."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._posted: deque[_Posted] = deque()
        self._lock = threading.Lock()  # posts come from the reader thread
        self._side: dict[int, KVGroup] = {}  # sequence id -> its group, not yet planned
        self._pause = engine.runner.pause_flag()
        self.nested_seconds = 0.0  # their time inside the current Step (Engine.step)

    def post(self, prefill: list[PrefillSpec], plan: list[list[int]]) -> Future:
        """Queue an urgent Step (any thread). Whoever posts it must also make the compute
        thread call `run`, in case no Step runs to take it. The future holds its result."""
        future: Future = Future()
        with self._lock:
            self._posted.append(_Posted(future, prefill, plan, prompt_tokens(prefill)))
        if self._pause is not None:
            self._pause.value = 1
        return future

    def run(self, between_layers: bool = False, shorter_than: int | None = None) -> None:
        """Run the urgent Steps posted so far (compute thread), `between_layers` of a
        Step's forward or not; with `shorter_than`, only those with fewer prompt tokens
        (the others wait for the caller's loop)."""
        if self._pause is not None:
            self._pause.value = 0  # before looking: a later post sets it again
        while (posted := self._take(shorter_than)) is not None:
            if not posted.future.set_running_or_notify_cancel():
                continue
            try:
                result = self.step(posted.prefill, posted.plan)
                result.between_layers = between_layers
                posted.future.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                posted.future.set_exception(exc)

    def _take(self, shorter_than: int | None) -> _Posted | None:
        with self._lock:
            for i, posted in enumerate(self._posted):
                if shorter_than is None or posted.tokens < shorter_than:
                    del self._posted[i]
                    return posted
        return None

    def _any_shorter(self, tokens: int) -> bool:
        with self._lock:
            return any(posted.tokens < tokens for posted in self._posted)

    def between(self) -> None:
        """Between two layers of a Step's forward: the urgent Steps, timed apart."""
        self.nested_seconds += self._run_between(None)

    def _run_between(self, shorter_than: int | None) -> float:
        """`run` between two layers of a forward; the seconds it took."""
        t = time.perf_counter()
        self.run(between_layers=True, shorter_than=shorter_than)
        return time.perf_counter() - t

    def step(self, prefill: list[PrefillSpec], plan: list[list[int]]) -> StepResult:
        """Prefill new greedy or sampled sequences in groups of their own and choose their
        first tokens, touching nothing else: it may run inside another Step's forward.
        Called inside a forward it leaves inference mode, as a Step runs: its groups'
        buffers are copied into by later Steps' regrouping."""
        with torch.inference_mode(False):
            return self._step(prefill, plan)

    def _step(self, prefill: list[PrefillSpec], plan: list[list[int]]) -> StepResult:
        engine = self.engine
        tokens, nested = prompt_tokens(prefill), [0.0]

        def shorter_between() -> None:  # shorter urgent Steps, between this one's layers
            nested[0] += self._run_between(tokens)
        t0 = time.perf_counter()
        result = StepResult()
        new_ids = step_checks.new_sequences(prefill, engine.sequences, engine.swap or ())
        step_checks.check_plan(plan, {}, new_ids)
        step_checks.check_urgent(prefill)
        engine.create(prefill)
        groups = []
        for members in plan:
            # From the heap, not the arena: making room there may move other groups'
            # buffers, under the forward of the Step this one interrupts.
            group = KVGroup(engine.runner.kv_shape)
            for sid in members:
                group.add_empty_row(sid, regroup.reserve_length(engine, sid))
                engine.group_of[sid] = group
                self._side[sid] = group
            groups.append(group)
        result.regroup_seconds = time.perf_counter() - t0
        if self._pause is not None and self._any_shorter(tokens):
            # Posted while a longer Step ran, which cleared the flag without taking it.
            self._pause.value = 1
        engine.run(groups, [0] * len(groups), result, between=shorter_between)
        engine.report(result, t0)
        result.forward_seconds -= nested[0]
        result.total_seconds -= nested[0]
        return result

    def adopt(self, plan: list[list[int]]) -> Mapping[int, SequenceState]:
        """The groups of urgent Steps' sequences that `plan` names join the planned ones;
        returns the sequences the plan must place (the others wait for a later plan)."""
        engine = self.engine
        if not self._side:
            return engine.sequences
        for sid in [sid for members in plan for sid in members if sid in self._side]:
            group = self._side.get(sid)
            if group is None:
                continue  # its group came in with another of its sequences
            for member in group.seq_ids:
                self._side.pop(member, None)
            # Out of any forward now: its next reallocation may come from the arena.
            group.arena = engine.arena
            engine.groups.append(group)
        if not self._side:
            return engine.sequences
        return {sid: s for sid, s in engine.sequences.items() if sid not in self._side}

    def side_groups(self) -> list[KVGroup]:
        return list({id(g): g for g in self._side.values()}.values())

    def forget(self, seq_id: int) -> None:
        """A sequence released or swapped out: its row leaves the group."""
        self._side.pop(seq_id, None)

    def clear(self) -> None:
        """Every sequence is dropped: so are the urgent Steps not run yet."""
        with self._lock:
            posted, self._posted = self._posted, deque()
        for p in posted:
            p.future.cancel()
        self._side.clear()
