"""Admission policies: which waiting requests join the running batch this iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler_service.sequence import Sequence
from scheduler_service.waiting_queue import WaitingQueue


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

