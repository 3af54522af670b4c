"""Policy `length-aware`: shortest predicted response first, KV reserved by prediction.

(a) Each waiting request gets a predicted output length when the policy first sees it
(length_predictor.py, learned online from the requests it admitted that have since
finished). Admission goes by predicted remaining tokens in buckets, shortest first, aged
one bucket per `aging_steps` Steps waited so a long request is not starved; ties by
arrival. It never preempts to admit.

(b) A request reserves prompt + its predicted length rounded up to a bucket, not prompt +
max_new_tokens, so more requests share the KV budget (S3's idea). When a running
sequence comes within `margin` tokens of its reservation, its reservation grows by
one bucket (capped at max_new_tokens) if the budget has room; where it has none, the
latest arrived of the outgrowing sequences are preempted (recompute, as in ranked.py)
until the earlier ones fit, and wait with their grown reservation. The margin
(`grow_margin`) covers the tokens that Steps in flight may add before a plan sees them.

Two predictors (`length_predictor`): before prefill only the prompt's ids exist, so
admission order and the first reservation come from the scheduler's prompt-id predictor
(length_predictor.py); the worker's probe on the prompt's last hidden state
(worker_service/length_probe.py) answers with the first token, and its prediction then
replaces the prompt-id one for the rest of the sequence's life: its reservation shrinks or
grows to it (growth only where the budget has room; otherwise the outgrow rule above
handles it), and a preempted sequence waits ranked by it. `prompt` ignores the worker's
prediction; `hidden` orders admission by arrival (and aging) and reserves max_new_tokens
until the worker's prediction arrives.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.policies.length_predictor import LengthPredictor, prefix_keys
from scheduler_service.policies.ranked import RankedAdmission
from scheduler_service.sequence import FinishReason, Sequence

GROW_MARGIN = 8  # the least margin, in tokens; more where more Steps fly (grow_margin)


def grow_margin(steps_in_flight: int) -> int:
    """Tokens a reservation keeps beyond what its sequence holds: more than the Steps in
    flight can add before a plan sees their tokens (at most steps_in_flight - 1 planned and
    unanswered, and the one planned now), and at least GROW_MARGIN."""
    if steps_in_flight < 1:
        raise ValueError(f"steps_in_flight must be >= 1, got {steps_in_flight}")
    return max(GROW_MARGIN, steps_in_flight + 1)
_LEARN_FROM = (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)


class LengthAwareAdmission(RankedAdmission):
    # Reservations grow, and outgrown ones preempt, with or without a waiting request;
    # admit also learns from the finished ones.
    watches_running = True

    def __init__(self, predictor: LengthPredictor, aging_steps: int,
                 use_prompt: bool = True, use_hidden: bool = True,
                 margin: int = GROW_MARGIN):
        self.predictor = predictor
        self.margin = margin  # grow_margin(steps_in_flight) of the loop it admits for
        self.aging_steps = aging_steps
        self.use_prompt = use_prompt
        self.use_hidden = use_hidden
        self._tracked: dict[int, Sequence] = {}  # admitted, not yet learned from
        self._grown = 0  # KV tokens reservations grew by in this iteration's preempt
        super().__init__(self._rank, preemptive=False)

    def _predict(self, seq: Sequence) -> None:
        if seq.reserve_new_tokens is not None:
            return
        if not self.use_prompt:
            # No prediction until the worker's (predicted_tokens stays None, so the
            # prediction metrics count only real ones): reserve all it may generate.
            seq.reserve_new_tokens = seq.params.max_new_tokens
            return
        keys = prefix_keys(seq.prompt_ids, self.predictor.cfg.block_tokens)
        seq.predicted_tokens = self.predictor.predict(len(seq.prompt_ids), keys,
                                                      seq.params.max_new_tokens)
        seq.reserve_new_tokens = min(seq.params.max_new_tokens,
                                     self.predictor.bucket(seq.predicted_tokens))

    def _rank(self, seq: Sequence, waiting: WaitingQueue) -> int:
        self._predict(seq)
        predicted = (seq.params.max_new_tokens if seq.predicted_tokens is None
                     else seq.predicted_tokens)
        remaining = max(predicted - seq.generated, 0)
        buckets = -(-remaining // self.predictor.cfg.bucket_tokens)
        return buckets - waiting.waited(seq) // self.aging_steps

    def _learn(self) -> None:
        for sid, seq in list(self._tracked.items()):
            if not seq.finished:
                continue
            del self._tracked[sid]
            if seq.finish_reason in _LEARN_FROM and not seq.length_learned:
                seq.length_learned = True
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
        free = budget.free_kv_tokens
        if self.use_hidden:
            free -= self._take_hidden(running, free)
        outgrown = sorted((s for s in running if self._outgrows(s)),
                          key=lambda s: (s.arrival_time, s.seq_id))
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

    def _take_hidden(self, running: list[Sequence], free: int) -> int:
        """Replace the prompt-id prediction of sequences whose worker prediction came and
        reserve by it (shrink, or grow where `free` has room). Returns the KV tokens the
        reservations grew by (negative: shrank)."""
        change = 0
        for seq in running:
            hidden, limit = seq.hidden_predicted_tokens, seq.reserve_new_tokens
            if hidden is None or limit is None:
                continue
            hidden = max(1, min(hidden, seq.params.max_new_tokens))
            if seq.predicted_tokens == hidden:
                continue  # taken already
            # Never below what it holds and may have in flight before the next plan.
            floor = seq.generated + seq.in_flight + self.margin + 1
            new = min(seq.params.max_new_tokens, self.predictor.bucket(max(hidden, floor)))
            extra = (new - limit) * seq.rows
            if extra > free - change:
                continue  # no room to grow now; it grows bucket by bucket as it runs
            seq.predicted_tokens, seq.reserve_new_tokens = hidden, new
            change += extra
        self._grown += change
        return change

    def _outgrows(self, seq: Sequence) -> bool:
        limit = seq.reserve_new_tokens
        return (limit is not None and limit < seq.params.max_new_tokens
                and seq.generated + seq.in_flight + self.margin >= limit)

    def _extra(self, seq: Sequence) -> int:
        """KV tokens one more bucket adds to its reservation (up to max_new_tokens)."""
        limit = seq.reserve_new_tokens
        grown = min(seq.params.max_new_tokens, limit + self.predictor.cfg.bucket_tokens)
        return (grown - limit) * seq.rows
