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


class AdmissionPolicy(Protocol):
    """Chooses and removes from `waiting` the sequences that start running now."""

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]: ...


class FCFSAdmission:
    """Strict arrival order: stop at the first request that does not fit, so a large
    request is never starved by smaller ones behind it."""

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        admitted: list[Sequence] = []
        slots, tokens = budget.free_slots, budget.free_kv_tokens
        while slots > 0:
            head = waiting.peek()
            if head is None or head.reserved_tokens > tokens:
                break
            admitted.append(waiting.pop())
            slots -= 1
            tokens -= head.reserved_tokens
        return admitted


POLICIES = {"fcfs": FCFSAdmission}
