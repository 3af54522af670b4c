"""The workers one scheduler drives, data parallel: every worker holds a full replica and
runs its own iteration loop (its running set, its max-sparsity partition, its Steps, all
concurrent), and the pool places each request on one of them.

Placement: among the workers that serve and are not draining, those whose reserved KV
share (running and waiting requests) is within PLACEMENT_SLACK of the least loaded are
candidates; the one that was sent the longest prefix of this prompt before wins (its
prefix cache probably holds those blocks), then the least loaded.

A worker that becomes unreachable hands its requests (waiting, and running ones with the
tokens already sent) to the others, which prefill prompt plus those tokens: no token is
lost, repeated or changed. Its loop keeps retrying it in the background and it takes new
requests again once it answers. A worker that was not up at start joins the same way.

The pool changes while it serves (admin_api.py): `register` adds a worker that answers,
`drain` stops placing on one, moves its waiting requests to the others, lets its running
sequences finish where they are, and then removes it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from typing import Callable

import grpc

from scheduler_service.admission import check_room
from scheduler_service.loop import IterationLoop
from scheduler_service.recovery import watch_worker
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import WorkerClient, WorkerInfo

logger = logging.getLogger(__name__)
PLACEMENT_SLACK = 0.05  # of a worker's KV budget
BLOCK_TOKENS = 16  # the worker's prefix-cache block (option.prompt_cache_block_tokens default)
MAX_PREFIX_BLOCKS = 64  # leading blocks of a prompt remembered per placement
MAX_REMEMBERED = 50_000  # block hashes remembered per worker (least recently placed out)
REGISTER_TIMEOUT = 5.0  # s a worker being registered has to answer Info
DRAIN_POLL = 0.05  # s between a draining worker's checks for its last sequence


class State(enum.Enum):
    JOINING = "joining"  # not yet answered
    SERVING = "serving"
    UNREACHABLE = "unreachable"  # answered once, not now; its requests moved
    DRAINING = "draining"  # takes no new requests; leaves once its sequences finish
    LEFT = "left"  # drained and removed


class PoolChangeRefused(Exception):
    """A register or drain the pool cannot do; `code` is the gRPC status name to answer."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def prefix_hashes(prompt: list[int]) -> list[int]:
    """Chained hashes of the prompt's whole leading blocks (as the worker's cache keys)."""
    out, h = [], 0
    for i in range(min(len(prompt) // BLOCK_TOKENS, MAX_PREFIX_BLOCKS)):
        h = hash((h, tuple(prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])))
        out.append(h)
    return out


class Member:
    """One worker of the pool: its client and, once it has answered, its loop."""

    def __init__(self, client: WorkerClient):
        self.client = client
        self.loop: IterationLoop | None = None
        self.tasks: list[asyncio.Task] = []
        self.draining = False
        self.left = False
        self._sent: OrderedDict[int, None] = OrderedDict()

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def serving(self) -> bool:
        return self.loop is not None and self.loop.worker_up

    @property
    def state(self) -> State:
        if self.left:
            return State.LEFT
        if self.draining:
            return State.DRAINING
        if self.loop is None:
            return State.JOINING
        return State.SERVING if self.loop.worker_up else State.UNREACHABLE

    @property
    def placeable(self) -> bool:
        """Whether new requests may go to it (it may still be unreachable)."""
        return self.loop is not None and not self.draining

    def load(self) -> float:
        loop = self.loop
        return loop.reserved_tokens() / loop.kv_budget if loop.kv_budget else 1.0

    def prefix_hit(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self._sent:
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self._sent[h] = None
            self._sent.move_to_end(h)
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)


class WorkerPool:
    """What the front end calls instead of one loop: submit, cancel, readiness, limits."""

    def __init__(self, addresses: list[str], make_client: Callable[[str], WorkerClient],
                 make_loop: Callable[[WorkerClient], IterationLoop], max_queue: int):
        self._make_client = make_client
        self.members = [Member(make_client(a)) for a in addresses]
        self._make_loop = make_loop
        self.max_queue = max_queue
        self._next_id = 1
        self._stopped = False
        self._first_ready = asyncio.Event()
        self.on_ready_change: Callable[[bool], None] = lambda ready: None

    # --- start and stop ----------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        """Connect to every worker in the background; return the first one's Info."""
        for m in self.members:
            if not m.tasks:  # one registered before start is joining already
                m.tasks.append(asyncio.create_task(self._join(m)))
        await self._first_ready.wait()
        return next(m.loop.info for m in self.members if m.loop is not None)

    async def _join(self, m: Member) -> None:
        info = await m.client.wait_ready(None)
        loop = self._make_loop(m.client)
        loop.on_orphans = lambda seqs, source=m: self._move(source, seqs, "is unreachable")
        loop.on_worker_state = lambda up: self.on_ready_change(self.ready)
        loop.metrics.set_worker_up(loop.name, True)
        m.loop = loop
        m.tasks += [asyncio.create_task(loop.run()), asyncio.create_task(watch_worker(loop))]
        logger.info("worker %s joined (%s, %d KV tokens)", m.address, info.model_id,
                    info.kv_capacity_tokens)
        self._first_ready.set()
        self.on_ready_change(self.ready)

    def stop(self) -> None:
        self._stopped = True
        for m in self.members:
            if m.loop is not None:
                m.loop.stop()
            for t in m.tasks:
                t.cancel()

    async def close(self) -> None:
        """Close every worker channel (after stop)."""
        await asyncio.gather(*(m.client.close() for m in self.members))

    # --- changes while serving (admin_api.py) ------------------------------------------

    def member(self, address: str) -> Member | None:
        return next((m for m in self.members if m.address == address), None)

    async def register(self, address: str) -> Member:
        """Add the worker at `address` once it answers Info; raises PoolChangeRefused for a
        duplicate, a worker that does not answer, or one with another vocabulary."""
        self._check_new(address)
        client = self._make_client(address)
        try:
            info = await client.fetch_info(timeout=REGISTER_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            await client.close()
            hint = ("it refuses this scheduler's control-plane token: give both the same "
                    "option.control_token" if exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    else "start it (or wait for its readiness) and register it again")
            raise PoolChangeRefused("UNAVAILABLE", f"worker {address} did not answer Info "
                                    f"within {REGISTER_TIMEOUT:g} s ({exc.code().name}: "
                                    f"{exc.details()}); {hint}") from None
        problem = self._mismatch(info)
        if problem is None:
            try:
                self._check_new(address)  # another call may have added it meanwhile
            except PoolChangeRefused:
                await client.close()
                raise
        else:
            await client.close()
            raise PoolChangeRefused("FAILED_PRECONDITION", f"worker {address} {problem}")
        m = Member(client)
        self.members.append(m)
        join = asyncio.create_task(self._join(m))
        m.tasks.append(join)
        await asyncio.shield(join)  # a caller that gives up does not undo the join
        logger.warning("worker %s registered at runtime: %d workers in the pool", address,
                       len(self.members))
        return m

    def _check_new(self, address: str) -> None:
        if self._stopped:
            raise PoolChangeRefused("UNAVAILABLE", "the scheduler is shutting down")
        if not address or ":" not in address:
            raise PoolChangeRefused("INVALID_ARGUMENT", f"worker address {address!r} is not "
                                    "host:port")
        old = self.member(address)
        if old is not None:
            raise PoolChangeRefused("ALREADY_EXISTS", f"worker {address} is already in the pool "
                                    f"({old.state.value}); drain it before registering it again")

    def _mismatch(self, info: WorkerInfo) -> str | None:
        """Why requests validated against the pool's model could not run on `info`'s."""
        ref = next((m.loop.info for m in self.members if m.loop is not None), None)
        if ref is None:
            return None
        for field in ("vocab_size", "eos_token_ids", "max_position_embeddings"):
            if getattr(info, field) != getattr(ref, field):
                return (f"serves {info.model_id} with {field}={getattr(info, field)}, the pool "
                        f"{ref.model_id} with {getattr(ref, field)}: give it the same model")
        if info.model_id != ref.model_id:
            logger.warning("worker model %s differs from the pool's %s (same vocabulary)",
                           info.model_id, ref.model_id)
        return None

    def drain(self, address: str) -> Member:
        """Place nothing more on `address`; it leaves once its running sequences finish."""
        m = self.member(address)
        if m is None:
            raise PoolChangeRefused("NOT_FOUND", f"worker {address} is not in the pool "
                                    f"({', '.join(x.address for x in self.members)})")
        if m.draining:
            return m
        if not any(o.placeable for o in self.members if o is not m):
            raise PoolChangeRefused("FAILED_PRECONDITION", f"worker {address} is the only one "
                                    "that takes requests: register another first")
        m.draining = True
        if m.loop is not None:
            m.loop.admitting = False
        logger.warning("draining worker %s: its %d running sequences finish there, its %d "
                       "waiting requests move to the others", address,
                       len(m.loop.running) if m.loop else 0, len(m.loop.waiting) if m.loop else 0)
        m.tasks.append(asyncio.create_task(self._finish_drain(m)))
        self.on_ready_change(self.ready)
        return m

    async def _finish_drain(self, m: Member) -> None:
        loop = m.loop
        while loop is not None:
            # Also re-admissions after a failed Step.
            loop.hand_off_waiting(lambda seqs: self._move(m, seqs, "is draining"))
            if loop.idle() and not loop.to_release:
                break
            await asyncio.sleep(DRAIN_POLL)
        self.members.remove(m)
        m.left = True
        if loop is not None:
            loop.stop()
            loop.metrics.remove_worker(loop.name)
        for t in m.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        await m.client.close()
        logger.warning("worker %s drained and left the pool: %d workers remain", m.address,
                       len(self.members))

    # --- what the front end asks -------------------------------------------------------

    @property
    def loops(self) -> list[IterationLoop]:
        return [m.loop for m in self.members if m.loop is not None]

    @property
    def ready(self) -> bool:
        return any(m.serving and not m.draining for m in self.members)

    @property
    def kv_budget(self) -> int:
        """The largest request any worker could hold."""
        return max((m.loop.kv_budget for m in self.members if m.placeable), default=0)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.loops[0].eos_ids

    def waiting(self) -> int:
        return sum(len(loop.waiting) for loop in self.loops)

    def running(self) -> int:
        return sum(len(loop.running) for loop in self.loops)

    def idle(self) -> bool:
        return all(loop.idle() for loop in self.loops)

    def new_seq_id(self) -> int:
        """Unique across workers, so a request moved to another worker keeps its id."""
        sid, self._next_id = self._next_id, self._next_id + 1
        return sid

    def check_room(self, n: int) -> None:
        """Raise QueueFull unless `n` more requests fit the waiting queues together."""
        check_room(self.waiting(), n, self.max_queue)

    async def submit_all(self, seqs: list[Sequence]) -> None:
        """Queue every sequence or none (raises QueueFull)."""
        self.check_room(len(seqs))
        for seq in seqs:
            self.submit(seq)

    def submit(self, seq: Sequence) -> None:
        self.check_room(1)
        m = self._place(seq, exclude=None)
        seq.worker = m.address
        m.loop.submit(seq)
        m.loop.metrics.placed.labels(m.address).inc()

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        for m in self.members:
            if m.address == seq.worker and m.loop is not None:
                m.loop.cancel(seq, reason)
                return

    # --- placement -------------------------------------------------------------------

    def _place(self, seq: Sequence, exclude: Member | None) -> Member:
        # Never empty once a worker joined: drain keeps one placeable worker.
        joined = [m for m in self.members if m.placeable and m is not exclude]
        live = [m for m in joined if m.serving] or joined
        hashes = prefix_hashes(seq.prompt_ids)
        load = {m.address: m.load() for m in live}  # each sums that worker's requests once
        least = min(load.values())
        near = [m for m in live if load[m.address] <= least + PLACEMENT_SLACK]
        best = max(near, key=lambda m: (m.prefix_hit(hashes), -load[m.address]))
        best.remember(hashes)
        return best

    def _move(self, source: Member, seqs: list[Sequence], why: str) -> bool:
        """Place `source`'s requests on serving workers, in order; False when none serves
        (the caller keeps them)."""
        if not any(m.serving for m in self.members if m is not source and m.placeable):
            return False
        moved: dict[str, list[Sequence]] = {}
        targets = {}
        for seq in seqs:
            m = self._place(seq, exclude=source)
            seq.worker = m.address
            moved.setdefault(m.address, []).append(seq)
            targets[m.address] = m
            m.loop.metrics.placed.labels(m.address).inc()
        for address, batch in moved.items():
            targets[address].loop.adopt(batch)
        logger.warning("worker %s %s: moved %d requests to %s", source.address, why,
                       len(seqs), ", ".join(f"{a} ({len(b)})" for a, b in moved.items()))
        return True
