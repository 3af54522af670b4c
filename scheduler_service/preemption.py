"""Preemption: taking the policy's victims out of the running batch, by recompute or swap.

Recompute: the worker drops a victim's KV (the loop releases it in the next Step) and the
victim waits again. Its re-admission prefills its prompt plus the tokens it produced, as
after a worker failure, with its sampling seed unchanged: greedy and seeded sampling draw
the same tokens again (the worker seeds token i by (seed, i)), so the output is unchanged.
A token of it already in flight is dropped by the loop (it came from a Step before the
victim's new `admitted_step`) and drawn again.

Swap: the worker copies the victim's KV to host memory and keeps its state
(StepRequest.swap_out); its re-admission copies it back (swap_in) and it decodes on, so
nothing is drawn again and a token in flight when it was stopped still counts. `Swapper`
chooses per victim by option.preemption_mode and the costs the worker measured at start,
and keeps account of the worker's swap space (docs/scheduling.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler_service.admission import AdmissionPolicy, Budget, WaitingQueue
from scheduler_service.sequence import Sequence, Status
from seqserve_common.decoding import DecodingStrategy

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class SwapFacts:
    """A worker's swap space and the rates it measured at start (InfoResponse); zeros:
    it does not swap."""

    kv_bytes_per_token: int = 0
    capacity_bytes: int = 0
    copy_bytes_per_second: float = 0.0  # device to host and back, each way counted once
    prefill_tokens_per_second: float = 0.0

    def swap_seconds(self, tokens: int) -> float:
        """Copying `tokens` tokens' KV out and back in."""
        return 2 * tokens * self.kv_bytes_per_token / self.copy_bytes_per_second

    def recompute_seconds(self, tokens: int) -> float:
        """Prefilling `tokens` tokens again."""
        return tokens / self.prefill_tokens_per_second


class Swapper:
    """Which victims are swapped rather than recomputed; the swapped-out ones (waiting,
    their tokens in flight still count), the worker's swap space they hold, and the
    swap-outs that go with the next Step."""

    def __init__(self, mode: str, facts: SwapFacts):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode {mode!r}: choose one of {PREEMPTION_MODES}")
        self.mode = mode
        self.facts = facts
        self.held: dict[int, int] = {}  # seq id -> bytes of the swap space
        self.out: dict[int, Sequence] = {}
        self.pending: list[int] = []

    @staticmethod
    def kv_tokens(seq: Sequence) -> int:
        """KV tokens the worker holds for `seq` once its Steps in flight have run: every
        token it has but the last, which is the next forward's input."""
        return seq.length - 1

    def swappable(self, seq: Sequence) -> bool:
        """The worker can swap a greedy or sampled sequence whose prompt is wholly sent."""
        return (seq.params.strategy in (DecodingStrategy.GREEDY, DecodingStrategy.SAMPLE)
                and seq.rows == 1 and not seq.prefilling)

    def choose(self, seq: Sequence) -> bool:
        """Whether to swap `seq` (then its room is taken) rather than recompute it."""
        f = self.facts
        if self.mode == "recompute" or not f.capacity_bytes or not self.swappable(seq):
            return False
        tokens = self.kv_tokens(seq)
        nbytes = tokens * f.kv_bytes_per_token
        if sum(self.held.values()) + nbytes > f.capacity_bytes:
            return False
        if self.mode == "auto":
            if f.copy_bytes_per_second <= 0 or f.prefill_tokens_per_second <= 0:
                return False  # nothing measured to weigh
            if f.swap_seconds(tokens) >= f.recompute_seconds(tokens):
                return False
        self.held[seq.seq_id] = nbytes
        return True

    def stop(self, seq: Sequence) -> bool:
        """Swap the victim `seq` out if chosen (it then waits with `swapped` set and goes
        out with the next Step); returns whether it is."""
        if not self.choose(seq):
            return False
        seq.swapped, seq.status = True, Status.WAITING
        self.out[seq.seq_id] = seq
        self.pending.append(seq.seq_id)
        return True

    def take_pending(self) -> list[int]:
        pending, self.pending = self.pending, []
        return pending

    def back(self, seq: Sequence) -> None:
        """Swapped in again: it runs on with its tokens in flight."""
        seq.swapped = False
        self.out.pop(seq.seq_id, None)
        self.held.pop(seq.seq_id, None)

    def drop(self, seq: Sequence) -> None:
        """No longer swapped out on this worker: it ended, moves to another worker, or the
        worker lost its KV. Its tokens in flight will not count (the caller releases it
        from the worker where that still holds it)."""
        self.back(seq)
        seq.in_flight = 0
        if seq.seq_id in self.pending:
            self.pending.remove(seq.seq_id)

    def forget(self) -> None:
        """The worker failed: every swapped-out sequence is prefilled again."""
        for seq in list(self.out.values()):
            self.drop(seq)


def take_off_worker(seqs: list[Sequence]) -> None:
    """Running sequences the worker no longer holds (preempted, or the worker failed)
    wait again: nothing of theirs is in flight any more, and a beam search starts again
    (deterministic, it streamed nothing yet)."""
    for s in seqs:
        s.in_flight, s.released, s.beam_steps, s.status = 0, False, 0, Status.WAITING


def preempt(policy: AdmissionPolicy, waiting: WaitingQueue, running: dict[int, Sequence],
            budget: Budget, swapper: Swapper | None = None) -> tuple[list[Sequence], Budget]:
    """Remove the victims the policy names from `running` (seq id -> sequence) and return
    them, with the budget grown by their room; those `swapper` chooses are marked
    `swapped` (their tokens in flight still count), the others are off the worker. The
    caller releases or swaps them out on the worker and queues them again after this
    iteration's admission, so that a victim does not come back in the Step that stops it."""
    # Those whose last token is in flight finish by themselves.
    candidates = [s for s in running.values() if s.advancing]
    victims = policy.preempt(waiting, candidates, budget)
    for s in victims:
        del running[s.seq_id]
        s.preemptions += 1
        if swapper is None or not swapper.stop(s):
            take_off_worker([s])
    if victims:
        budget = replace(budget, free_slots=budget.free_slots + len(victims),
                         free_kv_tokens=budget.free_kv_tokens
                         + sum(s.reserved_tokens for s in victims))
    return victims, budget
