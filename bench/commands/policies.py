"""`python -m bench policies` (issue 19): each scheduling policy against FCFS, per trace, at
Poisson rates of 50%, 80% and 100% of FCFS's knee; `make bench-policies`.

Per trace, in this order, so nothing else computes while a server is measured:
1. an FCFS server: the matrix's knee probes (bench/rate_points.py: all at once, then
   Poisson points at --knee-fractions of that rate, stopping after the first past the knee),
   then the urgent prompts of every fraction, each alone (their TTFT on an idle server);
2. per policy, a fresh server (option.scheduling_policy, bench/policy_plan.py): the
   warm-up rows all at once (not measured; length-aware learns output lengths online from
   them), then one Poisson run per --rate-fractions of the knee: the same prompts, urgent
   requests and arrival times for every policy.
Then, with --peers vllm, one vLLM subprocess runs every trace's points (without priorities).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

from bench.commands.common import (check_context, server_options, slo_limits, vllm_kwargs,
                                   without_per_request, workload_meta, workload_scale)
from bench.env import environment, model_dtype, uptime
from bench.loadgen import SeqserveTarget
from bench.matrix_models import resolve_model
from bench.peer_systems import run_vllm, vllm_summary
from bench.policy_plan import (MEASURED_SEED, WARMUP_SEED, TraceWork, check_args,
                               estimate_seconds, num_requests, policy_options,
                               split_rows, urgent_class, urgent_positions, with_priority)
from bench.policy_report import policies_markdown
from bench.rate_points import KNEE_RULE, curve, knee, realized_rate, run_rate_points
from bench.report import write
from bench.workload import WORKLOADS, BenchRequest, arrivals, build_workload_requests, load_workload

logger = logging.getLogger("seqserve.bench")
DEFAULT_MODEL = "smollm2"


def _target(args, model_dir: Path, tokenizer, options: dict, logdir: Path) -> SeqserveTarget:
    return SeqserveTarget(model_dir, tokenizer, logdir=logdir, dtype=model_dtype(model_dir),
                          device=args.device, max_sparsity=args.max_sparsity,
                          max_splits=args.max_splits,
                          max_rolling_batch_size=args.max_rolling_batch_size,
                          server_options=options)


def prepare_trace(args, model_dir: Path, tokenizer, name: str) -> dict:
    """The rows, requests and record of one trace: warm-up rows first, measured rows next."""
    args_w = argparse.Namespace(**{**vars(args), "workload": name})
    scale = workload_scale(args_w, model_dir)
    items = load_workload(name, args.warmup + num_requests(args, name), scale)
    check_context(model_dir, items)
    warm_items, measured = split_rows(items, args.warmup)
    block = args.mooncake_block
    positions = urgent_positions(len(measured), args.urgent_fraction, args.seed)
    knee_requests = build_workload_requests(tokenizer, name, measured, args.seed, block)
    runs = [with_priority(build_workload_requests(tokenizer, name, measured,
                                                  args.seed + MEASURED_SEED + i, block),
                          positions, args.urgent_priority)
            for i in range(len(args.rate_fractions))]
    warm = (build_workload_requests(tokenizer, name, warm_items, args.seed + WARMUP_SEED,
                                    block) if warm_items else [])
    meta = workload_meta(args_w, model_dir, name, WORKLOADS[name].path, measured,
                         knee_requests, scale, arrival="Poisson at fractions of FCFS's knee")
    work = TraceWork(sum(r.prompt_len for r in knee_requests),
                     sum(r.output_len for r in knee_requests), len(measured),
                     sum(r.prompt_len for r in warm), sum(r.output_len for r in warm),
                     sum(knee_requests[p].prompt_len for p in positions))
    return {"name": name, "items": measured, "knee_requests": knee_requests,
            "run_requests": runs, "warm_requests": warm, "positions": positions,
            "meta": meta, "work": work}


def idle_ttfts(target: SeqserveTarget, lead: BenchRequest,
               groups: list[list[BenchRequest]]) -> list[list[float]]:
    """Each request of `groups` alone, one after the other, to a server with nothing else
    to do: its TTFT (one output token: only the first is timed). `lead`, not timed, goes
    first on the same channel, so no request's TTFT holds the channel's connection."""
    flat = [lead] + [r for g in groups for r in g]
    s = target.run([replace(r, output_len=1) for r in flat], sequential=True)
    ttfts = [p["ttft_s"] for p in s["per_request"][1:]]
    out, i = [], 0
    for g in groups:
        out.append(ttfts[i:i + len(g)])
        i += len(g)
    return out


def find_knee(args, model_dir: Path, tokenizer, t: dict, slo) -> None:
    """Step 1: FCFS's knee by the matrix's probes, then the idle TTFTs on the same server;
    sets t's knee, rates and arrival times."""
    logdir = Path(args.out) / "logs" / "policies" / t["name"] / "knee-fcfs"
    given = server_options(args)
    with _target(args, model_dir, tokenizer, policy_options("fcfs", given), logdir) as tgt:
        offline, points = run_rate_points(
            tgt, tokenizer, t["name"], t["items"], t["knee_requests"],
            [] if args.knee_rate else sorted(args.knee_fractions), seed=args.seed,
            block_tokens=args.mooncake_block, slo=slo, stop_past_knee=True)
        # After the probes: the server has seen every shape by then, so a first-time cost
        # (a new GEMM shape's kernel set-up) is not taken for the idle TTFT.
        # The lead request was served by the probes already: a prefix-cache hit that warms
        # nothing the timed ones use.
        t["idle_ttfts_s"] = idle_ttfts(tgt, t["knee_requests"][0],
                                       [[reqs[p] for p in t["positions"]]
                                        for reqs in t["run_requests"]])
    # --knee-rate: an earlier run's knee, so that runs on a busy machine (whose probes
    # would find a lower one) load the servers alike; only the all-at-once probe runs, to
    # warm the server up before the idle TTFTs.
    found = args.knee_rate or knee(curve(points))
    rate = found if found is not None else points[1]["rate"] if len(points) > 1 else offline
    if found is None:
        logger.warning("%s: FCFS keeps up at no probed rate; the fractions are taken of the "
                       "lowest probe, %g requests/s", t["name"], rate)
    t["knee"] = {"rate": rate, "found": found is not None, "given": bool(args.knee_rate),
                 "offline_rate": offline,
                 "rule": KNEE_RULE,
                 "points": [{"label": p["label"], "rate": p["rate"],
                             "fraction": p.get("fraction"),
                             "summary": without_per_request(p["seqserve"])} for p in points]}
    t["rates"] = [round(rate * fr, 3) for fr in args.rate_fractions]
    t["offsets"] = [arrivals("poisson", t["items"], rate=r, seed=args.seed) for r in t["rates"]]


