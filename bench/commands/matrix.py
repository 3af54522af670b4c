"""`python -m bench matrix`: seqserve against vLLM (and the HF baselines) on every model x
trace, all at once and at Poisson rates up to past the knee, with each run's floor; one
ratio table (`make bench`).

Per model, in this order, so nothing else computes while a system is measured:
1. the machine's rates at the model's shapes (bench/machine_rates.py; the memory bandwidth
   once per command, and again just before and after every system's run: the host's
   bandwidth moves within seconds, so each run's floor is charged at its own probes);
2. one seqserve deployment: for each trace, all requests at once, then Poisson points at
   --rate-fractions of that run's request rate (each point with prompts of its own seed, so
   no point is served from a cache an earlier one filled; one arrival seed for all points);
3. one vLLM subprocess (AsyncLLM, streaming) running the same points on the same token ids;
4. the HF baselines (static batches, transformers continuous batching) in process, all at
   once only;
5. every point's floor (bench/floor.py), from its token ids and arrival times: at the
   bandwidth measured once, and for each system at the mean of its run's probes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

from bench.bandwidth_probe import bandwidth_now
from bench.commands.common import (prepare, run_hf_peers, selected_peers, server_options,
                                   slo_limits, vllm_kwargs, without_per_request)
from bench.env import environment, uptime
from bench.floor import ModelShape, floors_by_system, run_floor
from bench.loadgen import SeqserveTarget
from bench.machine_rates import M_GRID, QUICK_M_GRID, measure_bandwidth, measure_model
from bench.matrix_models import MATRIX_MODELS, resolve_model
from bench.matrix_report import matrix_markdown
from bench.peer_systems import run_vllm, vllm_summary
from bench.rate_points import curve, knee, run_rate_points
from bench.report import write
from bench.workload import WORKLOADS, load_workload, Scale

logger = logging.getLogger("seqserve.bench")

MATRIX_TRACES = ("azure-conv", "azure-code", "mooncake")
MATRIX_FRACTIONS = (0.5, 0.75, 0.9, 1.1)
SYSTEMS = ("seqserve", "vllm", "hf", "hf-cb")
QUICK = {"models": ("tiny",), "fractions": (0.5, 1.1), "num_requests": 4, "max_prompt": 64,
         "max_output": 8, "kv_cache_bytes": 256 << 20, "vllm_kv_gib": 1}


def apply_quick(args) -> None:
    """--quick: a smoke run of the whole path: the tiny model, 4 short requests a trace,
    two rates, a short GEMM grid, and KV memory of 256 MiB for seqserve and 1 GiB for vLLM
    (a smoke run shares its machine; 4 GiB each would not fit beside other jobs)."""
    if not args.quick:
        return
    args.models = args.models or list(QUICK["models"])
    args.rate_fractions = args.rate_fractions or list(QUICK["fractions"])
    args.num_requests = min(args.num_requests, QUICK["num_requests"])
    args.max_prompt = min(args.max_prompt, QUICK["max_prompt"])
    args.max_output = min(args.max_output or QUICK["max_output"], QUICK["max_output"])
    args.mooncake_block = min(args.mooncake_block, 8)
    options = list(args.server_option or [])
    if not any(o.split("=")[0].strip().replace("-", "_") == "kv_cache_bytes" for o in options):
        options.append(f"kv_cache_bytes={QUICK['kv_cache_bytes']}")
    args.server_option = options
    args.vllm_kv_gib = min(args.vllm_kv_gib, QUICK["vllm_kv_gib"])


def _run_seqserve(args, model_dir: Path, traces: dict, slo) -> None:
    """One deployment: every trace all at once, then its Poisson points."""
    tokenizer = next(iter(traces.values()))["tokenizer"]
    target = SeqserveTarget(model_dir, tokenizer, logdir=Path(args.out) / "logs" / "matrix",
                            dtype=next(iter(traces.values()))["meta"]["dtype"],
                            device=args.device, max_sparsity=args.max_sparsity,
                            max_splits=args.max_splits,
                            max_rolling_batch_size=args.max_rolling_batch_size,
                            server_options=server_options(args))
    with target:
        for name, t in traces.items():
            logger.info("matrix: seqserve %s, %s", model_dir.name, name)
            t["offline_request_rate"], t["points"] = run_rate_points(
                target, tokenizer, name, t["items"], t["requests"], args.rate_fractions,
                seed=args.seed, block_tokens=args.mooncake_block, slo=slo,
                probe=None if args.no_floor else bandwidth_now)


def _run_vllm(args, model_dir: Path, traces: dict, slo) -> str | None:
    """Every point of every trace in one vLLM subprocess; returns why it was skipped."""
    flat = [(name, p) for name, t in traces.items() for p in t["points"]]
    raw = run_vllm(model_dir, [{"name": f"{name} {p['label']}", "requests": p["requests"],
                                "arrivals": p["offsets"]} for name, p in flat],
                   mode="serve", workdir=Path(args.out) / "logs" / "matrix" / model_dir.name,
                   probe_bandwidth=not args.no_floor, **vllm_kwargs(args))
    if "skipped" in raw:
        return raw["skipped"]
    for i, (_, p) in enumerate(flat):
        p["vllm"] = vllm_summary(raw, i, p["requests"], slo)
    return None


def _run_hf(args, model_dir: Path, traces: dict, peers: list[str], slo) -> None:
    for name, t in traces.items():
        t["points"][0].update(run_hf_peers(args, model_dir, t["requests"], peers, slo, name))


def _cell(model: str, model_dir: Path, name: str, t: dict, floor_of) -> dict:
    points = []
    for p in t["points"]:
        floor = floor_of(p)
        if floor is not None:
            # each system's run against the floor at the bandwidth probed around it
            floor = {**floor.as_dict(), "by_system": floors_by_system(
                {s: p[s] for s in SYSTEMS if s in p}, lambda bandwidth: floor_of(p, bandwidth))}
        out = {"label": p["label"], "rate": p["rate"], "fraction": p.get("fraction"),
               "realized_rate": p.get("realized_rate"), "arrival_span_s": max(p["offsets"]),
               "floor": floor}
        for system in SYSTEMS:
            if system in p:
                out[system] = without_per_request(p[system])
                out[f"{system}_per_request"] = p[system].get("per_request")
        points.append(out)
    curves = {s: curve(t["points"], s) for s in ("seqserve", "vllm")}
    return {"model": model, "model_dir": str(model_dir), "trace": name,
            "workload": t["meta"], "offline_request_rate": t.get("offline_request_rate"),
            "knee": {"seqserve": knee(curves["seqserve"]),
                     "vllm": knee(curves["vllm"]) if curves["vllm"] else None,
                     "vllm_ran": bool(curves["vllm"])},
            "points": points}


def run_model(args, model: str, bandwidth: dict, known, peers: list[str], slo):
    """Every trace of one model: returns (cells, its machine rates, why vLLM was skipped)."""
    model_dir = resolve_model(model)
    margs = argparse.Namespace(**{**vars(args), "model": model_dir})
    traces: dict[str, dict] = {}
    for name in args.traces:
        model_dir, requests, tokenizer, meta = prepare(margs, name)
        items = load_workload(name, args.num_requests, Scale(**meta["scale"]))
        traces[name] = {"requests": requests, "tokenizer": tokenizer, "meta": meta,
                        "items": items}
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    rates = None if args.no_floor else measure_model(
        shape, ms=QUICK_M_GRID if args.quick else M_GRID, bandwidth=bandwidth, known=known,
        threads=args.hf_threads)
    _run_seqserve(args, model_dir, traces, slo)
    skipped = _run_vllm(args, model_dir, traces, slo) if "vllm" in peers else None
    _run_hf(args, model_dir, traces, peers, slo)

    def floor_of(p: dict, bandwidth: float | None = None):
        if rates is None:
            return None
        at = rates if bandwidth is None else replace(rates, bandwidth=bandwidth)
        return run_floor(shape, at, [r.prompt_ids for r in p["requests"]],
                         [r.output_len for r in p["requests"]], p["offsets"],
                         args.max_rolling_batch_size)

    cells = [_cell(model, model_dir, name, t, floor_of) for name, t in traces.items()]
    return cells, rates, skipped, shape


def run(args) -> dict:
    apply_quick(args)
    args.models = args.models or list(MATRIX_MODELS)
    args.rate_fractions = args.rate_fractions or list(MATRIX_FRACTIONS)
    bad = set(args.traces) - set(WORKLOADS)
    if bad:
        raise SystemExit(f"unknown trace(s) {sorted(bad)}; choose from {sorted(WORKLOADS)}")
    if any(not (f > 0 and math.isfinite(f)) for f in args.rate_fractions):
        raise SystemExit(f"--rate-fractions wants positive fractions, got {args.rate_fractions}"
                         " (all at once always runs)")
    env, start = environment(), uptime()
    slo, peers = slo_limits(args), selected_peers(args)
    logger.info("matrix: models %s, traces %s, rate fractions %s, peers %s; %s", args.models,
                args.traces, args.rate_fractions, peers, start)
    bandwidth = None if args.no_floor else measure_bandwidth(64 if args.quick else 256)
    cells, skipped, rates, names = [], {}, None, {}
    for model in args.models:
        c, rates, why, shape = run_model(args, model, bandwidth, rates, peers, slo)
        cells += c
        names.update({g.key: g.name for g in shape.gemms()})
        if why:
            skipped[f"vLLM on {model}"] = why
    scales = {c["trace"]: c["workload"]["scale_text"] for c in cells}
    result = {"benchmark": "matrix", "commit": env.get("git", "unknown"), "env": env,
              "cores": env["cores"], "uptime_start": start, "uptime_end": uptime(),
              "num_requests": args.num_requests, "scales": scales,
              "rate_fractions": args.rate_fractions, "models": args.models,
              "traces": args.traces, "peers": peers, "vllm_skipped": skipped, "cells": cells}
    if rates is not None:
        result["machine"] = {"gemm": rates.gemm, "names": names, "bandwidth": rates.bandwidth,
                             "memory": rates.detail["memory"], "threads": rates.detail["threads"],
                             "detail": rates.detail}
    md = matrix_markdown(result)
    write(Path(args.out), "matrix", result, md)
    print(md, flush=True)
    return result
