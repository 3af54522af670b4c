"""`python -m bench partition`: how long the scheduler's plan_partition takes for 512 random
lengths, with and without a sparsity limit."""

from __future__ import annotations

import platform
import random
import timeit
from pathlib import Path

from bench.env import machine_cores
from bench.report import partition_markdown, write
from bench.stats import percentile


def run(args) -> dict:
    from scheduler_service.partition import plan_partition

    rng = random.Random(args.seed)
    lengths = [rng.randint(1, 2048) for _ in range(512)]
    result = {"benchmark": "partition", "n": 512, "length_range": [1, 2048], "max_splits": 8,
              "seed": args.seed, "repeats": args.repeats, "runs": []}
    for s in (0.33, 0.0):
        part = plan_partition(lengths, max_sparsity=s, max_splits=8)
        timer = timeit.Timer(lambda s=s: plan_partition(lengths, max_sparsity=s, max_splits=8))
        number, total = timer.autorange()
        number = max(1, round(number * 0.02 / total))  # about 20 ms a repeat
        times = [t / number for t in timer.repeat(repeat=args.repeats, number=number)]
        result["runs"].append({"max_sparsity": s, "median_ms": 1000 * percentile(times, 50),
                               "min_ms": 1000 * min(times), "calls_per_repeat": number,
                               "splits": part.num_splits, "sparsity": part.sparsity})
    md = partition_markdown(result)
    result["env"] = {"python": platform.python_version(), "cores": machine_cores()}
    write(Path(args.out), "partition", result, md)
    print(md, flush=True)
    return result
