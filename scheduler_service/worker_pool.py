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
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable

from scheduler_service.admission import check_room
from scheduler_service.loop import IterationLoop
from scheduler_service.sequence import Sequence
from scheduler_service.worker_client import WorkerClient, WorkerInfo

logger = logging.getLogger(__name__)
PLACEMENT_SLACK = 0.05  # of a worker's KV budget
BLOCK_TOKENS = 16  # the worker's prefix-cache block (option.prompt_cache_block_tokens default)
MAX_PREFIX_BLOCKS = 64  # leading blocks of a prompt remembered per placement
MAX_REMEMBERED = 50_000  # block hashes remembered per worker (least recently placed out)


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
        self._sent: OrderedDict[int, None] = OrderedDict()

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def serving(self) -> bool:
        return self.loop is not None and self.loop.worker_up

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

    def __init__(self, clients: list[WorkerClient],
                 make_loop: Callable[[WorkerClient], IterationLoop], max_queue: int):
        self.members = [Member(c) for c in clients]
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
            m.tasks.append(asyncio.create_task(self._join(m)))
        await self._first_ready.wait()
        return next(m.loop.info for m in self.members if m.loop is not None)

    async def _join(self, m: Member) -> None:
        info = await m.client.wait_ready(None)
        loop = self._make_loop(m.client)
        loop.on_orphans = lambda seqs, source=m: self._adopt(source, seqs)
        loop.on_worker_state = lambda up: self.on_ready_change(self.ready)
        loop.metrics.set_worker_up(loop.name, True)
        m.loop = loop
        m.tasks += [asyncio.create_task(loop.run()), asyncio.create_task(loop.watch_worker())]
        logger.info("worker %s joined (%s, %d KV tokens)", m.address, info.model_id,
                    info.kv_capacity_tokens)
        self._first_ready.set()
        self.on_ready_change(self.ready)

    def stop(self) -> None:
        for m in self.members:
            if m.loop is not None:
                m.loop.stop()
            for t in m.tasks:
                t.cancel()

    # --- what the front end asks -------------------------------------------------------

    @property
    def loops(self) -> list[IterationLoop]:
        return [m.loop for m in self.members if m.loop is not None]

    @property
    def ready(self) -> bool:
        return any(m.serving for m in self.members)

    @property
    def kv_budget(self) -> int:
        """The largest request any worker could hold."""
        return max((loop.kv_budget for loop in self.loops), default=0)

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

    def submit(self, seq: Sequence) -> None:
        self.check_room(1)
        m = self._place(seq, exclude=None)
        seq.worker = m.address
        m.loop.submit(seq)
        m.loop.metrics.placed.labels(m.address).inc()

    def cancel(self, seq: Sequence) -> None:
        for m in self.members:
            if m.address == seq.worker and m.loop is not None:
                m.loop.cancel(seq)
                return

    # --- placement -------------------------------------------------------------------

    def _place(self, seq: Sequence, exclude: Member | None) -> Member:
        joined = [m for m in self.members if m.loop is not None and m is not exclude]
        live = [m for m in joined if m.serving] or joined
        hashes = prefix_hashes(seq.prompt_ids)
        load = {m.address: m.load() for m in live}  # each sums that worker's requests once
        least = min(load.values())
        near = [m for m in live if load[m.address] <= least + PLACEMENT_SLACK]
        best = max(near, key=lambda m: (m.prefix_hit(hashes), -load[m.address]))
        best.remember(hashes)
        return best

    def _adopt(self, source: Member, seqs: list[Sequence]) -> bool:
        """Move the requests of an unreachable worker to serving ones, in order."""
        if not any(m.serving for m in self.members if m is not source):
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
        logger.warning("worker %s is unreachable: moved %d requests to %s", source.address,
                       len(seqs), ", ".join(f"{a} ({len(b)})" for a, b in moved.items()))
        return True
