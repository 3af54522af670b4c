"""`python -m bench replicas`: the same cores split different ways, on the same requests
all at once: e.g. one worker with 2 threads against 2 workers (data parallel) with 1
thread each, and, where the worker has tensor_parallel_degree, one worker of 2 ranks.

    python -m bench replicas --configs 1x2,2x1 --repeats 3

A config is WORKERSxTHREADS (OMP_NUM_THREADS of each worker process), or tpDxTHREADS: one
worker of tensor_parallel_degree D with THREADS per rank. Each repeat runs every config
once, in turn, so a change of machine load hits all of them alike; the report gives each
run and the median of output tokens/s.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from pathlib import Path

from bench.commands.common import prepare, server_options
from bench.deployment import Deployment
from bench.env import load_average
from bench.loadgen import send_requests, warmup
from bench.metrics import scrape
from bench.report import write
from bench.stats import summarize

logger = logging.getLogger("seqserve.bench")


def parse_config(text: str) -> tuple[int, int, int]:
    """'2x1' -> (workers 2, threads 1, tp 1); 'tp2x1' -> (1, 1, 2)."""
    if text.startswith("tp"):
        tp_text, _, threads = text[2:].partition("x")
        return 1, int(threads or 1), int(tp_text)
    workers, _, threads = text.partition("x")
    return int(workers), int(threads), 1


def run_config(args, model_dir, requests, tokenizer, dtype: str, config: str,
               logdir: Path) -> dict:
    workers, threads, tp = parse_config(config)
    opts = server_options(args)
    worker_opts = {"dtype": dtype, "device": args.device, **opts}
    if tp > 1:
        worker_opts["tensor_parallel_degree"] = tp
    d = Deployment(model_dir, logdir,
                   options={"http_port": -1, "max_sparsity": args.max_sparsity,
                            "max_splits": args.max_splits,
                            "max_rolling_batch_size": args.max_rolling_batch_size, **opts},
                   worker_options=worker_opts, env={"OMP_NUM_THREADS": str(threads)},
                   start_timeout=300.0, stop_timeout=30.0)
    try:
        for i in range(workers):
            d.start_worker(index=i)
        d.start_scheduler()
        warmup(d.address, tokenizer)
        load = load_average()
        before = scrape(d.metrics_url)
        results = asyncio.run(send_requests(d.address, requests))
        after = scrape(d.metrics_url)
    finally:
        d.stop()
    summary = summarize(results)
    placed = {k.split("=", 1)[1].rstrip("}"): after[k] - before.get(k, 0.0) for k in after
              if k.startswith("seqserve_requests_placed_total{")}
    return {"config": config, "workers": workers, "threads": threads, "tp": tp,
            "load_average": load, "output_throughput": summary["output_throughput"],
            "duration_s": summary["duration_s"], "placed": placed,
            "ttft": summary["ttft"]}


def markdown(result: dict) -> str:
    meta = result["workload"]
    lines = [f"### {meta['num_requests']} {meta['trace_name']} requests at once, model "
             f"{meta['model']} ({meta['dtype']})", "",
             "| config | " + " | ".join(f"run {i + 1} tok/s" for i in range(result["repeats"]))
             + " | median tok/s | median / first config |",
             "|---|" + "---|" * (result["repeats"] + 2)]
    first = result["median"][result["configs"][0]]
    for c in result["configs"]:
        runs = [r for r in result["runs"] if r["config"] == c]
        lines.append(f"| {c} | " + " | ".join(f"{r['output_throughput']:.1f}" for r in runs)
                     + f" | {result['median'][c]:.1f} | {result['median'][c] / first:.2f} |")
    loads = ", ".join(str(r["load_average"]) for r in result["runs"])
    lines += ["", f"Load average (1, 5, 15 min) before each run, in order: {loads}."]
    return "\n".join(lines)


def run(args) -> dict:
    model_dir, requests, tokenizer, meta = prepare(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    runs = []
    for rep in range(args.repeats):
        for c in configs:
            r = run_config(args, model_dir, requests, tokenizer, meta["dtype"], c,
                           Path(args.out) / "logs" / f"replicas-{c}-{rep}")
            logger.info("%s run %d: %.1f output tokens/s (placed %s, load %s)", c, rep + 1,
                        r["output_throughput"], r["placed"], r["load_average"])
            runs.append(r)
    median = {c: statistics.median(r["output_throughput"] for r in runs if r["config"] == c)
              for c in configs}
    result = {"benchmark": "replicas", "workload": meta, "configs": configs,
              "repeats": args.repeats, "runs": runs, "median": median}
    md = markdown(result)
    write(Path(args.out), "replicas", result, md)
    print(md, flush=True)
    return result
