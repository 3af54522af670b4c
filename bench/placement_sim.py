"""What prefix-affinity placement buys on the Mooncake conversation trace: the scheduler's
own placement (WorkerPool._place, scheduler_service/worker_pool.py) replayed over the
trace's block hash ids, with and without affinity, no processes and no model.

    python -m bench.placement_sim --workers 2,4,8

The trace gives each request its 512-token blocks as hash ids (equal ids: equal block and
equal prefix). Each worker's prefix cache is a set of those blocks (unbounded, or LRU of
--cache-blocks); a request's hits are its leading blocks the cache of the worker it was
placed on holds (whole blocks only). The pool remembers, per worker, the chained hashes
of the first MAX_PREFIX_BLOCKS x BLOCK_TOKENS = 1024 prompt tokens it sent there, i.e. two
trace blocks; --remember-blocks changes that to see what a deeper memory would buy.

Load, which decides which workers are within PLACEMENT_SLACK of the least loaded: a request
reserves prompt + output tokens of its worker's --kv-tokens from its arrival until it ends,
after prompt / --prefill-tps + output x --tpot-ms (a model of a busy accelerator, not a
measurement). "Without affinity" is the same rule with every prefix match counted as 0:
the least loaded worker.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from scheduler_service import worker_pool
from scheduler_service.worker_pool import Member, WorkerPool

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK = 512


@dataclass
class Row:
    t: float
    prompt: int
    output: int
    hash_ids: list[int]


class SimLoop:
    """What placement reads of a worker's loop: its reserved KV and budget."""

    def __init__(self, kv_budget: int):
        self.kv_budget, self.reserved, self.worker_up = kv_budget, 0, True

    def reserved_tokens(self) -> int:
        return self.reserved


class BlindMember(Member):
    """A worker whose prefix match never counts: placement by load alone."""

    def prefix_hit(self, hashes: list[int]) -> int:
        return 0


class Cache:
    """A worker's prefix cache of trace blocks; capacity 0: unbounded."""

    def __init__(self, capacity: int):
        self.capacity, self.blocks = capacity, OrderedDict()

    def hit_blocks(self, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and ids[n] in self.blocks:
            n += 1
        return n

    def add(self, ids: list[int]) -> None:
        for h in ids:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while self.capacity and len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def load(path: Path, limit: int | None) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append(Row(r["timestamp"] / 1000, r["input_length"], r["output_length"],
                                r["hash_ids"]))
            if limit and len(rows) == limit:
                break
    return rows


@contextlib.contextmanager
def pool_memory(blocks: int):
    """The pool's prefix memory in trace blocks: one 'token' per block, `blocks` remembered."""
    saved = worker_pool.BLOCK_TOKENS, worker_pool.MAX_PREFIX_BLOCKS
    worker_pool.BLOCK_TOKENS, worker_pool.MAX_PREFIX_BLOCKS = 1, blocks
    try:
        yield
    finally:
        worker_pool.BLOCK_TOKENS, worker_pool.MAX_PREFIX_BLOCKS = saved


def simulate(rows: list[Row], workers: int, affinity: bool, args) -> dict:
    pool = WorkerPool([], make_client=None, make_loop=None, max_queue=1 << 30)
    kind = Member if affinity else BlindMember
    for i in range(workers):
        m = kind(SimpleNamespace(address=f"w{i}"))
        m.loop = SimLoop(args.kv_tokens)
        pool.members.append(m)
    caches = {m.address: Cache(args.cache_blocks) for m in pool.members}
    ends: list[tuple[float, int, Member, int]] = []
    hit = total = 0
    per_worker = {m.address: 0 for m in pool.members}
    with pool_memory(args.remember_blocks):
        for i, r in enumerate(rows):
            while ends and ends[0][0] <= r.t:
                _, _, m, tokens = heapq.heappop(ends)
                m.loop.reserved -= tokens
            full = [h for k, h in enumerate(r.hash_ids) if (k + 1) * TRACE_BLOCK <= r.prompt]
            m = pool._place(SimpleNamespace(prompt_ids=full), exclude=None)
            per_worker[m.address] += 1
            cache = caches[m.address]
            hit += cache.hit_blocks(full) * TRACE_BLOCK
            total += r.prompt
            cache.add(full)
            tokens = r.prompt + r.output
            m.loop.reserved += tokens
            done = r.t + r.prompt / args.prefill_tps + r.output * args.tpot_ms / 1000
            heapq.heappush(ends, (done, i, m, tokens))
    counts = sorted(per_worker.values())
    return {"workers": workers, "affinity": affinity, "hit_rate": hit / total,
            "requests_min_max": [counts[0], counts[-1]]}


def ideal(rows: list[Row]) -> float:
    """One unbounded cache that saw every request: all the trace's reuse."""
    cache, hit, total = Cache(0), 0, 0
    for r in rows:
        full = [h for k, h in enumerate(r.hash_ids) if (k + 1) * TRACE_BLOCK <= r.prompt]
        hit += cache.hit_blocks(full) * TRACE_BLOCK
        total += r.prompt
        cache.add(full)
    return hit / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.placement_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=None, help="first N rows (all)")
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--kv-tokens", type=int, default=500_000, help="KV budget per worker")
    p.add_argument("--prefill-tps", type=float, default=10_000.0, help="prompt tokens/s")
    p.add_argument("--tpot-ms", type=float, default=30.0, help="ms per output token")
    p.add_argument("--cache-blocks", type=int, default=0,
                   help="prefix cache per worker in trace blocks, LRU (0: unbounded)")
    p.add_argument("--remember-blocks", type=int,
                   default=worker_pool.MAX_PREFIX_BLOCKS * worker_pool.BLOCK_TOKENS // TRACE_BLOCK,
                   help="trace blocks the pool remembers per placement (the pool's: 2)")
    args = p.parse_args(argv)
    rows = load(args.trace, args.requests)
    print(f"{len(rows)} requests; one cache seeing all: {ideal(rows):.1%} of prompt tokens")
    print("| workers | hit rate, least loaded | hit rate, affinity | requests per worker "
          "(min-max), affinity |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.workers.split(",")):
        blind, aff = simulate(rows, n, False, args), simulate(rows, n, True, args)
        lo, hi = aff["requests_min_max"]
        print(f"| {n} | {blind['hit_rate']:.1%} | {aff['hit_rate']:.1%} | {lo}-{hi} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
