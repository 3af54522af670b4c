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
and keeps account of the worker's swap space (docs/scheduling.md). It also chooses which
swapped-out sequences the worker copies back to the device ahead of their re-admission
(FastServe's proactive swapping, option.swap_prefetch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from scheduler_service.admission import AdmissionPolicy, Budget, WaitingQueue
from scheduler_service.sequence import Sequence, Status
from seqserve_common.decoding import DecodingStrategy

PREEMPTION_MODES = ("auto", "swap", "recompute")

# option.swap_prefetch = -1: swapped-out sequences kept on the device ahead of their turn
# where the worker has an accelerator (its copies then overlap the Steps); none on CPU,
# where the "device" is host memory and a copy ahead would only be a second copy.
AUTO_PREFETCH = 2
# How far ahead prefetching looks: a running sequence this many Steps or fewer from its
# max_new_tokens frees its slot soon, and the waiting sequence that would take it has its
# KV copied back now, beside the Steps until then (an EOS may free a slot sooner).
PREFETCH_LOOKAHEAD_STEPS = 4


def prefetch_limit(option: int, device: str) -> int:
    """The number of swapped-out sequences to prefetch for option.swap_prefetch (-1: auto)
    on a worker whose Info names `device`."""
    if option >= 0:
        return option
    return 0 if device.split(":")[0] == "cpu" else AUTO_PREFETCH


def slots_soon(running: Iterable[Sequence], max_batch: int) -> int:
    """Batch slots free now or within PREFETCH_LOOKAHEAD_STEPS Steps, counting the running
    sequences' tokens in flight and one more for the Step being planned."""
    running = list(running)
    ending = sum(s.params.max_new_tokens - s.generated - s.in_flight - 1
                 <= PREFETCH_LOOKAHEAD_STEPS for s in running)
    return max(0, max_batch - len(running)) + ending


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

    def __init__(self, mode: str, facts: SwapFacts, prefetch_limit: int = 0):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode {mode!r}: choose one of {PREEMPTION_MODES}")
        self.mode = mode
        self.facts = facts
        self.prefetch_limit = prefetch_limit  # swapped-out sequences copied back ahead
        self.held: dict[int, int] = {}  # seq id -> bytes of the swap space
        self.out: dict[int, Sequence] = {}
        self.pending: list[int] = []
        # Swapped-out sequences with a device copy of their KV (as of the Steps sent and
        # the next): seq id -> KV tokens it takes there. Admission may take their room
        # (they are not in its budget); each plan then frees the copies that no longer
        # fit what the running batch leaves.
        self.prefetched: dict[int, int] = {}
        self.pending_prefetch: list[int] = []
        self.pending_unprefetch: list[int] = []

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

    def plan_prefetch(self, head: Iterable[Sequence], free_tokens: int,
                      exclude: Iterable[int] = ()) -> None:
        """Keep on the device the KV of the swapped-out sequences among `head` (the waiting
        ones admission would take next as slots free up soon, in its order), at most
        `prefetch_limit`, while they fit `free_tokens` together (the KV budget left after this
        Step's admissions, less a reserve for arrivals), stopping at the first that does
        not, as admission does; not those of `exclude` (swapped out by the Step being
        planned). The worker starts the new ones' copies with that Step and frees those
        no longer chosen first."""
        want: dict[int, int] = {}
        exclude = set(exclude)
        if self.prefetch_limit > 0 and self.out:
            for seq in head:
                if seq.seq_id not in self.out or seq.seq_id in exclude:
                    continue
                tokens = self.kv_tokens(seq)
                if tokens > free_tokens:
                    break
                want[seq.seq_id] = tokens
                free_tokens -= tokens
                if len(want) == self.prefetch_limit:
                    break
        for sid in [sid for sid in self.prefetched if sid not in want]:
            del self.prefetched[sid]
            self.pending_unprefetch.append(sid)
        for sid, tokens in want.items():
            if sid not in self.prefetched:
                self.prefetched[sid] = tokens
                self.pending_prefetch.append(sid)

    def prefetches(self, order: Callable[[], list[Sequence]], running: Iterable[Sequence],
                   max_batch: int, free_tokens: int, exclude: Iterable[int]
                   ) -> tuple[list[int], list[int]]:
        """The next Step's (prefetch, unprefetch): plan_prefetch over the waiting sequences
        admission would take as slots free up soon (`order()`: the policy's order of the
        waiting ones, asked only where something may be copied), within `free_tokens` (the
        KV budget less a reserve for arrivals) less the running sequences' reservations."""
        if not (self.prefetch_limit and self.out) and not self.prefetched:
            return [], []
        running = list(running)
        free = free_tokens - sum(s.reserved_tokens for s in running)
        self.plan_prefetch(order()[:slots_soon(running, max_batch)], free, exclude)
        return self.take_prefetches()

    def take_prefetches(self) -> tuple[list[int], list[int]]:
        """The next Step's (prefetch, unprefetch)."""
        taken = self.pending_prefetch, self.pending_unprefetch
        self.pending_prefetch, self.pending_unprefetch = [], []
        return taken

    def back(self, seq: Sequence) -> None:
        """Swapped in again: it runs on with its tokens in flight (from its device copy,
        where it was prefetched)."""
        seq.swapped = False
        self.out.pop(seq.seq_id, None)
        self.held.pop(seq.seq_id, None)
        self._unlist(seq.seq_id)

    def drop(self, seq: Sequence) -> None:
        """No longer swapped out on this worker: it ended, moves to another worker, or the
        worker lost its KV. Its tokens in flight will not count (the caller releases it
        from the worker where that still holds it, which frees any device copy too)."""
        self.back(seq)
        seq.in_flight = 0
        if seq.seq_id in self.pending:
            self.pending.remove(seq.seq_id)

    def _unlist(self, seq_id: int) -> None:
        """Forget `seq_id`'s device copy: the worker uses it up (swap_in) or frees it with
        the sequence (release), so no unprefetch goes out for it either."""
        self.prefetched.pop(seq_id, None)
        for pending in (self.pending_prefetch, self.pending_unprefetch):
            if seq_id in pending:
                pending.remove(seq_id)

    def forget(self) -> None:
        """The worker failed: every swapped-out sequence is prefilled again."""
        for seq in list(self.out.values()):
            self.drop(seq)
        self.prefetched.clear()
        self.pending_prefetch.clear()
        self.pending_unprefetch.clear()


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
