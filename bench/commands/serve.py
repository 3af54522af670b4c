"""`python -m bench serve`: the load generator. One run (all at once, Poisson at --rate, the
trace's timestamps) or a Poisson rate sweep (--rates), for seqserve and, with --peers vllm,
vLLM on the same requests."""

from __future__ import annotations

import os
from pathlib import Path

from bench.plots import plot_cdfs, plot_load_sweep
from bench.commands.common import (logger, prepare, selected_peers, server_options,
                                   slo_limits, vllm_kwargs, without_per_request)
from bench.loadgen import SeqserveTarget
from bench.peer_systems import run_vllm, vllm_summary
from bench.rate_points import KNEE_RULE, knee, realized_rate
from bench.report import serve_markdown, write
from bench.workload import (Scale, arrivals, build_workload_requests, describe_arrivals,
                            load_workload)

RATE_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.5)


def run(args, prepared=None) -> dict:
    """Load generator: one run (all at once, Poisson at --rate, trace timestamps) or a Poisson
    rate sweep (--rates), for seqserve and, with --peers vllm, vLLM on the same requests."""
    out_dir, slo = Path(args.out), slo_limits(args)
    if args.rates is not None and args.arrival != "poisson":
        raise SystemExit("--rates sweeps Poisson arrivals: add --arrival poisson")
    if args.arrival == "poisson" and args.rates is None and not args.rate:
        raise SystemExit("--arrival poisson needs --rate R or --rates R1,R2,... | auto")
    model_dir, requests0, tokenizer, meta = prepared or prepare(args)
    scale = Scale(**meta["scale"])
    items = load_workload(args.workload, args.num_requests, scale,
                          args.trace if args.trace else None)
    want_vllm = "vllm" in selected_peers(args)
    sweep = args.arrival == "poisson" and args.rates is not None
    result: dict = {"benchmark": "serve", "workload": meta, "slo": slo.describe() if slo else None,
                    "arrival": args.arrival, "max_concurrency": args.max_concurrency,
                    "seqserve": [], "vllm": []}
    target = SeqserveTarget(None if args.address else model_dir, tokenizer,
                            logdir=out_dir / "logs" / "serve", dtype=meta["dtype"],
                            device=args.device, max_sparsity=args.max_sparsity,
                            max_splits=args.max_splits,
                            max_rolling_batch_size=args.max_rolling_batch_size,
                            address=args.address, metrics_url=args.metrics_url,
                            server_options=server_options(args))
    points: list[dict] = []
    with target:
        if sweep:
            rates = list(args.rates)
            if not rates:  # auto: fractions of seqserve's offline request throughput
                cap = target.run(requests0, slo=slo)
                result["capacity_run"] = without_per_request(cap)
                base = cap["request_throughput"]
                rates = [round(base * fr, 3) for fr in args.rate_fractions]
                logger.info("serve: offline %.2f requests/s; sweeping Poisson rates %s", base,
                            rates)
        else:
            rates = [args.rate if args.arrival == "poisson" else None]
        for i, rate in enumerate(rates):
            # A sweep's points get prompts of their own (seed + 1 + i): none is served from the
            # prefix cache that the capacity run or an earlier point filled.
            seed = args.seed + 1 + i if sweep else args.seed
            reqs = requests0 if seed == args.seed else build_workload_requests(
                tokenizer, args.workload, items, seed, args.mooncake_block)
            # One arrival seed for every rate: the same Poisson shape, scaled by 1 / rate, so the
            # points differ in load only (fresh prompts per point keep caches out of it).
            offs = arrivals(args.arrival, items, rate=rate, speedup=args.speedup, seed=args.seed)
            label = describe_arrivals(args.arrival, rate=rate, speedup=args.speedup,
                                      max_concurrency=args.max_concurrency)
            logger.info("serve: seqserve, %s (%d of %d)", label, i + 1, len(rates))
            s = target.run(reqs, offs, args.max_concurrency, slo)
            offered = (len(reqs) / max(offs[-1], 1e-9)) if args.arrival == "trace" else rate
            points.append({"rate": rate, "offered_rate": offered, "label": label, "seed": seed,
                           "requests": reqs, "offsets": offs})
            result["seqserve"].append({"rate": rate, "offered_rate": offered, "label": label,
                                       "seed": seed, "arrival_span_s": max(offs),
                                       "realized_rate": realized_rate(offs), "summary": s})
    if want_vllm:
        raw = run_vllm(model_dir, [{"name": p["label"], "requests": p["requests"],
                                    "arrivals": p["offsets"],
                                    "max_concurrency": args.max_concurrency} for p in points],
                       mode="serve", workdir=out_dir / "logs" / "serve", **vllm_kwargs(args))
        if "skipped" in raw:
            result["vllm_skipped"] = raw["skipped"]
        else:
            for i, p in enumerate(points):
                result["vllm"].append({"rate": p["rate"], "offered_rate": p["offered_rate"],
                                       "label": p["label"], "seed": p["seed"],
                                       "arrival_span_s": max(p["offsets"]),
                                       "realized_rate": realized_rate(p["offsets"]),
                                       "summary": vllm_summary(raw, i, p["requests"], slo)})
    if sweep:
        result["knee"] = {"seqserve": knee(result["seqserve"]),
                          "vllm": knee(result["vllm"]) if result["vllm"] else None,
                          "rule": KNEE_RULE}
    md = serve_markdown(result)
    plots = []
    if args.plot_dir:
        series = {"seqserve": result["seqserve"]}
        if result["vllm"]:
            series["vLLM CPU"] = result["vllm"]
        title = (f"{meta['num_requests']} {meta['workload']} requests; "
                 f"{Path(meta['model']).name} ({meta['dtype']}); {meta['scale_text']}")
        if sweep and len(rates) > 1:
            p = Path(args.plot_dir) / f"serve-{args.workload}-sweep.png"
            plot_load_sweep(series, p, title)
            plots.append(p)
        cdfs = {f"{name} {pt['label']}": pt["summary"] for name, pts in series.items()
                for pt in pts}
        p = Path(args.plot_dir) / f"serve-{args.workload}-cdf.png"
        plot_cdfs(cdfs, p, title)
        plots.append(p)
        result["plots"] = [str(p) for p in plots]
        md += "".join(f"\n\n![{p.stem}]({os.path.relpath(p.resolve(), out_dir.resolve())})"
                      for p in plots)
    write(out_dir, f"serve-{args.workload}", result, md)
    print(md, flush=True)
    return result
