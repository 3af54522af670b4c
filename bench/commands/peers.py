"""`python -m bench peers`: seqserve and each peer (HF static batches, transformers continuous
batching, vLLM) on the same requests, all at once; ratios; the forward-pass ceiling."""

from __future__ import annotations

import os
from pathlib import Path

from bench.plots import plot_cdfs
from bench.ceiling import run_ceiling
from bench.commands.common import (offline_floor, prepare, run_hf_peers, run_seqserve_offline,
                                   selected_peers, slo_limits, vllm_kwargs)
from bench.commands.throughput import throughput_report
from bench.peer_systems import PEER_NAMES, run_vllm, vllm_summary
from bench.report import peers_markdown, ratio, write


def run(args, prepared=None) -> dict:
    """All at once: seqserve and each peer on the same requests; ratios; the ceiling."""
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    out_dir, slo = Path(args.out), slo_limits(args)
    peers = selected_peers(args)
    result: dict = {"benchmark": "peers", "workload": meta, "slo": slo.describe() if slo else None}
    # Each run's floor is charged at the bandwidth probed around that run (offline_floor).
    probe = not args.no_floor
    seq = result["seqserve"] = run_seqserve_offline(args, model_dir, requests, tokenizer, meta,
                                                    "peers", slo, probe_bandwidth=probe)
    # The same requests as GenerateUnary calls (client/offline.py's way), on a deployment
    # of its own so that no prompt is in its prefix cache: vLLM's offline generate and the
    # HF baselines do not stream either, and a streamed run also charges the server's
    # cores with the benchmark client reading every token's message.
    unary = result["seqserve_not_streamed"] = run_seqserve_offline(
        args, model_dir, requests, tokenizer, meta, "peers-not-streamed",
        probe_bandwidth=probe, stream=False)
    systems = run_hf_peers(args, model_dir, requests, peers, slo)
    if "vllm" in peers:
        raw = run_vllm(model_dir, [{"name": "all-at-once", "requests": requests}], mode="offline",
                       workdir=out_dir / "logs" / "peers", probe_bandwidth=probe,
                       **vllm_kwargs(args))
        systems["vllm"] = raw if "skipped" in raw else vllm_summary(raw, 0, requests, slo)
    result["peers"] = systems
    if not args.no_ceiling:
        result["ceiling"] = run_ceiling(model_dir, requests, seq["server"]["mean_batch_size"],
                                        seq["output_throughput"], device=args.device,
                                        threads=args.hf_threads)
    ran = {name: s for name, s in {"seqserve": seq, "seqserve_not_streamed": unary,
                                   **systems}.items() if "skipped" not in s}
    floor = offline_floor(args, model_dir, requests, ran)
    if floor:
        own = floor["by_system"]
        result["floor"] = {
            **floor,
            # each run against the floor at the bandwidth probed around it
            "fraction": {name: ratio(own[name]["duration_s"] if name in own
                                     else floor["duration_s"], s.get("duration_s"))
                         for name, s in ran.items()},
            # ... and against the one floor of the probe after every run
            "fraction_end_probe": {name: ratio(floor["duration_s"], s.get("duration_s"))
                                   for name, s in ran.items()}}
    result["ratios"] = {name: ratio(seq["output_throughput"], s.get("output_throughput"))
                        for name, s in systems.items()}
    result["ratios_not_streamed"] = {
        name: ratio(unary["output_throughput"], s.get("output_throughput"))
        for name, s in systems.items()}
    md = peers_markdown(result)
    cdf_runs = {"seqserve": seq, **{PEER_NAMES[k]: v for k, v in systems.items()
                                    if v.get("per_request") and "ttft" in v}}
    if args.plot_dir:
        path = Path(args.plot_dir) / "peers-cdf.png"
        plot_cdfs(cdf_runs, path, f"{meta['num_requests']} {meta['workload']} requests "
                  f"all at once; {Path(meta['model']).name} ({meta['dtype']})")
        result["plots"] = [str(path)]
        md += f"\n\n![latency CDFs]({os.path.relpath(path.resolve(), out_dir.resolve())})"
    write(out_dir, "peers", result, md)
    print(md, flush=True)
    if "hf" in systems and not args.no_throughput_report:
        throughput_report(meta, seq, systems["hf"], out_dir)  # the throughput table, from this run
    return result
