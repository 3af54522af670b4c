"""Policy `length-aware`: shortest predicted response first, KV reserved by prediction.

(a) Each waiting request gets a predicted output length when the policy first sees it
(length_predictor.py, learned online from the requests it admitted that have since
finished). Admission goes by predicted remaining tokens in buckets, shortest first, aged
one bucket per `aging_steps` Steps waited so a long request is not starved; ties by
arrival. It never preempts to admit.

(b) A request reserves prompt + its predicted length rounded up to a bucket, not prompt +
max_new_tokens, so more requests share the KV budget (S3's idea). When a running
sequence comes within `GROW_MARGIN` tokens of its reservation, its reservation grows by
one bucket (capped at max_new_tokens) if the budget has room; where it has none, the
latest arrived of the outgrowing sequences are preempted (recompute, as in ranked.py)
until the earlier ones fit, and wait with their grown reservation. The margin covers the
tokens that may be in flight (steps_in_flight) before the next plan.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.policies.length_predictor import LengthPredictor, prefix_keys
from scheduler_service.policies.ranked import RankedAdmission
from scheduler_service.sequence import FinishReason, Sequence

GROW_MARGIN = 8
_LEARN_FROM = (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)


class LengthAwareAdmission(RankedAdmission):
    def __init__(self, predictor: LengthPredictor, aging_steps: int):
        self.predictor = predictor
        self.aging_steps = aging_steps
        self._tracked: dict[int, Sequence] = {}  # admitted, not yet learned from
        self._grown = 0  # KV tokens reservations grew by in this iteration's preempt
        super().__init__(self._rank, preemptive=False)

    def _predict(self, seq: Sequence) -> None:
        if seq.predicted_tokens is not None:
            return
        keys = prefix_keys(seq.prompt_ids, self.predictor.cfg.block_tokens)
        seq.predicted_tokens = self.predictor.predict(len(seq.prompt_ids), keys,
                                                      seq.params.max_new_tokens)
        seq.reserve_new_tokens = min(seq.params.max_new_tokens,
                                     self.predictor.bucket(seq.predicted_tokens))

    def _rank(self, seq: Sequence, waiting: WaitingQueue) -> int:
        self._predict(seq)
        remaining = max(seq.predicted_tokens - seq.generated, 0)
        buckets = -(-remaining // self.predictor.cfg.bucket_tokens)
        return buckets - waiting.waited(seq) // self.aging_steps

    def _learn(self) -> None:
        for sid, seq in list(self._tracked.items()):
            if not seq.finished:
                continue
            del self._tracked[sid]
            if seq.finish_reason in _LEARN_FROM:
                keys = prefix_keys(seq.prompt_ids, self.predictor.cfg.block_tokens)
                self.predictor.learn(len(seq.prompt_ids), keys, seq.generated)

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        self._learn()
        for seq in waiting:
            self._predict(seq)
        budget = replace(budget, free_kv_tokens=budget.free_kv_tokens - self._grown)
        self._grown = 0
        admitted = super().admit(waiting, budget)
        for seq in admitted:
            self._tracked[seq.seq_id] = seq
        return admitted

    def preempt(self, waiting: WaitingQueue, running: list[Sequence],
                budget: Budget) -> list[Sequence]:
        """Grow the reservations of sequences about to outgrow them, earliest arrival
        first; where the budget has no room, preempt the latest arrived of them, whose
        reservations then make room for the earlier ones. A victim waits with its grown
        reservation. (Called by the loop every iteration before `admit`.)"""
        outgrown = sorted((s for s in running if self._outgrows(s)),
                          key=lambda s: (s.arrival_time, s.seq_id))
        free = budget.free_kv_tokens
        kept: list[Sequence] = []
        victims: list[Sequence] = []
        while outgrown:
            seq = outgrown.pop(0)
            extra = self._extra(seq)
            while extra > free and outgrown:
                victim = outgrown.pop()  # the latest arrived
                victims.append(victim)
                free += victim.reserved_tokens
            if extra > free:
                victims.append(seq)
            else:
                free -= extra
                kept.append(seq)
        for seq in kept + victims:
            extra = self._extra(seq)
            # The loop counted the old reservations; admit takes the growth off its budget
            # (for a victim too: the loop hands back its grown reservation).
            self._grown += extra
            seq.reserve_new_tokens += extra // seq.rows
        return victims

    def _outgrows(self, seq: Sequence) -> bool:
        limit = seq.reserve_new_tokens
        return (limit is not None and limit < seq.params.max_new_tokens
                and seq.generated + seq.in_flight + GROW_MARGIN >= limit)

    def _extra(self, seq: Sequence) -> int:
        """KV tokens one more bucket adds to its reservation (up to max_new_tokens)."""
        limit = seq.reserve_new_tokens
        grown = min(seq.params.max_new_tokens, limit + self.predictor.cfg.bucket_tokens)
        return (grown - limit) * seq.rows
