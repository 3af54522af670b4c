"""The per-step cost of a tensor-parallel group's control plane (worker_service/tp_engine.py):
rank 0 broadcasts each engine call, pickled, over gloo to the other ranks.

    python -m bench.tp_control [--ranks 2] [--steps 2000]

Times `ControlChannel.send` on rank 0 for the two kinds of Step the scheduler sends most: a
decoding step of 64 running sequences in 3 groups (nothing but the plan), and a step that
admits 64 new sequences of 128 prompt tokens each (the largest messages). Each receiving
rank runs nothing but the receive, so this is the channel's own cost, which every Step pays
once, beside a forward of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from seqserve_common.decoding import DecodingStrategy
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec
from worker_service.tp_engine import ControlChannel


def steps() -> dict[str, tuple]:
    ids = list(range(64))
    plan = [ids[:20], ids[20:45], ids[45:]]
    params = DecodingParams(strategy=DecodingStrategy.GREEDY, seed=7)
    prefill = [PrefillSpec(i, list(range(1000, 1128)), 0, params) for i in ids]
    return {"decode_64_rows": ("step", ([], [], plan), {}),
            "admit_64_prompts_of_128": ("step", ([], prefill, plan), {})}


def _rank(rank: int, world: int, init: str, n: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    channel, results = ControlChannel(), {}
    for name, call in steps().items():
        times = []
        for _ in range(n):
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                channel.send(call)
                times.append(time.perf_counter() - t0)
            else:
                channel.receive()
        if rank == 0:
            import pickle
            results[name] = {"bytes": len(pickle.dumps(call, pickle.HIGHEST_PROTOCOL)),
                             "median_us": 1e6 * statistics.median(times),
                             "p90_us": 1e6 * sorted(times)[int(0.9 * len(times))]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(args.ranks, f"file://{tmp}/rendezvous", args.steps, out),
                 nprocs=args.ranks)
        with open(out) as f:
            print(json.dumps({"ranks": args.ranks, "steps": args.steps, **json.load(f)},
                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
