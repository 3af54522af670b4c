"""`python -m bench throughput`: seqserve against Hugging Face generate in static batches,
output tokens/s on the same requests, all at once."""

from __future__ import annotations

from pathlib import Path

from bench.commands.common import prepare, run_seqserve_offline
from bench.peer_systems import bench_hf
from bench.report import throughput_markdown, write


def throughput_report(meta: dict, seq: dict, hf: dict | None, out_dir: Path) -> dict:
    ratio_hf = seq["output_throughput"] / hf["output_throughput"] if hf else None
    result = {"benchmark": "throughput", "workload": meta, "seqserve": seq, "hf": hf,
              "ratio_seqserve_over_hf": ratio_hf}
    md = throughput_markdown(result)
    write(out_dir, "throughput", result, md)
    print(md, flush=True)
    return result


def run(args, prepared=None) -> dict:
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    seq = run_seqserve_offline(args, model_dir, requests, tokenizer, meta, "throughput")
    hf = None if args.no_hf else bench_hf(model_dir, requests, batch_size=args.hf_batch_size,
                                           threads=args.hf_threads, device=args.device)
    return throughput_report(meta, seq, hf, Path(args.out))
