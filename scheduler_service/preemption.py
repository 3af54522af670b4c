"""Preemption by recompute: taking the policy's victims out of the running batch.

The worker drops a victim's KV (the loop releases it in the next Step) and the victim
waits again. Its re-admission prefills its prompt plus the tokens it produced, as after a
worker failure, with its sampling seed unchanged: greedy and seeded sampling draw the same
tokens again (the worker seeds token i by (seed, i)), so the output is unchanged. A token
of it already in flight is dropped by the loop (it came from a Step before the victim's
new `admitted_step`) and drawn again. Recompute is the only mechanism on CPU, where host
memory is the KV's home anyway; swapping KV to host memory is for accelerators
(docs/scheduling.md).
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.admission import AdmissionPolicy, Budget, WaitingQueue
from scheduler_service.sequence import Sequence, Status


def take_off_worker(seqs: list[Sequence]) -> None:
    """Running sequences the worker no longer holds (preempted, or the worker failed)
    wait again: nothing of theirs is in flight any more, and a beam search starts again
    (deterministic, it streamed nothing yet)."""
    for s in seqs:
        s.in_flight, s.released, s.beam_steps, s.status = 0, False, 0, Status.WAITING


def preempt(policy: AdmissionPolicy, waiting: WaitingQueue, running: dict[int, Sequence],
            budget: Budget) -> tuple[list[Sequence], Budget]:
    """Remove the victims the policy names from `running` (seq id -> sequence) and return
    them, with the budget grown by their room. The caller releases them from the worker
    and queues them again after this iteration's admission, so that a victim is not
    prefilled in the Step that releases it."""
    # Those whose last token is in flight finish by themselves.
    candidates = [s for s in running.values() if s.advancing]
    victims = policy.preempt(waiting, candidates, budget)
    take_off_worker(victims)
    for s in victims:
        del running[s.seq_id]
        s.preemptions += 1
    if victims:
        budget = replace(budget, free_slots=budget.free_slots + len(victims),
                         free_kv_tokens=budget.free_kv_tokens
                         + sum(s.reserved_tokens for s in victims))
    return victims, budget
