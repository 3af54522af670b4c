"""Policy `priority`: keep short the Steps an urgent prompt waits for and the Step that
prefills it.

Below the batch limit nothing waits, so admission order cannot help an urgent request;
its first token is late because of the Steps around it: those already in flight when it
arrives (the loop pipelines `steps_in_flight` of them, planned without it) and its own,
when other prompts' chunks share its budget. So, with chunked prefill, the prompts of a
priority less urgent than the most urgent one seen waiting in the last `window_steps`
Steps are *background*, and their chunks obey three rules:

1. A Step that pays an urgent prompt's chunk pays no background chunk and admits no
   background request (the decoding rows stay: they cost the Step little).
2. While a Step that pays background chunks is in flight, the next one pays none and
   admits no background request: at most one long Step is ever ahead of an urgent arrival.
3. One Step's background chunks take at most `background_chunk_tokens` prompt tokens
   together, so that one Step is short. A request admitted in that Step gets at least one
   token even when the others took the rest: the worker prefills a new sequence's whole
   prompt unless a chunk says otherwise.

Where every request has one priority nothing is background and nothing changes. Aging
bounds the wait: a waiting request's rank is aged (a background one becomes urgent after
enough Steps), and a prompt begun `aging_steps` Steps ago or more is no longer held back.
Pure: it reads the sequences and the waiting queue's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from scheduler_service.admission import WaitingQueue
from scheduler_service.chunking import ChunkLimit
from scheduler_service.sequence import Sequence, Status

# How long an urgent arrival makes lower priorities background: long enough to span the
# gaps between a sparse urgent class's arrivals (at 20 Steps/s, about 50 s).
URGENT_WINDOW_STEPS = 1024


class UrgentShield:
    def __init__(self, rank: Callable[[Sequence, WaitingQueue], float],
                 background_chunk_tokens: int, aging_steps: int,
                 window_steps: int = URGENT_WINDOW_STEPS):
        if background_chunk_tokens < 1:
            raise ValueError("background_chunk_tokens must be >= 1, got "
                             f"{background_chunk_tokens}")
        self.rank = rank
        self.background_chunk_tokens = background_chunk_tokens
        self.aging_steps = aging_steps
        self.window_steps = window_steps
        self._seen: dict[int, int] = {}  # priority -> the queue's clock when last seen waiting

    def see(self, waiting: WaitingQueue) -> None:
        """Note the priorities waiting now (every request waits before it runs)."""
        for s in waiting:
            self._seen[s.priority] = waiting.steps

    def level(self, now: int) -> int | None:
        """The most urgent priority seen waiting within the window, if any."""
        recent = [p for p, t in self._seen.items() if now - t < self.window_steps]
        return min(recent) if recent else None

    def _background(self, seq: Sequence, waiting: WaitingQueue, level: int | None) -> bool:
        """Whether `seq` is background under `level` (the `level` of this Step)."""
        if level is None or self.rank(seq, waiting) <= level:
            return False
        begun = seq.status is Status.RUNNING and seq.prefilled > 0
        return not (begun and waiting.steps - seq.admitted_step >= self.aging_steps)

    def admissible(self, order: list[Sequence], started: Iterable[Sequence],
                   waiting: WaitingQueue, background_in_flight: bool) -> list[Sequence]:
        """`order` (waiting requests, most urgent first) cut before its first background
        request when this Step pays no background chunk (rules 1 and 2): such a request
        would be admitted without a chunk."""
        level = self.level(waiting.steps)
        flags = [self._background(s, waiting, level) for s in order]
        hold = (background_in_flight or not all(flags)
                or any(not self._background(s, waiting, level) for s in started))
        return order[:flags.index(True)] if hold and any(flags) else order

    def limit(self, order: list[Sequence], waiting: WaitingQueue,
              background_in_flight: bool) -> ChunkLimit | None:
        """The cap on the background chunks among `order` (the Step's prompts to pay): 0
        when a Step in flight pays background chunks or an urgent prompt is in `order`."""
        level = self.level(waiting.steps)
        background = frozenset(s.seq_id for s in order if self._background(s, waiting, level))
        if not background:
            return None
        hold = background_in_flight or len(background) < len(order)
        return ChunkLimit(background, 0 if hold else self.background_chunk_tokens)
