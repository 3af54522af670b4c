"""Preemption by recompute against preemption by swap, through the real processes.

`python -m bench.preemption_ab MODEL [--modes recompute,swap,prefetch]` starts one
deployment per mode (option.scheduling_policy=priority, a small batch limit, the worker
with swap space; `prefetch` is swap with option.swap_prefetch=2, the victims about to run
again copied back ahead of their turn), fills the batch with long low-priority requests and then sends urgent ones at a
fixed gap, each of which preempts a running request. It reports per mode the wall time
until everything ended, the low and urgent requests' TTFT and E2E, the preemptions (and
how many swapped, and of the swap-ins how many found their KV prefetched), and the prompt
tokens the worker prefilled (recompute prefills each victim's prompt and output again);
and it checks that every greedy output is the same in
every mode.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.deployment import Deployment
from bench.metrics import scrape
from client import AsyncClient

logger = logging.getLogger("seqserve.bench")


async def _one(c: AsyncClient, prompt: list[int], new: int, priority: int, t0: float) -> dict:
    ids, first = [], None
    async for chunk in c.stream(prompt, max_new_tokens=new, ignore_eos=True, priority=priority):
        if chunk.token_id is not None:
            if first is None:
                first = time.perf_counter() - t0
            ids.append(chunk.token_id)
    return {"ids": ids, "ttft": first, "e2e": time.perf_counter() - t0}


async def _load(address: str, a, vocab: int) -> tuple[float, list[dict], list[dict]]:
    rng = random.Random(a.seed)
    lows = [[rng.randrange(10, vocab) for _ in range(a.low_prompt)] for _ in range(a.low)]
    urgents = [[rng.randrange(10, vocab) for _ in range(a.urgent_prompt)]
               for _ in range(a.urgent)]
    async with AsyncClient(address) as c:
        t0 = time.perf_counter()
        low_tasks = [asyncio.create_task(_one(c, p, a.low_new, 5, time.perf_counter()))
                     for p in lows]
        await asyncio.sleep(a.first_urgent_s)
        urgent_tasks = []
        for p in urgents:
            urgent_tasks.append(asyncio.create_task(_one(c, p, a.urgent_new, -5,
                                                         time.perf_counter())))
            await asyncio.sleep(a.gap_s)
        low = await asyncio.gather(*low_tasks)
        urgent = await asyncio.gather(*urgent_tasks)
        return time.perf_counter() - t0, low, urgent


def _ms(values) -> str:
    return f"{1e3 * statistics.mean(values):.0f} / {1e3 * max(values):.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.preemption_ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--modes", default="recompute,swap")
    p.add_argument("--slots", type=int, default=4, help="max_rolling_batch_size (4)")
    p.add_argument("--low", type=int, default=4)
    p.add_argument("--low-prompt", type=int, default=400)
    p.add_argument("--low-new", type=int, default=160)
    p.add_argument("--urgent", type=int, default=12)
    p.add_argument("--urgent-prompt", type=int, default=24)
    p.add_argument("--urgent-new", type=int, default=8)
    p.add_argument("--first-urgent-s", type=float, default=1.0)
    p.add_argument("--gap-s", type=float, default=0.4)
    p.add_argument("--swap-space-bytes", type=int, default=1 << 30)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    rows, outputs = [], {}
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as work:
            d = Deployment(a.model, Path(work),
                           {"dtype": a.dtype, "scheduling_policy": "priority",
                            "max_rolling_batch_size": a.slots,
                            "preemption_mode": "swap" if mode == "prefetch" else mode,
                            "swap_prefetch": 2 if mode == "prefetch" else -1},
                           {"swap_space_bytes": a.swap_space_bytes}).start()
            try:
                wall, low, urgent = asyncio.run(_load(d.address, a, vocab))
                m = scrape(d.metrics_url)
                w = scrape(d.worker_metrics_url)
            finally:
                d.stop()
        prefilled = m.get("seqserve_step_prefill_tokens_sum", 0)
        outputs[mode] = [r["ids"] for r in low + urgent]
        rows.append((mode, wall, _ms([r["ttft"] for r in urgent]), _ms([r["e2e"] for r in urgent]),
                     _ms([r["e2e"] for r in low]), m.get("seqserve_num_preemptions_total", 0),
                     m.get("seqserve_num_swapped_preemptions_total", 0),
                     w.get("seqserve_worker_prefetched_swap_ins_total", 0), prefilled))
    print(f"{a.model.name}: {a.low} low requests ({a.low_prompt}-token prompts, {a.low_new} "
          f"new) in {a.slots} slots, {a.urgent} urgent ({a.urgent_prompt}+{a.urgent_new}) "
          f"every {a.gap_s} s from {a.first_urgent_s} s")
    print("| mode | wall s | urgent TTFT ms mean / max | urgent E2E ms mean / max | "
          "low E2E ms mean / max | preemptions | swapped | prefetched swap-ins | "
          "prompt tokens prefilled |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, wall, ut, ue, le, pre, sw, hit, pf in rows:
        print(f"| {mode} | {wall:.2f} | {ut} | {ue} | {le} | {pre:g} | {sw:g} | {hit:g} | "
              f"{pf:g} |")
    first = next(iter(outputs.values()))
    same = all(o == first for o in outputs.values())
    print(f"greedy outputs identical across modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
