"""`python -m bench sweep`: the max_sparsity x max_splits grid, one deployment per point, on
the same requests all at once."""

from __future__ import annotations

import os
from pathlib import Path

from bench.commands.common import logger, prepare, server_options
from bench.loadgen import bench_seqserve
from bench.plots import plot_sweep
from bench.report import ratio, sweep_markdown, to_json, write

SWEEP_SPARSITIES = (0.0, 0.1, 0.33, 0.6, 0.9)
SWEEP_SPLITS = (1, 2, 3, 4, 8)
REFERENCE_POINT = (0.33, 3)  # the default configuration, compared with max_splits=1


def run(args, prepared=None) -> dict:
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    sparsities, splits = args.sparsities, args.splits
    out_dir = Path(args.out)
    result: dict = {"benchmark": "sweep", "workload": meta,
                    "max_rolling_batch_size": args.max_rolling_batch_size, "runs": []}
    for s in sparsities:
        for k in splits:
            logger.info("sweep: max_sparsity %g, max_splits %d (%d of %d)", s, k,
                        len(result["runs"]) + 1, len(sparsities) * len(splits))
            summary = bench_seqserve(
                model_dir, requests, tokenizer, max_sparsity=s, max_splits=k,
                max_rolling_batch_size=args.max_rolling_batch_size, dtype=meta["dtype"],
                logdir=out_dir / "logs" / f"sweep-s{s:g}-k{k}", device=args.device,
                server_options=server_options(args))
            summary.pop("per_request")
            result["runs"].append(summary)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "sweep.partial.json").write_text(to_json(result))

    def point(s: float, k: int) -> dict | None:
        return next((r for r in result["runs"] if r["config"]["max_sparsity"] == s
                     and r["config"]["max_splits"] == k), None)

    ref, base = point(*REFERENCE_POINT), point(REFERENCE_POINT[0], 1)
    if ref and base:
        result["reference"] = {
            "point": {"max_sparsity": REFERENCE_POINT[0], "max_splits": REFERENCE_POINT[1]},
            "peak_padded_slots_ratio_to_splits_1": ratio(
                ref["server"]["peak_kv_padded_slots"], base["server"]["peak_kv_padded_slots"]),
            "throughput_ratio_to_splits_1":
                ratio(ref["output_throughput"], base["output_throughput"]),
        }
    plot_link = None
    if args.plot:
        plot_sweep(result, Path(args.plot))
        result["plot"] = str(args.plot)
        plot_link = os.path.relpath(Path(args.plot).resolve(), out_dir.resolve())
    md = sweep_markdown(result, plot_link)
    write(out_dir, "sweep", result, md)
    (out_dir / "sweep.partial.json").unlink(missing_ok=True)
    print(md, flush=True)
    return result
