"""Admission and preemption by rank: the shared core of the preemptive policies.

A policy gives every sequence a rank (smaller is more urgent). Waiting sequences are
admitted in rank order, ties in arrival order, and admission stops at the first one that
does not fit, as FCFS stops at its head: a large urgent request is never passed by smaller
less urgent ones. When the most urgent waiting sequence does not fit, running sequences
of a strictly worse rank are preempted, least urgent (then latest arrived) first, just
enough to make room for it; if even all of them would not make room, none is preempted.
The loop re-admits a victim later by prefilling its prompt and the tokens it already
produced (recompute), so its output is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from scheduler_service.admission import Budget, WaitingQueue, fitting_prefix
from scheduler_service.chunking import ChunkLimit
from scheduler_service.sequence import Sequence

Rank = Callable[[Sequence, WaitingQueue], float]


class RankedAdmission:
    """An AdmissionPolicy ordered by `rank(seq, waiting)`; `preemptive` turns preemption
    on. Pure: it reads the sequences and the queue's clock and returns its choices."""

    watches_running = False  # it preempts only for a waiting request
    urgent_steps = False  # only `priority` sends urgent Steps

    def __init__(self, rank: Rank, preemptive: bool = True):
        self.rank = rank
        self.preemptive = preemptive

    def _key(self, seq: Sequence, waiting: WaitingQueue) -> tuple[float, float, int]:
        return self.rank(seq, waiting), seq.arrival_time, seq.seq_id

    def order(self, waiting: WaitingQueue) -> list[Sequence]:
        """The waiting sequences, most urgent first."""
        return sorted(waiting, key=lambda s: self._key(s, waiting))

    def candidates(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        """The waiting sequences admission may take now, in its order."""
        return self.order(waiting)

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        key = (lambda s: self._key(s, waiting)) if self.preemptive else None
        admitted = fitting_prefix(self.candidates(waiting, budget), budget, key)
        for seq in admitted:
            waiting.remove(seq)
        return admitted

    def prefill_order(self, started: list[Sequence], admitted: list[Sequence],
                      waiting: WaitingQueue) -> list[Sequence]:
        """A preemptive policy pays prompt chunks in its own order: a request it would
        stop running sequences for also comes before their prompts' chunks (and an
        urgent prompt's later chunks before theirs), so it is not held behind prompts
        begun earlier. A policy that never preempts to admit keeps arrival order."""
        if not self.preemptive:
            return started + admitted
        return sorted(started + admitted, key=lambda s: self._key(s, waiting))

    def chunk_limit(self, order: list[Sequence], waiting: WaitingQueue,
                    background_in_flight: bool) -> ChunkLimit | None:
        return None

    def urgent(self, waiting: WaitingQueue, running: Iterable[Sequence],
               prefilling: Iterable[tuple[Sequence, int]] = ()) -> list[Sequence]:
        return []

    def preempt(self, waiting: WaitingQueue, running: list[Sequence],
                budget: Budget) -> list[Sequence]:
        """Running sequences to stop so that the most urgent waiting one fits now.
        `running` lists those that may be stopped (the loop leaves out any whose last
        token is already in flight)."""
        if not self.preemptive or not len(waiting):
            return []
        head = min(waiting, key=lambda s: self._key(s, waiting))
        need_slots = 1 - budget.free_slots
        need_tokens = head.reserved_tokens - budget.free_kv_tokens
        if need_slots <= 0 and need_tokens <= 0:
            return []
        head_rank = self.rank(head, waiting)
        candidates = sorted((s for s in running if self.rank(s, waiting) > head_rank),
                            key=lambda s: self._key(s, waiting), reverse=True)
        victims: list[Sequence] = []
        for seq in candidates:
            if need_slots <= 0 and need_tokens <= 0:
                break
            victims.append(seq)
            need_slots -= 1
            need_tokens -= seq.reserved_tokens
        if need_slots > 0 or need_tokens > 0:
            return []  # it cannot fit even so: keep everyone running
        return victims