def _record(t: dict, policy: str, i: int, fraction: float, summary: dict) -> dict:
    return {"policy": policy, "fraction": fraction, "rate": t["rates"][i],
            "realized_rate": realized_rate(t["offsets"][i]),
            "arrival_span_s": max(t["offsets"][i]),
            "summary": without_per_request(summary), "per_request": summary["per_request"],
            "urgent": urgent_class(summary, t["positions"], t["idle_ttfts_s"][i])}


def run_policies(args, model_dir: Path, tokenizer, t: dict, slo) -> None:
    """Step 2: a fresh server per policy, warmed up alike, then one run per fraction."""
    given = server_options(args)
    t["runs"] = []
    for policy in args.policies:
        logdir = Path(args.out) / "logs" / "policies" / t["name"] / policy
        with _target(args, model_dir, tokenizer, policy_options(policy, given), logdir) as tgt:
            if t["warm_requests"]:
                logger.info("%s, %s: %d warm-up requests", t["name"], policy,
                            len(t["warm_requests"]))
                tgt.run(t["warm_requests"])
            for i, fr in enumerate(args.rate_fractions):
                logger.info("%s, %s: Poisson %g requests/s (%g x FCFS's knee)", t["name"],
                            policy, t["rates"][i], fr)
                s = tgt.run(t["run_requests"][i], t["offsets"][i], None, slo)
                t["runs"].append(_record(t, policy, i, fr, s))


