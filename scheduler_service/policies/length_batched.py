"""Policy `length-batched`: the paper's sequence scheduling for offline batch jobs (Zheng et
al. 2023, "Response Length Perception and Sequence Scheduling", arXiv 2305.13144, Sec. 4):
batches of similar predicted length, Variable Batch Size (VBS) and Failure Collection and
Recomputation (FCR), on a continuously batching server.

Buckets. Each request's predicted output length (its `length_hint` when the client gave
one, else the shared LengthPredictor) is rounded up to a bucket of `bucket_tokens`; that
is its group's limit (the paper's `buckit`, 50-token cells). Waiting requests are admitted
group by group, smallest limit first, arrival order within a group, into the rolling batch:
a group's requests join as the previous group's finish, so the running batch holds at most
the tail of one group beside the head of the next, and the max-sparsity partition pads
sequences of similar length together. There is no aging: this is for a server given a
batch job; an online mix belongs under `length-aware`, which ages.

VBS (Sec. 4, "Variable Batch Size"; the released code's `len_bs_dict` halves the batch as
the limit grows by 50 tokens). The paper sizes a batch so its tokens fit the memory: batch
size x length about constant, so short groups run in larger batches. Here every admitted
request reserves prompt + its group's limit (+ the margin) of the worker's KV token budget
(not prompt + max_new_tokens, what FCFS reserves), so a group of limit L runs about
budget / (prompt + L + margin) requests at once, within max_rolling_batch_size:
`vbs_batch_size`.

FCR (Sec. 4, "Failure Collection and Recomputation"). A sequence that has its group's limit
of tokens without having ended is stopped there by preemption by recompute (its KV
reservation holds `margin` more tokens, for those Steps already in flight add past the
limit, length_aware.grow_margin; they are dropped), then collected, and waits behind every request that has not
failed, with its reservation grown to max_new_tokens; the failures then run as a group of
their own. The paper regenerates a failure from the start; here its re-admission prefills
the prompt and the tokens it already produced (preemption.py), which keeps the output
token-identical and saves the tokens already paid for.
"""

from __future__ import annotations

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.policies.length_aware import GROW_MARGIN, LengthAwareAdmission
from scheduler_service.policies.length_predictor import LengthPredictor
from scheduler_service.sequence import Sequence

FAILED_RANK = 1 << 40  # after every group: the collected failures run last


def vbs_batch_size(reserve: int, prompt_tokens: int, kv_tokens: int, max_batch: int) -> int:
    """Requests of one group (each reserving `reserve` new tokens: the group's limit and
    margin; prompts of `prompt_tokens`) that fit a KV budget of `kv_tokens` at once,
    within `max_batch` slots (at least one)."""
    return max(1, min(max_batch, kv_tokens // max(1, prompt_tokens + reserve)))


class LengthBatchedAdmission(LengthAwareAdmission):
    def __init__(self, predictor: LengthPredictor, margin: int = GROW_MARGIN):
        super().__init__(predictor, aging_steps=1 << 62, margin=margin)
        self.failures = 0  # FCR stops by this policy (Sequence.fcr_failed marks each once)

    def _limit(self, seq: Sequence) -> int:
        """Its group's limit: the predicted length rounded up to a bucket."""
        return min(seq.params.max_new_tokens, self.predictor.bucket(seq.predicted_tokens))

    def _predict(self, seq: Sequence) -> None:
        if seq.predicted_tokens is not None:
            return
        if seq.length_hint is not None:
            seq.predicted_tokens = max(1, min(seq.length_hint, seq.params.max_new_tokens))
        else:
            super()._predict(seq)
        # The limit, and the tokens Steps in flight may add past it before FCR stops it.
        seq.reserve_new_tokens = min(seq.params.max_new_tokens,
                                     self._limit(seq) + self.margin)

    def _rank(self, seq: Sequence, waiting: WaitingQueue) -> int:
        self._predict(seq)
        if seq.fcr_failed:
            return FAILED_RANK
        return self.predictor.bucket(seq.predicted_tokens) // self.predictor.cfg.bucket_tokens

    def preempt(self, waiting: WaitingQueue, running: list[Sequence],
                budget: Budget) -> list[Sequence]:
        """FCR: stop every running sequence at its group's limit; it waits, collected
        behind the groups still to run, reserving up to max_new_tokens."""
        victims = [s for s in running if self._outgrows(s)]
        for seq in victims:
            grown = seq.params.max_new_tokens - seq.reserve_new_tokens
            self._grown += grown * seq.rows  # the loop hands back the old reservation only
            seq.reserve_new_tokens = seq.params.max_new_tokens
            seq.fcr_failed = True  # once, on any worker: it now reserves max_new_tokens
            self.failures += 1
        return victims

    def _outgrows(self, seq: Sequence) -> bool:
        """It has its group's limit of tokens and none ended it (the loop offers only
        sequences that may go on): a failure. Tokens of it already in flight past the
        limit are dropped and drawn again at its recompute."""
        limit = self._limit(seq)
        return (not seq.fcr_failed and limit < seq.params.max_new_tokens
                and seq.generated >= limit)
