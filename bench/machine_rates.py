"""This machine's rates for the floor (bench/floor.py): bfloat16 GEMM FLOP/s at a model's own
linear shapes and row counts, and memory bandwidth.

GEMM: for each (K, N) of the model and each M of a grid (decode batches up to prefill
chunks), a [M, K] x [K, N] bfloat16 product, timed each way this machine has, the fastest
counting: `F.linear`, oneDNN's prepacked product, and the C product over pair-packed weights
on CPUs with AVX512-BF16 (what seqserve's worker runs on CPU: the last where it runs, else
oneDNN's).
Each is the fastest of `repeats` timed loops of at least `min_time_s`: a peak, the least
disturbed loop. The weight stays in cache between calls (up to the L3's size), so this is
the arithmetic side; the floor adds the weights' streaming from memory at the measured
bandwidth.

Bandwidth: the fastest of `repeats` passes over a `size_mib` buffer, two ways, the faster
counting: a copy (bytes read + written) and a float32 sum (bytes read); it moves with the
host's load, so `bench peers` and `bench matrix` also probe it around each system's run
(bench/bandwidth_probe.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from bench import bandwidth_probe
from bench.env import machine_cores
from bench.floor import MachineRates, ModelShape

logger = logging.getLogger("seqserve.bench")

M_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
QUICK_M_GRID = (1, 8, 64, 512)


def _best_loop(fn: Callable[[], object], min_time_s: float, repeats: int) -> float:
    """Seconds per call of `fn`: the fastest of `repeats` loops, each of as many calls as fit
    in `min_time_s` (at least one). The clock is read after every call, so a loop ends on
    time even where calls slow down midway (threads descheduled on a busy machine)."""
    fn()  # warm-up (a first call may reorder or allocate)
    best = float("inf")
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s:
                break
        best = min(best, elapsed / calls)
    return best


def gemm_candidates(x, w) -> dict[str, Callable[[], object]]:
    """The bfloat16 product paths here: F.linear, oneDNN's prepacked linear where it runs,
    and the worker's C product (kernels/dpbf16_linear.py) where it runs."""
    import torch
    import torch.nn.functional as F

    out = {"F.linear": lambda: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["onednn_prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:
        logger.debug("no prepacked oneDNN product here: %s", exc)
    from worker_service.kernels import dpbf16_linear

    if dpbf16_linear.takes(w):
        pair_packed = dpbf16_linear.pack(w)
        out["c_dpbf16"] = lambda: dpbf16_linear.linear(x, pair_packed, None, w.shape[0])
    return out


def measure_gemm(k: int, n: int, ms: Sequence[int], *, min_time_s: float = 0.05,
                 repeats: int = 3, seed: int = 0) -> tuple[list[tuple[int, float]], dict]:
    """[(M, FLOP/s)] of a bfloat16 [M, k] x [k, n] product, and which path won at each M."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    points, paths = [], {}
    with torch.inference_mode():
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            times = {name: _best_loop(fn, min_time_s, repeats)
                     for name, fn in gemm_candidates(x, w).items()}
            name = min(times, key=times.get)
            points.append((m, 2 * m * k * n / times[name]))
            paths[str(m)] = {p: 2 * m * k * n / t / 1e9 for p, t in times.items()}
    return points, {"gflops_by_path": paths}


def measure_bandwidth(size_mib: int = 256, repeats: int = 5) -> dict:
    """Bytes/s of a copy (read + write) and of a float32 sum (read) over `size_mib` MiB
    (bench/bandwidth_probe.py)."""
    return bandwidth_probe.probe(size_mib, repeats)


class Threads:
    """torch intra-op threads for a block (all cores unless told), restored after."""

    def __init__(self, n: int | None = None):
        self.n = n or machine_cores()

    def __enter__(self) -> Threads:
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.before)


def measure_model(shape: ModelShape, *, ms: Sequence[int] = M_GRID,
                  bandwidth: dict | None = None, known: MachineRates | None = None,
                  threads: int | None = None, min_time_s: float = 0.05) -> MachineRates:
    """The rates the floor of `shape` needs: its GEMMs at every M of `ms` (shapes already
    in `known` are not measured again) and the bandwidth (measured unless given)."""
    gemm = dict(known.gemm) if known else {}
    detail = dict(known.detail) if known else {}
    with Threads(threads) as th:
        bw = bandwidth or measure_bandwidth()
        for g in shape.gemms():
            if g.key in gemm:
                continue
            t0 = time.perf_counter()
            gemm[g.key], info = measure_gemm(g.k, g.n, ms, min_time_s=min_time_s)
            detail[g.key] = {"name": g.name, **info}
            logger.info("bf16 GEMM %s [M, %d] x [%d, %d]: %s GFLOP/s at M = %s (%.1f s)",
                        g.name, g.k, g.k, g.n,
                        ", ".join(f"{r / 1e9:.0f}" for _, r in gemm[g.key]),
                        ", ".join(str(m) for m, _ in gemm[g.key]), time.perf_counter() - t0)
        detail["threads"] = th.n
        detail["memory"] = bw
    return MachineRates(gemm, bw["bandwidth"], detail)