def run_vllm_points(args, model_dir: Path, traces: list[dict], slo) -> str | None:
    """Every trace's points in one vLLM subprocess; returns why it was skipped."""
    flat = [(t, i, fr) for t in traces for i, fr in enumerate(args.rate_fractions)]
    raw = run_vllm(model_dir, [{"name": f"{t['name']} {fr:g}x knee",
                                "requests": t["run_requests"][i], "arrivals": t["offsets"][i]}
                               for t, i, fr in flat],
                   mode="serve", workdir=Path(args.out) / "logs" / "policies" / "vllm",
                   **vllm_kwargs(args))
    if "skipped" in raw:
        return raw["skipped"]
    for k, (t, i, fr) in enumerate(flat):
        t["runs"].append(_record(t, "vllm", i, fr,
                                 vllm_summary(raw, k, t["run_requests"][i], slo)))
    return None


def _trace_record(t: dict, args) -> dict:
    return {"name": t["name"], "workload": t["meta"], "scale_text": t["meta"]["scale_text"],
            "num_requests": len(t["items"]), "first_row": t["items"][0].index,
            "warmup": len(t["warm_requests"]), "urgent_positions": t["positions"],
            "urgent_priority": args.urgent_priority, "idle_ttfts_s": t["idle_ttfts_s"],
            "knee": t["knee"], "rates": t["rates"], "uptime_start": t["uptime_start"],
            "uptime_end": t["uptime_end"], "wall_s": t["wall_s"], "runs": t["runs"]}


def run(args) -> dict:
    from transformers import AutoTokenizer

    args.model = Path(args.model) if args.model else Path(DEFAULT_MODEL)
    check_args(args)
    slo, want_vllm = slo_limits(args), "vllm" in args.peers
    model_dir = resolve_model(str(args.model))
    args.model = model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    traces = [prepare_trace(args, model_dir, tokenizer, name) for name in args.workloads]
    est = estimate_seconds([t["work"] for t in traces], policies=len(args.policies),
                           fractions=args.rate_fractions, knee_fractions=args.knee_fractions,
                           vllm=want_vllm)
    print(f"bench policies: about {est / 60:.0f} minutes ({len(traces)} traces x "
          f"{len(args.rate_fractions)} fractions x {len(args.policies)} policies"
          f"{' + vLLM' if want_vllm else ''}, knee probes, idle TTFTs, warm-ups), at "
          f"SmolLM2's speed on a quiet 2-core machine (bench/policy_plan.py Speed)", flush=True)
    env, start, t0 = environment(), uptime(), time.perf_counter()
    for t in traces:
        t["uptime_start"], t0_trace = uptime(), time.perf_counter()
        find_knee(args, model_dir, tokenizer, t, slo)
        run_policies(args, model_dir, tokenizer, t, slo)
        t["uptime_end"], t["wall_s"] = uptime(), time.perf_counter() - t0_trace
        logger.info("%s done in %.1f min; %.1f min since the start, of about %.0f estimated",
                    t["name"], t["wall_s"] / 60, (time.perf_counter() - t0) / 60, est / 60)
    skipped = run_vllm_points(args, model_dir, traces, slo) if want_vllm else None
    result = {"benchmark": "policies", "commit": env.get("git", "unknown"), "env": env,
              "uptime_start": start, "uptime_end": uptime(), "model": str(model_dir),
              "dtype": model_dtype(model_dir), "policies": list(args.policies),
              "rate_fractions": list(args.rate_fractions),
              "knee_fractions": sorted(args.knee_fractions), "warmup": args.warmup,
              "urgent_fraction": args.urgent_fraction, "urgent_priority": args.urgent_priority,
              "server_options": server_options(args), "slo": slo.describe() if slo else None,
              "peers": list(args.peers), "vllm_skipped": skipped, "estimate_s": est,
              "wall_s": time.perf_counter() - t0,
              "traces": [_trace_record(t, args) for t in traces]}
    md = policies_markdown(result)
    write(Path(args.out), "policies", result, md)
    print(md, flush=True)
    return result
