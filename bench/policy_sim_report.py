"""`python -m bench policy-sim`: the scheduling policies of `bench policies` replayed in the
simulation of bench/policy_sim.py on the same traces, length scaling, warm-up rows, batch
limit and knee rule, over several arrival seeds (medians), in seconds instead of an hour.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
from collections.abc import Callable, Sequence as Seq
from pathlib import Path

from bench.policy_plan import DEFAULT_REQUESTS, DEFAULT_WARMUP, split_rows
from bench.policy_sim import (KnownLengthAdmission, Result, SimConfig, SimRequest, fcfs,
                              laplace_noise, length_aware, simulate, true_length)
from bench.rate_points import knee
from bench.stats import latency_stats
from bench.workload import (WORKLOADS, Scale, TraceItem, load_workload, mooncake_prompt_ids,
                            mooncake_scale, poisson_arrivals)

logger = logging.getLogger("seqserve.bench")

KNEE_PROBES = (0.5, 0.75, 0.9, 1.1)  # bench policies' --knee-fractions
SMOLLM2_CONTEXT = 8192
# The worker's hidden-state probe on SmolLM2 (docs/benchmarks.md, response-length
# prediction): mean error 25 tokens, Acc-50 85%, Acc-100 93%. Laplace noise of scale b has
# mean error b and P(|e| <= 50) = 1 - exp(-50 / b): b = 26 gives 26 / 85% / 98%.
PROBE_NOISE = 26.0
POLICY_NAMES = ("fcfs", "length-aware", "probe-noise", "sjf-oracle")


def scale_for(workload: str, args) -> Scale:
    """As bench.commands.common.workload_scale for SmolLM2."""
    if WORKLOADS[workload].kind == "mooncake":
        return mooncake_scale(args.mooncake_block, SMOLLM2_CONTEXT, args.max_output or 32)
    return Scale(args.prompt_scale, args.max_prompt, args.output_scale, args.max_output or 128)


def prompt_ids(item: TraceItem, seed: int, block_tokens: int) -> tuple[int, ...]:
    """Mooncake: blocks shared as the trace shares them; Azure: random ids, as the bench's
    random safe-token prompts (no prefix in common)."""
    if item.hash_ids:
        return tuple(mooncake_prompt_ids(item, block_tokens, range(1, 50_000), seed))
    rng = random.Random(f"{seed}:{item.index}")
    return tuple(rng.randrange(1, 50_000) for _ in range(item.prompt_len))


def requests(items: Seq[TraceItem], offsets: Seq[float], seed: int,
             block_tokens: int) -> list[SimRequest]:
    return [SimRequest(i, off, prompt_ids(it, seed, block_tokens), it.output_len)
            for i, (it, off) in enumerate(zip(items, offsets))]


def summary(results: Seq[Result]) -> dict:
    """The fields of bench.stats.summarize that the knee rule and the tables read."""
    start = min(r.arrival_s for r in results)
    duration = max(r.arrival_s + r.e2e_s for r in results) - start
    return {"completed": len(results), "request_throughput": len(results) / duration,
            "e2e": latency_stats([r.e2e_s for r in results]),
            "ttft": latency_stats([r.ttft_s for r in results]),
            "preemptions": sum(r.preemptions for r in results),
            # Requests that found the batch full: a policy has a choice only for them.
            "queued": sum(r.waited_steps > 0 for r in results) / len(results)}


def find_knee(items: Seq[TraceItem], cfg: SimConfig, seed: int, block: int) -> tuple[float, float]:
    """(all-at-once rate, knee) of FCFS, by bench/rate_points.py's rule and probes."""
    base = summary(simulate(requests(items, [0.0] * len(items), seed, block), fcfs(), cfg))
    rate0 = base["request_throughput"]
    points = []
    for fr in KNEE_PROBES:
        rate = round(rate0 * fr, 3)
        offs = poisson_arrivals(len(items), rate, seed)
        s = summary(simulate(requests(items, offs, seed, block), fcfs(), cfg))
        points.append({"rate": rate, "arrival_span_s": max(offs), "summary": s})
    k = knee(points)
    return rate0, k if k is not None else points[0]["rate"]


def make_policies(names: Seq[str], warm: Seq[SimRequest], args, seed: int
                  ) -> dict[str, Callable[[], object]]:
    b, aging = args.bucket_tokens, args.aging_steps
    make = {"fcfs": fcfs,
            "length-aware": lambda: length_aware(warm, aging, b),
            "probe-noise": lambda: KnownLengthAdmission(laplace_noise(PROBE_NOISE, seed),
                                                        aging, b),
            "sjf-oracle": lambda: KnownLengthAdmission(true_length, aging, b)}
    return {n: make[n] for n in names}


