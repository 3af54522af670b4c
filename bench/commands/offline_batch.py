"""`python -m bench offline-batch`: one offline batch job under FCFS, under the paper's
sequence scheduling (option.scheduling_policy=length-batched: groups of similar predicted
length, VBS and FCR) with the server's learned length predictor, and under the same policy
given every row's true length (the oracle, the paper's upper bound).

    python -m bench offline-batch --workload azure-conv --num-requests 128

The job is N rows of a trace, all submitted at once. Each row runs greedy with one
max_new_tokens for the whole job (--max-output) and ends where the trace's response ends:
GenerateRequest.eos_after_tokens ends it there as if by EOS, and no policy reads that field,
so the server meets lengths it does not know, as with real EOS. The oracle run passes the
true lengths as GenerateRequest.length_hint. Before the job, every server learns from the
same seeded warm-up set of other rows of the trace (distinct from the job's), so the
learned predictor starts from the same past in each run.

VBS needs a memory limit to act against, as in the paper (its vanilla batch of 16 is what
fits a maximum-length response): the KV budget (kv_cache_bytes) is set to --base-batch
sequences of mean prompt + max_new_tokens, which is what FCFS (reserving prompt +
max_new_tokens) runs at once; length-batched reserves each group's limit instead, so short
groups run in larger batches, within --max-rolling-batch-size.

Reported per run: output tokens/s over the job's makespan, the makespan, FCR failures
(preemptions), and the predictor's error, Acc-50 and Acc-100 on the job's rows (the
scheduler's seqserve_length_prediction* metrics), with the commit and the load average.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from bench.commands.common import (check_context, command_line, server_options,
                                   workload_scale)
from bench.deployment import Deployment
from bench.env import environment, load_average, model_dtype
from bench.floor import ModelShape
from bench.matrix_models import resolve_model
from bench.metrics import scrape
from bench.report import write
from bench.workload import BenchRequest, build_workload_requests, length_stats, load_workload
from client.api import build_request
from client.offline import OfflineModel

logger = logging.getLogger("seqserve.bench")

RUNS = (("fcfs", "fcfs", False), ("length-batched", "length-batched", False),
        ("oracle", "length-batched", True))
# SmolLM2 bf16 on this 2-core machine when quiet (docs/benchmarks.md: 273 output tokens/s
# with 64 requests at once; fewer run at once under FCFS here): the duration estimate only.
EST_OUTPUT_TOKENS_S = 150.0
EST_PROMPT_TOKENS_S = 2000.0
EST_START_S = 25.0
_PRED = "seqserve_length_predictions_total"
_ERR = "seqserve_length_prediction_error_tokens_total"
_WITHIN = "seqserve_length_predictions_within_total{tokens=%d}"
_PREEMPT = "seqserve_num_preemptions_total"


def split_rows(requests: list[BenchRequest], warmup: int, seed: int
               ) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """A seeded choice of `warmup` rows to learn from; the rest, in trace order, the job."""
    chosen = set(random.Random(seed).sample(range(len(requests)), warmup))
    return ([r for i, r in enumerate(requests) if i in chosen],
            [r for i, r in enumerate(requests) if i not in chosen])


def job_requests(rows: list[BenchRequest], max_new: int, hints: bool) -> list:
    return [build_request(r.prompt_ids, max_new_tokens=max_new, do_sample=False,
                          ignore_eos=True, eos_after_tokens=min(r.output_len, max_new),
                          length_hint=min(r.output_len, max_new) if hints else None)
            for r in rows]


def estimate_s(warm: list[BenchRequest], job: list[BenchRequest], max_new: int) -> float:
    out = sum(min(r.output_len, max_new) for r in warm + job)
    prompt = sum(r.prompt_len for r in warm + job)
    return len(RUNS) * (EST_START_S + out / EST_OUTPUT_TOKENS_S + prompt / EST_PROMPT_TOKENS_S)


def run_once(args, model_dir: Path, name: str, policy: str, hints: bool,
             warm: list[BenchRequest], job: list[BenchRequest], kv_bytes: int) -> dict:
    opts = {**server_options(args), "scheduling_policy": policy, "kv_cache_bytes": kv_bytes,
            "length_bucket_tokens": args.bucket_tokens, "max_queue": len(job) + len(warm)}
    d = Deployment(model_dir, Path(args.out) / "logs" / f"offline-batch-{name}",
                   options={"http_port": -1, "max_sparsity": args.max_sparsity,
                            "max_splits": args.max_splits,
                            "max_rolling_batch_size": args.max_rolling_batch_size, **opts},
                   worker_options={"dtype": model_dtype(model_dir), "device": args.device,
                                   **opts},
                   start_timeout=300.0, stop_timeout=30.0)
    d.start()
    try:
        with OfflineModel(d.address, timeout=3600, max_in_flight=len(warm) + len(job)) as m:
            m.run_requests(job_requests(warm, args.max_output, hints=False))
            load_before = load_average()
            before = scrape(d.metrics_url)
            t0 = time.perf_counter()
            replies = m.run_requests(job_requests(job, args.max_output, hints))
            makespan = time.perf_counter() - t0
            after = scrape(d.metrics_url)
    finally:
        d.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in (_PRED, _ERR, _WITHIN % 50, _WITHIN % 100, _PREEMPT)}
    tokens = sum(r.usage.generated_tokens for r in replies)
    expected = sum(min(r.output_len, args.max_output) for r in job)
    if tokens != expected:
        raise SystemExit(f"{name}: the job produced {tokens} tokens, the trace asks for "
                         f"{expected}: a row ended early or late")
    n = delta[_PRED]
    accuracy = ({"n": int(n), "error": delta[_ERR] / n, "acc50": delta[_WITHIN % 50] / n,
                 "acc100": delta[_WITHIN % 100] / n} if n else None)
    result = {"name": name, "policy": policy, "length_hints": hints,
              "output_tokens": tokens, "makespan_s": makespan,
              "output_tokens_per_s": tokens / makespan,
              "fcr_failures": int(delta[_PREEMPT]) if policy == "length-batched" else 0,
              "accuracy": accuracy, "load_average_before": load_before,
              "load_average_after": load_average()}
    logger.info("%s: %.1f output tokens/s, makespan %.1f s, FCR %d, accuracy %s", name,
                result["output_tokens_per_s"], makespan, result["fcr_failures"], accuracy)
    return result


def markdown(res: dict) -> str:
    meta = res["meta"]
    base = res["runs"][0]["output_tokens_per_s"]
    lines = [f"# Offline batch job: FCFS vs length-batched (VBS + FCR) vs oracle",
             "",
             f"{meta['trace_name']}, {meta['job_rows']} rows (warm-up {meta['warmup_rows']} "
             f"other rows), model {meta['model']} ({meta['dtype']}), max_new_tokens "
             f"{meta['max_new_tokens']}, KV budget {meta['kv_tokens']} tokens "
             f"(base batch {meta['base_batch']}), max_rolling_batch_size "
             f"{meta['max_rolling_batch_size']}, buckets of {meta['bucket_tokens']} tokens; "
             f"commit {meta['env'].get('git')}, {meta['env']['cores']} cores.",
             "",
             "| run | output tok/s | vs FCFS | makespan (s) | FCR failures | pred. error "
             "(tokens) | Acc-50 | Acc-100 | load avg before / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        a = r["accuracy"]
        acc = (f"{a['error']:.0f} | {100 * a['acc50']:.0f}% | {100 * a['acc100']:.0f}%"
               if a else "n/a | n/a | n/a")
        load = (f"{(r['load_average_before'] or ['?'])[0]} / "
                f"{(r['load_average_after'] or ['?'])[0]}")
        lines.append(f"| {r['name']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['output_tokens_per_s'] / base:.2f}x | {r['makespan_s']:.1f} | "
                     f"{r['fcr_failures']} | {acc} | {load} |")
    lines += ["", f"Output lengths: {json.dumps(meta['output'])}", "",
              f"`{meta['command']}`"]
    return "\n".join(lines)


def run(args) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model(str(args.model))
    scale = workload_scale(args, model_dir)
    items = load_workload(args.workload, args.num_requests + args.warmup_requests, scale,
                          args.trace)
    check_context(model_dir, items)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload_requests(tokenizer, args.workload, items, args.seed,
                                       args.mooncake_block)
    warm, job = split_rows(requests, args.warmup_requests, args.seed)
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    mean_prompt = sum(r.prompt_len for r in job) / len(job)
    kv_tokens = int(args.base_batch * (mean_prompt + args.max_output))
    logger.info("offline batch: %d job rows, %d warm-up rows, 3 runs; estimated %.0f min "
                "on a quiet 2-core machine", len(job), len(warm),
                estimate_s(warm, job, args.max_output) / 60)
    runs = [run_once(args, model_dir, name, policy, hints, warm, job,
                     kv_tokens * shape.kv_bytes_per_token())
            for name, policy, hints in RUNS]
    meta = {"trace_name": args.workload, "job_rows": len(job), "warmup_rows": len(warm),
            "model": str(model_dir), "dtype": model_dtype(model_dir),
            "max_new_tokens": args.max_output, "kv_tokens": kv_tokens,
            "base_batch": args.base_batch, "bucket_tokens": args.bucket_tokens,
            "max_rolling_batch_size": args.max_rolling_batch_size, "seed": args.seed,
            "prompt": length_stats([r.prompt_len for r in job]),
            "output": length_stats([min(r.output_len, args.max_output) for r in job]),
            "env": environment(), "command": command_line()}
    result = {"meta": meta, "runs": runs}
    md = markdown(result)
    write(Path(args.out), "offline_batch", result, md)
    print(md)
