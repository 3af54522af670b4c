"""Memory bandwidth, probed with torch and the standard library only, so that the vLLM
peer's script (bench/peers/vllm_peer.py, which runs under vLLM's own Python and loads this
file by its path) probes it exactly as the harness does.

The floor (bench/floor.py) charges a run's weight and KV bytes at this rate. On a shared
host the rate moves with the neighbours' load: on this project's 2-core guests the same
probe read 46.7 GB/s in one run and 89.6 GB/s in another minutes later, and a plain read
loop 55 and 98 GB/s a minute apart (docs/benchmarks.md, session 45). So a run's floor takes
the probes taken just before and just after that run (bench/commands/peers.py).
"""

from __future__ import annotations

import os
import time
from typing import Callable


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def probe(size_mib: int = 256, repeats: int = 5, threads: int | None = None) -> dict:
    """Bytes/s of a copy (bytes read + written) and of a float32 sum (bytes read) over
    `size_mib` MiB, each the fastest of `repeats` passes after one to warm up, on `threads`
    torch threads (0: every core the process may run on; None: torch's current count);
    `bandwidth` is the faster of the two."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(before if threads is None else threads or _cores())
    try:
        n = size_mib * 2**20 // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)

        def best(fn) -> float:
            fn()  # first touch of dst's pages
            fastest = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                fastest = min(fastest, time.perf_counter() - t0)
            return fastest

        copy_s = best(lambda: dst.copy_(src))
        sum_s = best(lambda: src.sum())
    finally:
        torch.set_num_threads(before)
    nbytes = n * 4
    out = {"size_mib": size_mib, "copy_bytes_per_s": 2 * nbytes / copy_s,
           "read_bytes_per_s": nbytes / sum_s}
    out["bandwidth"] = max(out["copy_bytes_per_s"], out["read_bytes_per_s"])
    return out


def bandwidth_now() -> float:
    """The memory's bandwidth now, bytes/s, on every core."""
    return probe(threads=0)["bandwidth"]


def probed(fn: Callable[[], dict], measure: Callable[[], float] | None) -> dict:
    """`fn()`'s result (a run's summary) with the bandwidth `measure` gives (bytes/s) just
    before and just after it, in `bandwidth_probes`, unless the run was skipped; `fn()`
    alone where `measure` is None."""
    if measure is None:
        return fn()
    before = measure()
    result = fn()
    if "skipped" not in result:
        result["bandwidth_probes"] = [before, measure()]
    return result
