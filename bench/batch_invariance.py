"""What option.batch_invariant costs: greedy tokens/s with it off and on, side by side.

    PYTHONPATH=$PWD:$PWD/protos python -m bench.batch_invariance --model DIR --runs 5

For each mode in turn (off, on, off, on, ... `--rounds` times) it starts a worker and a
scheduler in bfloat16, warms them up, and times `--runs` short runs of two kinds: one
request alone (every decoding step is a one-row product, the only place the option adds
work) and a batch of `--batch` requests at once (two rows or more in every product: the
option should cost nothing). It prints the median tokens/s of each, and the machine's
load average before and after, since the figures are only as good as the machine is quiet.
`--compare TOKENS` first sends 8 prompts alone and then together in each mode and counts
those whose tokens or log-probabilities differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path

from bench.deployment import Deployment
from client import AsyncClient, Client

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three primary colors:", "Tell me an interesting fact about llamas.",
           "What is the best way to cook a steak?", "Recommend some interesting books to read.",
           "Are you familiar with the Special Theory of Relativity and can you explain it to me?"]


def _alone(address: str, tokens: int) -> float:
    with Client(address, timeout=600) as c:
        t0 = time.perf_counter()
        reply = c.generate(PROMPTS[0], max_new_tokens=tokens, ignore_eos=True)
        return len(reply.token_ids) / (time.perf_counter() - t0)


def _batch(address: str, tokens: int, size: int) -> float:
    async def run() -> float:
        async with AsyncClient(address, timeout=600) as c:
            t0 = time.perf_counter()
            replies = await asyncio.gather(*(
                c.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=tokens, ignore_eos=True)
                for i in range(size)))
            return sum(len(r.token_ids) for r in replies) / (time.perf_counter() - t0)
    return asyncio.run(run())


def _compare(address: str, tokens: int) -> dict[str, int]:
    """Send every prompt alone, then all at once (greedy, log-probabilities); how many got
    other tokens, and other log-probabilities, together than alone."""
    params = dict(max_new_tokens=tokens, logprobs=0, ignore_eos=True)
    with Client(address, timeout=3600) as c:
        alone = [c.generate(p, **params) for p in PROMPTS]

    async def together():
        async with AsyncClient(address, timeout=3600) as c:
            return await asyncio.gather(*(c.generate(p, **params) for p in PROMPTS))
    both = list(zip(alone, asyncio.run(together())))
    return {"prompts": len(PROMPTS),
            "tokens_differ": sum(a.token_ids != b.token_ids for a, b in both),
            "logprobs_differ": sum(a.logprobs != b.logprobs for a, b in both)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model directory (bfloat16 runs)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per kind and round (5)")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations (2)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per request (64)")
    p.add_argument("--batch", type=int, default=8, help="requests in the batch kind (8)")
    p.add_argument("--compare", type=int, default=0, metavar="TOKENS",
                   help="first send the 8 prompts alone and then together, TOKENS greedy "
                        "tokens each, and count those whose tokens or log-probabilities "
                        "differ (0: skip)")
    p.add_argument("--out", type=Path, default=Path("bench-results/batch-invariance"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"alone": [], "batch": []} for mode in ("off", "on")}
    compared: dict[str, dict[str, int]] = {}
    load_before = os.getloadavg()
    for rnd in range(args.rounds):
        for mode in ("off", "on"):
            options = {"dtype": "bf16", "max_num_batched_tokens": 256,
                       "kv_cache_bytes": 256 << 20,
                       "batch_invariant": str(mode == "on").lower()}
            with Deployment(args.model, args.out / f"{mode}-{rnd}",
                            {"max_num_batched_tokens": 256}, options, start_timeout=600) as d:
                if args.compare and mode not in compared:
                    compared[mode] = _compare(d.address, args.compare)
                _alone(d.address, 8)  # warm-up: first calls build oneDNN primitives
                _batch(d.address, 8, args.batch)
                for _ in range(args.runs):
                    samples[mode]["alone"].append(_alone(d.address, args.tokens))
                    samples[mode]["batch"].append(_batch(d.address, args.tokens, args.batch))
                    print(f"batch_invariant {mode}: alone {samples[mode]['alone'][-1]:.1f}, "
                          f"batch {samples[mode]['batch'][-1]:.1f} tok/s, load average "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
    result = {"model": str(args.model), "tokens": args.tokens, "batch": args.batch,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "samples": samples, "alone_vs_together": compared,
              "median_tokens_per_s": {m: {k: statistics.median(v) for k, v in kinds.items()}
                                      for m, kinds in samples.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    med = result["median_tokens_per_s"]
    for kind in ("alone", "batch"):
        off, on = med["off"][kind], med["on"][kind]
        spread = {m: (min(samples[m][kind]), max(samples[m][kind])) for m in samples}
        print(f"{kind:5s}: off {off:7.1f} tok/s  on {on:7.1f} tok/s  on/off {on / off:.3f}  "
              f"(range off {spread['off'][0]:.1f}-{spread['off'][1]:.1f}, "
              f"on {spread['on'][0]:.1f}-{spread['on'][1]:.1f})")
    for mode, counts in compared.items():
        print(f"batch_invariant {mode}: of {counts['prompts']} prompts, tokens differ alone vs "
              f"together for {counts['tokens_differ']}, log-probabilities for "
              f"{counts['logprobs_differ']}")
    print(f"load average before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
