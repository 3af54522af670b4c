"""Admission: the bounded waiting queue, and the policies that choose which waiting
requests join the running batch each iteration."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Protocol

from scheduler_service.sequence import Sequence


class QueueFull(Exception):
    """The waiting queue is at its limit; the request is refused at once."""


def check_room(waiting: int, n: int, max_size: int) -> None:
    """Raise QueueFull unless `n` more requests fit beside `waiting` under `max_size`."""
    if waiting + n > max_size:
        if n == 1 or waiting >= max_size:
            raise QueueFull(f"the waiting queue is full ({max_size} requests); retry later")
        raise QueueFull(f"{n} prompts do not fit the waiting queue ({waiting} of {max_size} "
                        "places taken); send fewer or retry later")


class WaitingQueue:
    """First come, first served, with at most `max_size` requests."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._items: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def check_room(self, n: int = 1) -> None:
        """Raise QueueFull unless `n` more requests fit."""
        check_room(len(self._items), n, self.max_size)

    def push(self, seq: Sequence) -> None:
        self.check_room()
        self._items.append(seq)

    def push_front(self, seqs: list[Sequence]) -> None:
        """Put re-admitted sequences back at the head, in their original order."""
        self._items.extendleft(reversed(seqs))

    def peek(self) -> Sequence | None:
        return self._items[0] if self._items else None

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> bool:
        try:
            self._items.remove(seq)
            return True
        except ValueError:
            return False


@dataclass(frozen=True)
class Budget:
    """Room left in the running batch this iteration."""

    free_slots: int  # max_rolling_batch_size minus running sequences
    free_kv_tokens: int  # KV budget minus what running sequences reserved
    # Prompt tokens one step may prefill. Prefill of a burst of arrivals is spread over
    # steps, so running sequences keep decoding and early arrivals get their first token
    # without waiting for every later prompt (the first admitted prompt always fits).
    prefill_tokens: int = 1 << 62


class AdmissionPolicy(Protocol):
    """Chooses and removes from `waiting` the sequences that start running now."""

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]: ...


class FCFSAdmission:
    """Strict arrival order: stop at the first request that does not fit, so a large
    request is never starved by smaller ones behind it."""

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        admitted: list[Sequence] = []
        slots, tokens = budget.free_slots, budget.free_kv_tokens
        prefill = budget.prefill_tokens
        while slots > 0:
            head = waiting.peek()
            if head is None or head.reserved_tokens > tokens:
                break
            if admitted and head.length > prefill:
                break
            admitted.append(waiting.pop())
            slots -= 1
            tokens -= head.reserved_tokens
            prefill -= head.length
        return admitted