def run_trace(workload: str, args, cfg: SimConfig) -> dict:
    n = args.num_requests or DEFAULT_REQUESTS[workload]
    items = load_workload(workload, args.warmup + n, scale_for(workload, args))
    warm_items, measured = split_rows(items, args.warmup)
    block = args.mooncake_block
    warm = requests(warm_items, [0.0] * len(warm_items), 1000, block)
    rate0, k = find_knee(measured, cfg, args.seed, block)
    logger.info("%s: FCFS all at once %.3f req/s, knee %.3f req/s", workload, rate0, k)
    rows = []
    for fr in args.fractions:
        runs: dict[str, list[dict]] = {p: [] for p in args.policies}
        for seed in range(args.seed, args.seed + args.seeds):
            offs = poisson_arrivals(len(measured), k * fr, seed)
            reqs = requests(measured, offs, 100 + seed, block)
            for name, make in make_policies(args.policies, warm, args, seed).items():
                runs[name].append(summary(simulate(reqs, make(), cfg)))
        for name, sums in runs.items():
            med = lambda f: statistics.median(f(s) for s in sums)  # noqa: E731
            rows.append({"fraction": fr, "policy": name,
                         "e2e_mean_ms": med(lambda s: s["e2e"]["mean_ms"]),
                         "e2e_p50_ms": med(lambda s: s["e2e"]["median_ms"]),
                         "e2e_p99_ms": med(lambda s: s["e2e"]["p99_ms"]),
                         "ttft_mean_ms": med(lambda s: s["ttft"]["mean_ms"]),
                         "preemptions": med(lambda s: s["preemptions"]),
                         "queued": med(lambda s: s["queued"]),
                         "fcfs_over_this": statistics.median(
                             f["e2e"]["mean_ms"] / s["e2e"]["mean_ms"]
                             for f, s in zip(runs[args.policies[0]], sums))})
    return {"workload": workload, "requests": n, "all_at_once_rate": rate0, "knee": k,
            "rows": rows}


def table(results: Seq[dict], control: str) -> str:
    out = ["| trace | knee req/s | x knee | policy | E2E ms mean / p50 / p99 | TTFT ms mean "
           f"| queued | preemptions | {control} mean E2E / this |",
           "|---|---|---|---|---|---|---|---|---|"]
    for t in results:
        for r in t["rows"]:
            out.append(f"| {t['workload']} | {t['knee']:.3f} | {r['fraction']:g} | "
                       f"{r['policy']} | {r['e2e_mean_ms']:.0f} / {r['e2e_p50_ms']:.0f} / "
                       f"{r['e2e_p99_ms']:.0f} | {r['ttft_mean_ms']:.0f} | {r['queued']:.0%} | "
                       f"{r['preemptions']:g} | {r['fcfs_over_this']:.2f} |")
    return "\n".join(out)


def run(args) -> None:
    unknown = set(args.policies) - set(POLICY_NAMES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from "
                         f"{', '.join(POLICY_NAMES)}")
    cfg = SimConfig(batch_limit=args.max_rolling_batch_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, kv_tokens=args.kv_tokens)
    results = [run_trace(w, args, cfg) for w in args.workloads]
    text = table(results, args.policies[0])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "policy-sim.json").write_text(json.dumps(
            {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
             "traces": results}, indent=1))
        (args.out / "policy-sim.md").write_text(text + "\n")


def add_parser(sub) -> None:
    """The `policy-sim` subcommand (bench/parser.py)."""
    from bench.policy_plan import DEFAULT_BATCH_LIMIT, DEFAULT_FRACTIONS, DEFAULT_WORKLOADS

    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    p = sub.add_parser("policy-sim", help="the policies of `bench policies` in a simulation "
                       "driven by the scheduler's planning code and a fitted SmolLM2 Step "
                       "time (issue 19; no model, seconds)")
    p.add_argument("--workloads", type=names, default=list(DEFAULT_WORKLOADS))
    p.add_argument("--policies", type=names, default=list(POLICY_NAMES),
                   help=f"the first is the control ({','.join(POLICY_NAMES)})")
    p.add_argument("--fractions", type=lambda s: [float(x) for x in names(s)],
                   default=list(DEFAULT_FRACTIONS), help="of FCFS's knee (0.5,0.8,1.0)")
    p.add_argument("--seeds", type=int, default=5, help="arrival seeds, medians over them (5)")
    p.add_argument("--seed", type=int, default=0, help="the first seed; the knee's (0)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="measured requests per trace (bench policies': 64, Mooncake 32)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    p.add_argument("--max-rolling-batch-size", type=int, default=DEFAULT_BATCH_LIMIT)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-tokens", type=int, default=SimConfig.kv_tokens,
                   help="KV budget in tokens (SmolLM2 at 4 GiB: 186413)")
    p.add_argument("--bucket-tokens", type=int, default=50, help="length_bucket_tokens (50)")
    p.add_argument("--aging-steps", type=int, default=64, help="priority_aging_steps (64)")
    p.add_argument("--prompt-scale", type=float, default=0.25)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-scale", type=float, default=0.5)
    p.add_argument("--max-output", type=int, default=None, help="128; Mooncake 32")
    p.add_argument("--mooncake-block", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="write policy-sim.json/.md here")
    p.add_argument("--log-level", default="INFO")
