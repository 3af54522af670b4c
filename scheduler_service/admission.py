"""Admission: the bounded waiting queue, and the policies that choose which waiting
requests join the running batch each iteration."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable, Iterator, Protocol

from scheduler_service.chunking import ChunkLimit, chunk_end
from scheduler_service.sequence import Sequence, Status


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
    """Arrival order, with at most `max_size` requests. It also keeps the clock that aging
    is measured by: the number of Steps sent (`tick`), so a rule in steps holds whatever
    the speed of the machine."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._items: deque[Sequence] = deque()
        self.steps = 0

    def tick(self) -> None:
        """One more Step was sent."""
        self.steps += 1

    def waited(self, seq: Sequence) -> int:
        """Steps `seq` has waited in all, this wait and earlier ones (after preemptions)."""
        now = self.steps - seq.enqueued_step if seq.status is Status.WAITING else 0
        return seq.aged_steps + now

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def check_room(self, n: int = 1) -> None:
        """Raise QueueFull unless `n` more requests fit."""
        check_room(len(self._items), n, self.max_size)

    def push(self, seq: Sequence) -> None:
        self.check_room()
        seq.enqueued_step = self.steps
        self._items.append(seq)

    def push_front(self, seqs: list[Sequence]) -> None:
        """Put re-admitted sequences back at the head, in their original order."""
        for s in seqs:
            s.enqueued_step = self.steps
        self._items.extendleft(reversed(seqs))

    def peek(self) -> Sequence | None:
        return self._items[0] if self._items else None

    def pop(self) -> Sequence:
        return self._leave(self._items.popleft())

    def remove(self, seq: Sequence) -> bool:
        try:
            self._items.remove(seq)
        except ValueError:
            return False
        self._leave(seq)
        return True

    def _leave(self, seq: Sequence) -> Sequence:
        seq.aged_steps += self.steps - seq.enqueued_step
        seq.enqueued_step = self.steps
        return seq


@dataclass(frozen=True)
class Budget:
    """Room left in the running batch this iteration."""

    free_slots: int  # max_rolling_batch_size minus running sequences
    free_kv_tokens: int  # KV budget minus what running sequences reserved
    # Prompt tokens one step may prefill. Prefill of a burst of arrivals is spread over
    # steps, so running sequences keep decoding and early arrivals get their first token
    # without waiting for every later prompt (the first admitted prompt always fits).
    prefill_tokens: int = 1 << 62
    # Prompts may be prefilled in chunks (chunking.py): a request joins while any of
    # prefill_tokens is left, its first chunk taking what its prompt needs of it.
    chunked: bool = False
    # With chunking: running prompts not wholly prefilled yet, in the order of their
    # admission. Their next chunks are paid from prefill_tokens too, before a new
    # request's unless the policy's `prefill_order` puts that request ahead of them.
    started: tuple[Sequence, ...] = ()
    # A Step in flight pays chunks the policy's `chunk_limit` capped (priority's
    # background prompts, policies/urgent_shield.py).
    background_in_flight: bool = False


class AdmissionPolicy(Protocol):
    """Chooses and removes from `waiting` the sequences that start running now; a
    preemptive policy (scheduler_service/policies) also names running sequences to stop
    so that more urgent waiting ones fit. The loop calls `preempt` first, frees the
    victims' room, then calls `admit`."""

    # Whether `preempt` may stop running sequences when nothing waits (a reservation
    # outgrown); if not, the loop skips both calls on an empty queue.
    watches_running: bool
    # Whether `urgent` may name requests; if not, the loop never asks.
    urgent_steps: bool

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]: ...

    def order(self, waiting: WaitingQueue) -> list[Sequence]:
        """The waiting sequences in the order admission would take them, room permitting
        (the swapped-out ones' KV is copied back to the device ahead in this order)."""
        ...

    def preempt(self, waiting: WaitingQueue, running: list[Sequence],
                budget: Budget) -> list[Sequence]: ...

    def prefill_order(self, started: list[Sequence], admitted: list[Sequence],
                      waiting: WaitingQueue) -> list[Sequence]:
        """The order in which the step's prompt chunks are paid from its budget: the
        prompts begun (`started`, oldest first) and those admitted now, which `admit`
        chose against the same order (`fitting_prefix`'s `key`)."""
        ...

    def chunk_limit(self, order: list[Sequence], waiting: WaitingQueue,
                    background_in_flight: bool) -> ChunkLimit | None:
        """A cap on some of `order`'s chunks in this Step (None: none), given whether a
        Step in flight pays capped chunks."""
        ...

    def urgent(self, waiting: WaitingQueue, running: Iterable[Sequence],
               prefilling: Iterable[tuple[Sequence, int]] = ()) -> list[Sequence]:
        """Waiting requests, most urgent first, that should not wait for the next Step
        behind `running` work: the loop prefills those that fit in an urgent Step, which
        the worker runs ahead of the Steps in flight. `prefilling`: the sequences whose
        prompt chunks are in Steps in flight, each with the prompt tokens it had left when
        its chunk went. Does not change `waiting`."""
        ...


