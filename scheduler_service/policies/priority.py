"""Policy `priority`: the most urgent request first, preempting less urgent work.

Priority is vLLM's: an integer, lower is more urgent, default 0, here within
[PRIORITY_MIN, PRIORITY_MAX]. Aging prevents starvation: a sequence's effective priority
is its priority minus one for every `aging_steps` Steps it has spent waiting (counted over
all its waits, also after preemptions, and kept while it runs). Ties go to the earlier
arrival. So a request of priority p waits at most (p - PRIORITY_MIN) * aging_steps Steps
(plus the time for room to free up) before it comes first among later arrivals, however
urgent, and after (p - PRIORITY_MIN + 1) * aging_steps it preempts them too. A running
sequence is preempted only by a strictly more urgent one. With urgent Steps, within a rank
below the default a shorter prompt also goes ahead of a longer one being prefilled
(`PriorityAdmission.urgent`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.chunking import ChunkLimit
from scheduler_service.params import RequestError
from scheduler_service.policies.ranked import RankedAdmission
from scheduler_service.policies.urgent_shield import URGENT_WINDOW_STEPS, UrgentShield
from scheduler_service.sequence import Sequence

PRIORITY_MIN = -100
PRIORITY_MAX = 100
DEFAULT_PRIORITY = 0


def check_priority(value: Any) -> int:
    """A request's priority, or RequestError naming the field and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise RequestError(f"priority must be an integer in [{PRIORITY_MIN}, "
                               f"{PRIORITY_MAX}] (lower is more urgent), got {value!r}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise RequestError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is "
                           f"more urgent, default 0), got {value}")
    return value


def effective_priority(seq: Sequence, waiting: WaitingQueue, aging_steps: int) -> int:
    """The priority after aging: one level more urgent per `aging_steps` Steps waited."""
    return seq.priority - waiting.waited(seq) // aging_steps


class PriorityAdmission(RankedAdmission):
    """`background_chunk_tokens`: the urgent shield's cap on less urgent prompts' chunks
    (urgent_shield.py); 0 turns the shield off (prompts of every priority then share
    Steps, paid in priority order)."""

    def __init__(self, aging_steps: int, background_chunk_tokens: int = 0,
                 window_steps: int = URGENT_WINDOW_STEPS, urgent_steps: bool = False):
        if aging_steps < 1:
            raise ValueError(f"aging_steps must be >= 1, got {aging_steps}")
        if background_chunk_tokens < 0:
            raise ValueError("background_chunk_tokens must be >= 0 (0: no shield), got "
                             f"{background_chunk_tokens}")
        self.aging_steps = aging_steps
        super().__init__(lambda s, w: effective_priority(s, w, aging_steps))
        self.shield = (UrgentShield(self.rank, background_chunk_tokens, aging_steps,
                                    window_steps) if background_chunk_tokens else None)
        self.urgent_steps = urgent_steps

    def urgent(self, waiting: WaitingQueue, running: Iterable[Sequence],
               prefilling: Iterable[tuple[Sequence, int]] = ()) -> list[Sequence]:
        """With `urgent_steps`: the waiting requests, most urgent first, that go ahead of
        the Steps in flight: those more urgent (after aging) than some running sequence,
        and those of an urgent class (rank below the default priority) with a shorter
        prompt than an equally urgent prompt being prefilled. `prefilling`: the sequences
        whose prompt chunks are in Steps in flight, each with the prompt tokens it had left
        when its chunk went. A request never goes ahead of the prefill of a more urgent
        one, nor of an equally urgent one as short or shorter (shortest first within a
        rank: of two prompts that meet, the longer then waits less than its own prefill);
        the worker keeps a like rule among urgent Steps (urgent_steps.py)."""
        if not self.urgent_steps or not len(waiting):
            return []
        if self.shield is not None:
            self.shield.see(waiting)  # its rules hold for the Steps around this one
        least = max((self.rank(s, waiting) for s in running), default=None)
        if least is None:
            return []
        chunks = [(self.rank(s, waiting), left) for s, left in prefilling]
        most = min((r for r, _ in chunks), default=None)
        taken = []
        for seq in self.order(waiting):
            rank, tokens = self.rank(seq, waiting), seq.length
            if most is not None and most < rank:
                break  # it, and every one after it, would delay a more urgent prefill
            ahead = [left for r, left in chunks if r == rank]
            if any(left <= tokens for left in ahead):
                continue  # it would delay a shorter one of its rank; a shorter one may go
            if rank < least or (rank < DEFAULT_PRIORITY and ahead):
                taken.append(seq)
        return taken

    def candidates(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        order = self.order(waiting)
        if self.shield is None or not budget.chunked:
            return order
        self.shield.see(waiting)
        return self.shield.admissible(order, budget.started, waiting,
                                      budget.background_in_flight)

    def chunk_limit(self, order: list[Sequence], waiting: WaitingQueue,
                    background_in_flight: bool) -> ChunkLimit | None:
        if self.shield is None:
            return None
        return self.shield.limit(order, waiting, background_in_flight)