class FCFSAdmission:
    """Strict arrival order: stop at the first request that does not fit, so a large
    request is never starved by smaller ones behind it. Never preempts."""

    watches_running = False
    urgent_steps = False

    def preempt(self, waiting: WaitingQueue, running: list[Sequence],
                budget: Budget) -> list[Sequence]:
        return []

    def admit(self, waiting: WaitingQueue, budget: Budget) -> list[Sequence]:
        admitted = fitting_prefix(waiting, budget)
        for _ in admitted:
            waiting.pop()
        return admitted

    def order(self, waiting: WaitingQueue) -> list[Sequence]:
        return list(waiting)

    def prefill_order(self, started: list[Sequence], admitted: list[Sequence],
                      waiting: WaitingQueue) -> list[Sequence]:
        return started + admitted  # arrival order: the prompts begun came first

    def chunk_limit(self, order: list[Sequence], waiting: WaitingQueue,
                    background_in_flight: bool) -> ChunkLimit | None:
        return None

    def urgent(self, waiting: WaitingQueue, running: Iterable[Sequence],
               prefilling: Iterable[tuple[Sequence, int]] = ()) -> list[Sequence]:
        return []  # arrival order: none goes ahead of work already running


def urgent_admissions(candidates: Iterable[Sequence], budget: Budget,
                      releasing: Container[int] = ()) -> list[Sequence]:
    """Of the policy's urgent requests (`AdmissionPolicy.urgent`, in its order), those an
    urgent Step takes: the run of greedy and sampled ones (the worker's rule; a swapped-out
    one comes back through swap_in, in a Step of its own) that fits `budget` without
    preempting anyone. A preempted one whose release is `releasing` (in a Step not yet
    answered, or not yet sent) is left to a regular Step: an urgent one would run before
    that release and find it still on the worker."""
    usable = []
    for s in candidates:
        if s.seq_id in releasing:
            continue
        if s.swapped or not s.params.strategy.interruptible:
            break
        usable.append(s)
    return fitting_prefix(usable, budget)


def fitting_prefix(candidates: Iterable[Sequence], budget: Budget,
                   key: Callable[[Sequence], Any] | None = None) -> list[Sequence]:
    """The longest run of `candidates`, in their order, that fits `budget`: a batch slot
    and its KV reservation each, and prompt tokens within the step's prefill budget (the
    first always; with chunking, each while any budget is left once the chunks paid
    before its own are: those of `budget.started`, all of them without a `key`, else
    those of a smaller key, as `prefill_order` pays them). Stopping at the first that
    does not fit keeps a large request from being passed by smaller ones."""
    admitted: list[Sequence] = []
    slots, tokens = budget.free_slots, budget.free_kv_tokens
    prefill = budget.prefill_tokens
    started = sorted(budget.started, key=key) if key else list(budget.started)
    for seq in candidates:
        while started and prefill > 0 and (key is None or key(started[0]) < key(seq)):
            s = started.pop(0)  # its chunk, as chunking.StepBudget.take will cut it
            prefill -= chunk_end(s.prefilled, s.prefill_target, prefill, True) - s.prefilled
        if slots <= 0 or seq.reserved_tokens > tokens:
            break
        # A swapped-out sequence comes back with its KV: one decoding token, no prompt.
        cost = 1 if seq.swapped else seq.length
        if prefill <= 0 or (admitted and not budget.chunked and cost > prefill):
            break
        admitted.append(seq)
        slots -= 1
        tokens -= seq.reserved_tokens
        prefill -= min(cost, prefill)
    return admitted

