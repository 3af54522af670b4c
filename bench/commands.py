"""Subcommands of `python -m bench`."""

from __future__ import annotations

import argparse
import logging
import os
import random
import shlex
import sys
import timeit
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from bench import report
from bench.ceiling import run_ceiling
from bench.env import environment, machine_cores, model_context, model_dtype
from bench.loadgen import SeqserveTarget, bench_seqserve
from bench.peer_systems import (PEER_NAMES, PEERS, bench_hf, bench_hf_cb, run_vllm,
                                vllm_summary)
from bench.report import LATENCY_HEADER, f as _f, latency_rows, md_table, ratio, write
from bench.stats import Slo, percentile
from bench.workload import (ARRIVALS, WORKLOADS, BenchRequest, Scale, TraceItem,
                                   arrivals, build_workload_requests, describe_arrivals,
                                   ideal_prefix_hit_rate, length_stats, load_mooncake,
                                   load_workload, make_prompt, mooncake_scale,
                                   round_trip_tokens, trace_arrivals)

logger = logging.getLogger("seqserve.bench")

DEFAULT_MODEL = Path("models/mid-llama-bf16")
COMMANDS = ("throughput", "sweep", "partition", "prefix", "serve", "peers", "ceiling", "all")
SWEEP_SPARSITIES = (0.0, 0.1, 0.33, 0.6, 0.9)
SWEEP_SPLITS = (1, 2, 3, 4, 8)
REFERENCE_POINT = (0.33, 3)  # the default configuration, compared with max_splits=1
RATE_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.5)


# --------------------------------------------------------------------------------------------
# Workload preparation
# --------------------------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> Path:
    """The model directory; the default mid model is written if missing."""
    if not (model_dir / "config.json").exists():
        if model_dir != DEFAULT_MODEL:
            raise SystemExit(f"no model at {model_dir} (config.json missing)")
        from worker_service.fixtures import make_model

        logger.info("writing the benchmark model to %s (mid llama, bfloat16)", model_dir)
        make_model(model_dir, arch="llama", size="mid", dtype="bfloat16")
    return model_dir


def workload_scale(args, model_dir: Path) -> Scale:
    """The length scale of args.workload: Azure traces by --prompt-scale/--output-scale;
    Mooncake by its block size (512 -> --mooncake-block tokens), capped at the context."""
    if WORKLOADS[args.workload].kind == "mooncake":
        max_out = args.max_output or 32
        return mooncake_scale(args.mooncake_block, model_context(model_dir) or 2048, max_out)
    return Scale(args.prompt_scale, args.max_prompt, args.output_scale, args.max_output or 128)


def _check_context(model_dir: Path, items: Sequence[TraceItem]) -> None:
    max_pos = model_context(model_dir)
    longest = max(it.prompt_len + it.output_len for it in items)
    if max_pos and longest > max_pos:
        raise SystemExit(f"a request needs {longest} positions; the model has {max_pos}: "
                         f"lower --max-prompt / --max-output")


def prepare(args, workload: str | None = None) -> tuple[Path, list[BenchRequest], Any, dict]:
    """Model (made if it is the missing default), requests, tokenizer and the workload record."""
    from transformers import AutoTokenizer

    workload = workload or args.workload
    model_dir = ensure_model(Path(args.model))
    args_w = argparse.Namespace(**{**vars(args), "workload": workload})
    scale = workload_scale(args_w, model_dir)
    spec = WORKLOADS[workload]
    trace = args.trace if (args.trace and workload == args.workload) else spec.path
    items = load_workload(workload, args.num_requests, scale, trace)
    _check_context(model_dir, items)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload_requests(tokenizer, workload, items, args.seed, args.mooncake_block)
    meta = workload_meta(args, model_dir, workload, trace, items, requests, scale)
    return model_dir, requests, tokenizer, meta


def workload_meta(args, model_dir: Path, workload: str, trace, items, requests, scale: Scale,
                  arrival: str = "all at once") -> dict:
    meta = {
        "workload": workload, "trace": str(Path(trace)), "trace_name": WORKLOADS[workload].name,
        "num_requests": len(requests), "seed": args.seed, "arrival": arrival,
        "scale": asdict(scale), "scale_text": scale.describe(),
        "prompt": length_stats([r.prompt_len for r in requests]),
        "output": length_stats([r.output_len for r in requests]),
        "model": str(model_dir), "dtype": model_dtype(model_dir), "device": args.device,
        "env": environment(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }
    if WORKLOADS[workload].kind == "mooncake":
        meta["mooncake_block_tokens"] = args.mooncake_block
        meta["ideal_prefix_hit_rate"] = ideal_prefix_hit_rate(items, args.mooncake_block)
    return meta


_ARGV: list[str] = []


def command_line() -> str:
    """The command that made a result, as a person would type it."""
    return "python -m bench " + " ".join(shlex.quote(a) for a in _ARGV)


def workload_line(meta: dict) -> str:
    return (f"Workload: {meta['trace_name']}, first {meta['num_requests']} requests, "
            f"{meta['arrival']}; {meta['scale_text']}. Prompt tokens {meta['prompt']['sum']} "
            f"(mean {meta['prompt']['mean']:.0f}, max {meta['prompt']['max']}), output tokens "
            f"{meta['output']['sum']} (mean {meta['output']['mean']:.0f}, max "
            f"{meta['output']['max']}). Model {meta['model']} ({meta['dtype']}), "
            f"{meta['env']['cores']} cores (load average {meta['env'].get('load_average')} at "
            f"start), seed {meta['seed']}.")


def server_flags(args) -> list[str]:
    """--server-option KEY=VALUE (repeatable) as flags for both seqserve processes."""
    flags = []
    for opt in getattr(args, "server_option", None) or ():
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise SystemExit(f"--server-option wants KEY=VALUE, got {opt!r}")
        flags += [f"--{key.strip().replace('_', '-')}", value.strip()]
    return flags


def _slo(args) -> Slo | None:
    slo = Slo(args.goodput_ttft_ms, args.goodput_tpot_ms, args.goodput_e2e_ms)
    return slo if slo else None


# --------------------------------------------------------------------------------------------
# Issue 2: throughput vs HF static batches
# --------------------------------------------------------------------------------------------


def throughput_report(meta: dict, seq: dict, hf: dict | None, out_dir: Path) -> dict:
    ratio_hf = seq["output_throughput"] / hf["output_throughput"] if hf else None
    result = {"benchmark": "throughput", "workload": meta, "seqserve": seq, "hf": hf,
              "ratio_seqserve_over_hf": ratio_hf}
    c = seq["config"]
    rows = [["seqserve", f"max_sparsity {c['max_sparsity']:g}, max_splits {c['max_splits']}, "
             f"max_rolling_batch_size {c['max_rolling_batch_size']}",
             _f(seq["duration_s"], 2), seq["output_tokens"], _f(seq["output_throughput"]),
             _f(seq["request_throughput"], 2)]]
    if hf:
        rows.append(["HF generate", f"static batches of {hf['config']['batch_size']}, left "
                     f"padding, {hf['config']['torch_threads']} torch threads",
                     _f(hf["duration_s"], 2), hf["output_tokens"], _f(hf["output_throughput"]),
                     _f(hf["request_throughput"], 2)])
    md = "\n\n".join([
        "## Offline throughput: seqserve vs Hugging Face generate",
        workload_line(meta),
        md_table(["system", "configuration", "duration s", "output tokens", "output tokens/s",
                  "requests/s"], rows),
        (f"**seqserve / HF output tokens/s: {ratio_hf:.2f}x** ({meta['scale_text']})"
         if ratio_hf else "HF baseline skipped (--no-hf)."),
        "seqserve latency (ms, vLLM definitions):",
        md_table(LATENCY_HEADER, latency_rows(seq)),
    ])
    write(out_dir, "throughput", result, md)
    print(md, flush=True)
    return result


def run_seqserve_offline(args, model_dir, requests, tokenizer, meta, name: str,
                         slo: Slo | None = None) -> dict:
    profile = Path(args.out) / "profile" / name if getattr(args, "profile", False) else None
    return bench_seqserve(model_dir, requests, tokenizer, max_sparsity=args.max_sparsity,
                          max_splits=args.max_splits,
                          max_rolling_batch_size=args.max_rolling_batch_size,
                          logdir=Path(args.out) / "logs" / name, dtype=meta["dtype"],
                          device=args.device, slo=slo, profile_dir=profile,
                          poll_interval=1.0, server_flags=server_flags(args))  # the peak gauge is not reported here: poll less


def cmd_throughput(args, prepared=None) -> dict:
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    seq = run_seqserve_offline(args, model_dir, requests, tokenizer, meta, "throughput")
    hf = None if args.no_hf else bench_hf(model_dir, requests, batch_size=args.hf_batch_size,
                                           threads=args.hf_threads, device=args.device)
    return throughput_report(meta, seq, hf, Path(args.out))


# --------------------------------------------------------------------------------------------
# Issue 3: max_sparsity x max_splits sweep, partition timing
# --------------------------------------------------------------------------------------------


def cmd_sweep(args, prepared=None) -> dict:
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
                server_flags=server_flags(args))
            summary.pop("per_request")
            result["runs"].append(summary)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "sweep.partial.json").write_text(report.to_json(result))

    def run(s: float, k: int) -> dict | None:
        return next((r for r in result["runs"] if r["config"]["max_sparsity"] == s
                     and r["config"]["max_splits"] == k), None)

    ref, base = run(*REFERENCE_POINT), run(REFERENCE_POINT[0], 1)
    if ref and base:
        result["reference"] = {
            "point": {"max_sparsity": REFERENCE_POINT[0], "max_splits": REFERENCE_POINT[1]},
            "peak_padded_slots_ratio_to_splits_1": ratio(
                ref["server"]["peak_kv_padded_slots"], base["server"]["peak_kv_padded_slots"]),
            "throughput_ratio_to_splits_1":
                ratio(ref["output_throughput"], base["output_throughput"]),
        }
    rows = [[_f(r["config"]["max_sparsity"], 2), r["config"]["max_splits"],
             _f(r["output_throughput"]), _f(r["duration_s"], 2),
             _f(r["server"]["peak_kv_padded_slots"], 0), _f(r["server"]["mean_batch_sparsity"], 3),
             _f(r["server"]["mean_batch_splits"], 2), _f(r["server"]["regroup_bytes"] / 2**20, 1),
             _f(r["tpot"]["median_ms"])] for r in result["runs"]]
    parts = ["## max_sparsity x max_splits sweep", workload_line(meta),
             md_table(["max_sparsity", "max_splits", "output tokens/s", "duration s",
                       "peak padded KV slots", "mean sparsity", "mean splits",
                       "regroup MiB", "median TPOT ms"], rows)]
    if "reference" in result:
        r = result["reference"]
        parts.append(f"**At max_sparsity {REFERENCE_POINT[0]:g}, max_splits "
                     f"{REFERENCE_POINT[1]} vs max_splits 1:** peak padded KV slots x"
                     f"{_f(r['peak_padded_slots_ratio_to_splits_1'], 3)}, output tokens/s x"
                     f"{_f(r['throughput_ratio_to_splits_1'], 3)} ({meta['scale_text']}).")
    if args.plot:
        report.plot_sweep(result, Path(args.plot))
        result["plot"] = str(args.plot)
        parts.append(f"![sweep]({os.path.relpath(Path(args.plot).resolve(), out_dir.resolve())})")
    md = "\n\n".join(parts)
    write(out_dir, "sweep", result, md)
    (out_dir / "sweep.partial.json").unlink(missing_ok=True)
    print(md, flush=True)
    return result


def cmd_partition(args) -> dict:
    from scheduler_service.partition import plan_partition

    rng = random.Random(args.seed)
    lengths = [rng.randint(1, 2048) for _ in range(512)]
    rows, result = [], {"benchmark": "partition", "n": 512, "length_range": [1, 2048],
                        "max_splits": 8, "seed": args.seed, "repeats": args.repeats, "runs": []}
    for s in (0.33, 0.0):
        part = plan_partition(lengths, max_sparsity=s, max_splits=8)
        timer = timeit.Timer(lambda s=s: plan_partition(lengths, max_sparsity=s, max_splits=8))
        number, total = timer.autorange()
        number = max(1, round(number * 0.02 / total))  # about 20 ms a repeat
        times = [t / number for t in timer.repeat(repeat=args.repeats, number=number)]
        run = {"max_sparsity": s, "median_ms": 1000 * percentile(times, 50),
               "min_ms": 1000 * min(times), "calls_per_repeat": number,
               "splits": part.num_splits, "sparsity": part.sparsity}
        result["runs"].append(run)
        rows.append([f"{s:g}", run["splits"], f"{run['sparsity']:.4f}", f"{run['median_ms']:.3f}",
                     f"{run['min_ms']:.3f}"])
    md = "\n\n".join([
        "## plan_partition time",
        f"512 random lengths in [1, 2048] (seed {args.seed}), max_splits 8; median of "
        f"{args.repeats} repeats (timeit).",
        md_table(["max_sparsity", "groups", "sparsity", "median ms", "min ms"], rows)])
    import platform

    result["env"] = {"python": platform.python_version(), "cores": machine_cores()}
    write(Path(args.out), "partition", result, md)
    print(md, flush=True)
    return result


# --------------------------------------------------------------------------------------------
# Issue 5: prefix cache
# --------------------------------------------------------------------------------------------


CACHE_OFF = ("--prompt-cache-bytes", "0")


def _cache_on_and_off(args, model_dir: Path, tokenizer, part: str, on_name: str):
    """Yield (name, started deployment) with the prefix cache on, then off; each deployment
    stops when the caller asks for the next one."""
    for name, flags in ((on_name, ()), ("cache_off", CACHE_OFF)):
        with SeqserveTarget(model_dir, tokenizer, logdir=Path(args.out) / "logs" / f"{part}-{name}",
                            dtype=model_dtype(model_dir), device=args.device, worker_flags=flags,
                            max_rolling_batch_size=args.max_rolling_batch_size,
                            server_flags=server_flags(args)) as target:
            yield name, target


def cached_prompt_requests(tokenizer, cached_tokens: int, input_tokens: int, n: int,
                           output_len: int, seed: int) -> list[BenchRequest]:
    """n + 1 requests (the first is the warm-up) sharing one `cached_prompt` of `cached_tokens`
    tokens, each with its own input of `input_tokens` tokens; prompt_ids are the whole prompt."""
    rng = random.Random(seed)
    safe = round_trip_tokens(tokenizer)
    cached_text, cached_ids = make_prompt(tokenizer, cached_tokens, rng, safe)
    out = []
    for i in range(n + 1):
        text, ids = make_prompt(tokenizer, input_tokens, rng, safe)
        full = tokenizer(cached_text + text).input_ids
        if full != cached_ids + ids:
            raise AssertionError("cached_prompt + input does not tokenize to the two id lists")
        out.append(BenchRequest(i - 1, text, full, output_len, cached_prompt=cached_text))
    return out


def _cached_prompt_part(args, model_dir: Path, tokenizer) -> dict:
    reqs = cached_prompt_requests(tokenizer, args.cached_tokens, args.input_tokens,
                                  args.prefix_requests, args.prefix_output, args.seed)
    runs = {}
    for name, target in _cache_on_and_off(args, model_dir, tokenizer, "prefix", "cache_warm"):
        target.run(reqs[:1], sequential=True)  # fills the cache (when it is on)
        s = target.run(reqs[1:], sequential=True)
        ttfts = [r["ttft_s"] for r in s["per_request"]]
        runs[name] = {"ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts),
                      "ttft_median_ms": 1000 * percentile(ttfts, 50),
                      "cached_tokens": [r["cached_tokens"] for r in s["per_request"]],
                      "prompt_tokens": reqs[1].prompt_len, "summary": s}
        logger.info("cached_prompt %s: TTFT mean %.1f ms, median %.1f ms, cached tokens %s",
                    name, runs[name]["ttft_mean_ms"], runs[name]["ttft_median_ms"],
                    sorted(set(runs[name]["cached_tokens"])))
    w, o = runs["cache_warm"], runs["cache_off"]
    return {"cached_prompt_tokens": args.cached_tokens, "input_tokens": args.input_tokens,
            "requests": args.prefix_requests, "output_tokens": args.prefix_output,
            "order": "one at a time, after one warm-up request with the same cached_prompt",
            "runs": runs,
            "ttft_ratio_mean": w["ttft_mean_ms"] / o["ttft_mean_ms"],
            "ttft_ratio_median": w["ttft_median_ms"] / o["ttft_median_ms"], "aim": 0.3}


def select_conversations(path: Path, n: int, scale: Scale) -> list[TraceItem]:
    """n requests of whole conversations: requests grouped by their first block after the
    shared block 0 (hash_ids[1]); groups of two or more taken in order of first appearance
    until n requests; returned in trace order (timestamps kept)."""
    rows = load_mooncake(path, sum(1 for line in open(path) if line.strip()), scale)
    groups: dict[int, list[TraceItem]] = {}
    for it in rows:
        if len(it.hash_ids) > 1:
            groups.setdefault(it.hash_ids[1], []).append(it)
    chosen: list[TraceItem] = []
    for members in groups.values():
        if len(members) > 1 and len(chosen) < n:
            chosen += members
    chosen = sorted(chosen, key=lambda it: it.index)[:n]
    return [TraceItem(i, it.trace_prompt, it.trace_output, it.prompt_len, it.output_len,
                      it.arrival_s, it.hash_ids) for i, it in enumerate(chosen)]


def _mooncake_part(args, tokenizer) -> dict:
    model_dir = ensure_model(Path(args.mooncake_model or args.model))
    from transformers import AutoTokenizer

    tok = tokenizer if model_dir == Path(args.model) else AutoTokenizer.from_pretrained(model_dir)
    scale = mooncake_scale(args.mooncake_block, model_context(model_dir) or 2048,
                           args.mooncake_max_output)
    path = WORKLOADS["mooncake"].path
    if args.mooncake_select == "conversations":
        items = select_conversations(path, args.mooncake_requests, scale)
    else:
        items = load_mooncake(path, args.mooncake_requests, scale)
    _check_context(model_dir, items)
    requests = build_workload_requests(tok, "mooncake", items, args.seed, args.mooncake_block)
    if args.mooncake_arrival == "trace":
        offsets = trace_arrivals(items, args.mooncake_speedup)
    else:
        offsets = [0.0] * len(items)
    arrival = describe_arrivals(args.mooncake_arrival, speedup=args.mooncake_speedup,
                                max_concurrency=args.mooncake_max_concurrency)
    meta = workload_meta(args, model_dir, "mooncake", path, items, requests, scale, arrival)
    meta["selection"] = args.mooncake_select
    runs = {}
    for name, target in _cache_on_and_off(args, model_dir, tok, "mooncake", "cache_on"):
        s = target.run(requests, offsets, args.mooncake_max_concurrency)
        sent = s["input_tokens"]
        s["prefix_hit_rate_worker"] = s["worker"]["prefix_cache_hit_tokens"] / sent
        s["prefix_hit_rate_scheduler"] = s["server"]["prefix_cache_hit_tokens"] / sent
        s["prefix_hit_rate_replies"] = s["cached_tokens"] / sent
        runs[name] = s
        logger.info("mooncake %s: hit rate %.3f (worker), %.1f output tokens/s in %.1f s", name,
                    s["prefix_hit_rate_worker"], s["output_throughput"], s["duration_s"])
    return {"workload": meta, "runs": runs,
            "output_throughput_ratio_on_over_off":
                runs["cache_on"]["output_throughput"] / runs["cache_off"]["output_throughput"],
            "ttft_mean_ratio_on_over_off":
                runs["cache_on"]["ttft"]["mean_ms"] / runs["cache_off"]["ttft"]["mean_ms"]}


def cmd_prefix(args) -> dict:
    from transformers import AutoTokenizer

    model_dir = ensure_model(Path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = set(args.prefix_parts)
    result: dict = {"benchmark": "prefix", "model": str(model_dir),
                    "dtype": model_dtype(model_dir), "env": environment(),
                    "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": command_line()}
    md = ["## Prefix cache (issue 5)"]
    if "cached" in parts:
        c = result["cached_prompt"] = _cached_prompt_part(args, model_dir, tokenizer)
        w, o = c["runs"]["cache_warm"], c["runs"]["cache_off"]
        md += [f"### cached_prompt: time to first token, cache warm vs off\n\n"
               f"Model {model_dir} ({result['dtype']}); a {c['cached_prompt_tokens']}-token "
               f"`cached_prompt` (the same text every request) and {c['input_tokens']}-token "
               f"distinct inputs, {c['requests']} requests one at a time after one warm-up "
               f"request, {c['output_tokens']} output tokens each; cache off = worker started "
               f"with `--prompt-cache-bytes 0`. Load average at start "
               f"{result['env'].get('load_average')}.",
               md_table(["cache", "prompt tokens", "cached tokens (final message)",
                         "TTFT mean ms", "TTFT median ms"],
                        [["warm", w["prompt_tokens"], _spread(w["cached_tokens"]),
                          _f(w["ttft_mean_ms"]), _f(w["ttft_median_ms"])],
                         ["off", o["prompt_tokens"], _spread(o["cached_tokens"]),
                          _f(o["ttft_mean_ms"]), _f(o["ttft_median_ms"])]]),
               f"**TTFT warm / off: {c['ttft_ratio_mean']:.3f} (means), "
               f"{c['ttft_ratio_median']:.3f} (medians)**; aim <= {c['aim']}."]
    if "mooncake" in parts:
        m = result["mooncake"] = _mooncake_part(args, tokenizer)
        meta, on, off = m["workload"], m["runs"]["cache_on"], m["runs"]["cache_off"]

        def row(name: str, s: dict) -> list:
            return [name, _f(100 * s["prefix_hit_rate_worker"]),
                    _f(100 * s["prefix_hit_rate_scheduler"]), _f(s["output_throughput"]),
                    _f(s["total_token_throughput"]), _f(s["duration_s"], 2),
                    _f(s["ttft"]["mean_ms"]), _f(s["ttft"]["p99_ms"])]

        md += ["### Mooncake conversation trace replay: cache on vs off\n\n"
               + workload_line(meta) + f" Blocks of 512 tokens scaled to "
               f"{meta['mooncake_block_tokens']}; selection: {meta['selection']}. An unbounded "
               f"cache replaying these requests one by one could serve "
               f"{100 * meta['ideal_prefix_hit_rate']:.1f}% of the prompt tokens.",
               md_table(["cache", "hit rate % (worker)", "hit rate % (scheduler)",
                         "output tokens/s", "total tokens/s", "duration s", "TTFT mean ms",
                         "TTFT p99 ms"], [row("on", on), row("off", off)]),
               f"**Output tokens/s on / off: {m['output_throughput_ratio_on_over_off']:.3f}; "
               f"TTFT mean on / off: {m['ttft_mean_ratio_on_over_off']:.3f}.** Hit rate = "
               f"seqserve_worker_prefix_cache_hit_tokens_total (or the scheduler's "
               f"seqserve_prefix_cache_hit_tokens_total) growth / prompt tokens sent."]
    text = "\n\n".join(md)
    write(Path(args.out), "prefix", result, text)
    print(text, flush=True)
    return result


def _spread(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


# --------------------------------------------------------------------------------------------
# Issue 7: peers, ceiling, load generator and rate sweep
# --------------------------------------------------------------------------------------------


def _peers(args) -> list[str]:
    return [p for p in args.peers if p in PEERS]


def cmd_peers(args, prepared=None) -> dict:
    """All at once: seqserve and each peer on the same requests; ratios; the ceiling."""
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    out_dir, slo = Path(args.out), _slo(args)
    peers = _peers(args)
    result: dict = {"benchmark": "peers", "workload": meta, "slo": slo.describe() if slo else None}
    seq = result["seqserve"] = run_seqserve_offline(args, model_dir, requests, tokenizer, meta,
                                                    "peers", slo)
    systems: dict[str, dict] = {}
    if "hf" in peers:
        systems["hf"] = bench_hf(model_dir, requests, batch_size=args.hf_batch_size,
                                 threads=args.hf_threads, device=args.device)
    if "hf-cb" in peers:
        try:
            systems["hf-cb"] = bench_hf_cb(model_dir, requests, threads=args.hf_threads,
                                           device=args.device, slo=slo)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is reported, not fatal
            logger.exception("transformers continuous batching failed")
            systems["hf-cb"] = {"skipped": f"transformers continuous batching failed: {exc!r}"}
    if "vllm" in peers:
        raw = run_vllm(model_dir, [{"name": "all-at-once", "requests": requests}], mode="offline",
                       workdir=out_dir / "logs" / "peers", **_vllm_kwargs(args))
        systems["vllm"] = raw if "skipped" in raw else vllm_summary(raw, 0, requests, slo)
    result["peers"] = systems
    if not args.no_ceiling:
        result["ceiling"] = run_ceiling(model_dir, requests, seq["server"]["mean_batch_size"],
                                        seq["output_throughput"], device=args.device,
                                        threads=args.hf_threads)
    result["ratios"] = {name: ratio(seq["output_throughput"], s.get("output_throughput"))
                        for name, s in systems.items()}
    md = peers_markdown(result)
    cdf_runs = {"seqserve": seq, **{PEER_NAMES[k]: v for k, v in systems.items()
                                    if v.get("per_request") and "ttft" in v}}
    if args.plot_dir:
        path = Path(args.plot_dir) / "peers-cdf.png"
        report.plot_cdfs(cdf_runs, path, f"{meta['num_requests']} {meta['workload']} requests "
                         f"all at once; {Path(meta['model']).name} ({meta['dtype']})")
        result["plots"] = [str(path)]
        md += f"\n\n![latency CDFs]({os.path.relpath(path.resolve(), out_dir.resolve())})"
    write(out_dir, "peers", result, md)
    print(md, flush=True)
    if "hf" in systems and not args.no_throughput_report:
        throughput_report(meta, seq, systems["hf"], out_dir)  # issue 2's figure, same run
    return result


def _vllm_kwargs(args) -> dict:
    return {"max_num_seqs": args.max_rolling_batch_size, "kv_space_gib": args.vllm_kv_gib,
            "threads_bind": args.vllm_threads_bind, "enforce_eager": args.vllm_enforce_eager,
            "preload": args.vllm_preload}


def peers_markdown(result: dict) -> str:
    meta, seq = result["workload"], result["seqserve"]
    rows = [["seqserve", _f(seq["duration_s"], 2), seq["output_tokens"],
             _f(seq["output_throughput"]), "1.00"]]
    notes = []
    for name, s in result["peers"].items():
        if "skipped" in s:
            notes.append(f"- {PEER_NAMES[name]}: {s['skipped']}")
            rows.append([PEER_NAMES[name], "skipped", "", "", ""])
            continue
        rows.append([PEER_NAMES[name], _f(s["duration_s"], 2), s["output_tokens"],
                     _f(s["output_throughput"]), _f(result["ratios"][name], 2)])
    parts = ["## seqserve and its peers, all requests at once (issue 7)", workload_line(meta),
             md_table(["system", "duration s", "output tokens", "output tokens/s",
                       "seqserve / system"], rows)]
    parts += notes
    lat = [["seqserve", *r] for r in latency_rows(seq)]
    for name, s in result["peers"].items():
        if "ttft" in s:
            lat += [[PEER_NAMES[name], *r] for r in latency_rows(s)]
    parts += ["Latency (ms, vLLM definitions; only systems that stream per-token times):",
              md_table(["system", *LATENCY_HEADER], lat)]
    if seq.get("goodput"):
        g = seq["goodput"]
        parts.append(f"seqserve goodput ({g['slo']}): {g['request_goodput']:.2f} requests/s, "
                     f"{100 * g['good_fraction']:.0f}% of requests.")
    if "ceiling" in result:
        c = result["ceiling"]
        fw = c["forward"]
        parts.append(
            f"**Forward-pass ceiling:** a plain forward of the model ({fw['attn_implementation']}"
            f" attention, {fw['torch_threads']} threads) decodes batch {fw['batch']} at context "
            f"{fw['context']} in {fw['decode_step_ms']:.1f} ms ({fw['decode_tokens_per_s']:.0f} "
            f"tokens/s; median {fw['decode_step_ms_median']:.1f} ms) and prefills "
            f"{fw['prefill_batch']} x {fw['prompt_len']} tokens at "
            f"{fw['prefill_tokens_per_s']:.0f} tokens/s (fastest of {fw['repeats']} repeats); "
            f"for this run's {c['prompt_tokens']} "
            f"prompt and {c['decode_tokens']} decode tokens that is "
            f"{c['ceiling_output_throughput']:.1f} output tokens/s. **seqserve reaches "
            f"{100 * c['fraction_of_ceiling']:.0f}% of it.**")
    s = seq.get("server", {}).get("step_seconds")
    w = seq.get("worker")
    if s and w:
        parts.append(
            "Where seqserve's time goes (summed over the run's steps, s): scheduler plan "
            f"{s['plan']:.2f}, RPC {s['rpc']:.2f}, worker {s['worker']:.2f} (forward "
            f"{w['forward_s']:.2f}, sampling {w['sampling_s']:.2f}, regroup {w['regroup_s']:.2f}),"
            f" postprocess {s['postprocess']:.2f}; run duration {seq['duration_s']:.2f} s.")
    profile = dict(seq.get("profile") or {})
    if "skipped" in profile:
        parts.append(f"py-spy: {profile['skipped']}")
        profile = {}
    if "run" in profile:
        r = profile.pop("run")
        parts.append(f"Profile (py-spy at 100 Hz on a second run of the same shape with fresh "
                     f"prompts, {r['output_throughput']:.1f} output tokens/s while sampled):")
    for proc, prof in profile.items():
        if "skipped" in prof:
            parts.append(f"py-spy, {proc}: {prof['skipped']}")
            continue
        rows = [[name, f"{100 * share:.1f}"] for name, share in prof["self"][:10]]
        incl = [[name, f"{100 * share:.1f}"] for name, share in prof["inclusive"][:10]]
        parts += [f"py-spy, {proc} ({prof['samples']} busy samples): frames holding the most "
                  f"samples, self time and (seqserve code) inclusive time",
                  md_table(["frame (self)", "%"], rows),
                  md_table(["seqserve frame (inclusive)", "%"], incl)]
    return "\n\n".join(parts)


def knee(points: Sequence[dict], factor: float = 2.0, keep_up: float = 0.9) -> float | None:
    """The highest offered rate up to which the system kept up and p99 E2E stayed within
    `factor` x its value at the lowest rate. Keeping up: achieved requests/s >= `keep_up` x
    n / (arrival span + the lowest rate's mean E2E), what the system achieves when requests
    do not queue. None when even the lowest rate fails."""
    pts = sorted(points, key=lambda p: p["rate"])
    if not pts:
        return None
    base = pts[0]["summary"]["e2e"]
    best = None
    for p in pts:
        s = p["summary"]
        span = p.get("arrival_span_s") or s["completed"] / p["rate"]
        unqueued = s["completed"] / (span + base["mean_ms"] / 1000)
        if (s["request_throughput"] >= keep_up * unqueued
                and s["e2e"]["p99_ms"] <= factor * base["p99_ms"]):
            best = p["rate"]
        else:
            break
    return best


def realized_rate(offsets: Sequence[float]) -> float:
    """Arrivals per second the offsets actually carry: (n - 1) / span."""
    span = max(offsets) - min(offsets)
    return (len(offsets) - 1) / span if span > 0 else float("inf")


def cmd_serve(args, prepared=None) -> dict:
    """Load generator: one run (all at once, Poisson at --rate, trace timestamps) or a Poisson
    rate sweep (--rates), for seqserve and, with --peers vllm, vLLM on the same requests."""
    out_dir, slo = Path(args.out), _slo(args)
    if args.rates is not None and args.arrival != "poisson":
        raise SystemExit("--rates sweeps Poisson arrivals: add --arrival poisson")
    if args.arrival == "poisson" and args.rates is None and not args.rate:
        raise SystemExit("--arrival poisson needs --rate R or --rates R1,R2,... | auto")
    model_dir, requests0, tokenizer, meta = prepared or prepare(args)
    scale = Scale(**meta["scale"])
    items = load_workload(args.workload, args.num_requests, scale,
                          args.trace if args.trace else None)
    want_vllm = "vllm" in _peers(args)
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
                            server_flags=server_flags(args))
    points: list[dict] = []
    with target:
        if sweep:
            rates = list(args.rates)
            if not rates:  # auto: fractions of seqserve's offline request throughput
                cap = target.run(requests0, slo=slo)
                result["capacity_run"] = _strip(cap)
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
                       mode="serve", workdir=out_dir / "logs" / "serve", **_vllm_kwargs(args))
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
                          "rule": "highest offered rate up to which the system keeps up "
                                  "(achieved >= 90% of n / (arrival span + the lowest rate's "
                                  "mean E2E)) with p99 E2E <= 2x its value at the lowest rate"}
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
            report.plot_load_sweep(series, p, title)
            plots.append(p)
        cdfs = {f"{name} {pt['label']}": pt["summary"] for name, pts in series.items()
                for pt in pts}
        p = Path(args.plot_dir) / f"serve-{args.workload}-cdf.png"
        report.plot_cdfs(cdfs, p, title)
        plots.append(p)
        result["plots"] = [str(p) for p in plots]
        md += "".join(f"\n\n![{p.stem}]({os.path.relpath(p.resolve(), out_dir.resolve())})"
                      for p in plots)
    write(out_dir, f"serve-{args.workload}", result, md)
    print(md, flush=True)
    return result


def _strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "per_request"}


def serve_markdown(result: dict) -> str:
    meta = result["workload"]
    parts = [f"## Load generator: {meta['workload']}",
             workload_line({**meta, "arrival": "arrivals per row below"})]
    if result.get("slo"):
        parts.append(f"Goodput limits: {result['slo']}.")
    header = ["system", "arrivals", "offered req/s", "realized req/s", "achieved req/s",
              "output tok/s",
              "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "E2E p50 / p99 ms"]
    if result.get("slo"):
        header.append("goodput req/s")
    rows = []
    for name, pts in (("seqserve", result["seqserve"]), ("vLLM CPU", result["vllm"])):
        for p in pts:
            s = p["summary"]
            row = [name, p["label"], _f(p["offered_rate"], 2) if p["offered_rate"] else "inf",
                   _f(p.get("realized_rate"), 2) if p.get("realized_rate") not in (
                       None, float("inf")) else "inf",
                   _f(s["request_throughput"], 2), _f(s["output_throughput"]),
                   f"{_f(s['ttft']['median_ms'])} / {_f(s['ttft']['p99_ms'])}",
                   f"{_f(s['tpot']['median_ms'])} / {_f(s['tpot']['p99_ms'])}",
                   f"{_f(s['itl']['median_ms'])} / {_f(s['itl']['p99_ms'])}",
                   f"{_f(s['e2e']['median_ms'])} / {_f(s['e2e']['p99_ms'])}"]
            if result.get("slo"):
                row.append(_f(s.get("goodput", {}).get("request_goodput"), 2))
            rows.append(row)
    parts.append(md_table(header, rows))
    if result.get("vllm_skipped"):
        parts.append(f"vLLM: {result['vllm_skipped']}")
    if result["seqserve"] and result["vllm"]:
        rr = [[p["label"], _f(ratio(p["summary"]["output_throughput"],
                                    v["summary"]["output_throughput"]), 2),
               _f(ratio(p["summary"]["e2e"]["p99_ms"], v["summary"]["e2e"]["p99_ms"]), 2)]
              for p, v in zip(result["seqserve"], result["vllm"])]
        parts += ["seqserve / vLLM:", md_table(["arrivals", "output tok/s ratio",
                                                "p99 E2E ratio (lower is better)"], rr)]
    if "knee" in result:
        k = result["knee"]
        def rate(x):
            return "not reached at any rate" if x is None else f"{x:g} requests/s"

        parts.append(f"Knee ({k['rule']}): seqserve {rate(k['seqserve'])}"
                     + (f", vLLM {rate(k['vllm'])}." if result["vllm"] else "."))
    return "\n\n".join(parts)


def cmd_ceiling(args) -> dict:
    """The forward-pass ceiling alone, at given shapes (see bench/ceiling.py)."""
    from bench.ceiling import forward_ceiling

    model_dir = ensure_model(Path(args.model))
    out = forward_ceiling(model_dir, batch=args.batch, context=args.context,
                          prompt_len=args.prompt_len, prefill_batch=args.prefill_batch,
                          device=args.device, threads=args.hf_threads, repeats=args.repeats)
    out["model"], out["env"], out["command"] = str(model_dir), environment(), command_line()
    md = "\n\n".join(["## Forward-pass ceiling", md_table(
        ["model", "decode batch x context", "ms/step (min / median)", "decode tokens/s",
         "prefill batch x tokens", "prefill tokens/s"],
        [[f"{model_dir} ({out['dtype']})", f"{out['batch']} x {out['context']}",
          f"{out['decode_step_ms']:.1f} / {out['decode_step_ms_median']:.1f}",
          f"{out['decode_tokens_per_s']:.0f}", f"{out['prefill_batch']} x {out['prompt_len']}",
          f"{out['prefill_tokens_per_s']:.0f}"]])])
    write(Path(args.out), "ceiling", out, md)
    print(md, flush=True)
    return out


def cmd_all(args) -> dict:
    """Every figure of docs/benchmarks.md: peers (with issue 2's throughput table), the sweep,
    partition timing, the prefix cache, and the Poisson rate sweep with vLLM."""
    prepared = prepare(args)
    out = {"peers": cmd_peers(args, prepared), "sweep": cmd_sweep(args, prepared),
           "partition": cmd_partition(args), "prefix": cmd_prefix(args)}
    if args.rates is None:
        args.rates = []  # auto rates
    args.arrival = "poisson"
    out["serve"] = cmd_serve(args, prepared)
    return out


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    """'auto' (empty list: fractions of the offline request rate) or comma-separated rates."""
    return [] if text.strip() == "auto" else _floats(text)


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    bad = set(names) - set(PEERS)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {sorted(bad)}; choose from {PEERS}")
    return names


def build_parser(doc: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("workload and output")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help=f"model directory (default {DEFAULT_MODEL}; made if missing)")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default="azure-conv",
                   help="trace (azure-conv)")
    g.add_argument("--trace", type=Path, default=None,
                   help="trace file (default: the workload's copy in bench/data/)")
    g.add_argument("--num-requests", type=int, default=64, help="first N trace rows (64)")
    g.add_argument("--prompt-scale", type=float, default=0.25, help="Azure prompt scale (0.25)")
    g.add_argument("--max-prompt", type=int, default=512, help="Azure prompt cap (512)")
    g.add_argument("--output-scale", type=float, default=0.5, help="Azure output scale (0.5)")
    g.add_argument("--max-output", type=int, default=None,
                   help="output cap (128 for Azure, 32 for Mooncake)")
    g.add_argument("--mooncake-block", type=int, default=32,
                   help="tokens per Mooncake hash block (512 in the trace; lengths scale alike)")
    g.add_argument("--seed", type=int, default=0, help="prompt token and arrival seed")
    g.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="directory for JSON, markdown and server logs (bench-results/)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="worker and in-process peer device (auto: cuda when torch sees it)")
    g.add_argument("--max-rolling-batch-size", type=int, default=64,
                   help="seqserve's batch limit, and vLLM's max_num_seqs (64)")
    g.add_argument("--server-option", action="append", metavar="KEY=VALUE",
                   help="any seqserve serving option for both processes, e.g. "
                        "max_prefill_tokens=2048 (repeatable)")
    g.add_argument("--log-level", default="INFO")

    srv = argparse.ArgumentParser(add_help=False)
    g = srv.add_argument_group("seqserve configuration")
    g.add_argument("--max-sparsity", type=float, default=0.33)
    g.add_argument("--max-splits", type=int, default=3)

    hf = argparse.ArgumentParser(add_help=False)
    g = hf.add_argument_group("HF peers")
    g.add_argument("--hf-batch-size", type=int, default=16)
    g.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads for the in-process peers and the ceiling (all cores)")
    g.add_argument("--no-hf", action="store_true", help="throughput: skip the HF baseline")

    slo = argparse.ArgumentParser(add_help=False)
    g = slo.add_argument_group("goodput (vLLM: a request is good when it meets every limit)")
    g.add_argument("--goodput-ttft-ms", type=float, default=None)
    g.add_argument("--goodput-tpot-ms", type=float, default=None)
    g.add_argument("--goodput-e2e-ms", type=float, default=None)

    prs = argparse.ArgumentParser(add_help=False)
    g = prs.add_argument_group("peers and vLLM")
    g.add_argument("--peers", type=_names, default=list(PEERS),
                   help="comma-separated peers: hf, hf-cb, vllm, or none (all three); the "
                        "serve command runs vllm only")
    g.add_argument("--no-ceiling", action="store_true", help="skip the forward-pass ceiling")
    g.add_argument("--profile", action="store_true",
                   help="peers: after seqserve's measured run, sample the worker and scheduler "
                        "with py-spy during a second run (collapsed stacks in OUT/profile/, "
                        "top frames in the report)")
    g.add_argument("--no-throughput-report", action="store_true",
                   help="peers: do not also write throughput.json/md (issue 2's table)")
    g.add_argument("--vllm-kv-gib", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE in GiB (4, as seqserve's kv_cache_bytes)")
    g.add_argument("--vllm-threads-bind", default="all",
                   help="'all' (OpenMP threads on every core, none reserved), 'auto' "
                        "(vLLM's default: reserves a core), or a VLLM_CPU_OMP_THREADS_BIND list")
    g.add_argument("--vllm-enforce-eager", action="store_true",
                   help="vLLM without torch.compile")
    g.add_argument("--vllm-preload", action="store_true",
                   help="LD_PRELOAD libiomp5 (from the peer venv) and libtcmalloc (where "
                        "installed) for vLLM, as its CPU guide advises")
    g.add_argument("--plot-dir", default="docs", help="PNG directory ('' for none)")

    load = argparse.ArgumentParser(add_help=False)
    g = load.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=ARRIVALS, default="all",
                   help="all at once, Poisson (--rate / --rates, seeded), or the trace's "
                        "timestamps / --speedup")
    g.add_argument("--rate", type=float, default=None, help="Poisson rate, requests/s")
    g.add_argument("--rates", type=_rates, default=None,
                   help="Poisson rate sweep: comma-separated requests/s, or 'auto' (fractions "
                        "of seqserve's offline request rate, --rate-fractions)")
    g.add_argument("--rate-fractions", type=_floats, default=list(RATE_FRACTIONS),
                   help="auto sweep fractions (0.25,0.5,0.75,0.9,1.1,1.5)")
    g.add_argument("--speedup", type=float, default=1.0, help="trace arrivals: time / speedup")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--address", default=None,
                   help="serve: load a running scheduler at host:port instead of starting one")
    g.add_argument("--metrics-url", default=None,
                   help="serve --address: its scheduler's /metrics URL, for server figures")

    swp = argparse.ArgumentParser(add_help=False)
    g = swp.add_argument_group("sweep")
    g.add_argument("--sparsities", type=_floats, default=list(SWEEP_SPARSITIES),
                   help="comma-separated max_sparsity values (0,0.1,0.33,0.6,0.9)")
    g.add_argument("--splits", type=_ints, default=list(SWEEP_SPLITS),
                   help="comma-separated max_splits values (1,2,3,4,8)")
    g.add_argument("--plot", default="docs/sweep.png", help="PNG path ('' for none)")

    prt = argparse.ArgumentParser(add_help=False)
    g = prt.add_argument_group("partition")
    g.add_argument("--repeats", type=int, default=201, help="timeit repeats (201)")

    pfx = argparse.ArgumentParser(add_help=False)
    g = pfx.add_argument_group("prefix cache (issue 5)")
    g.add_argument("--prefix-parts", type=lambda t: [x for x in t.split(",") if x],
                   default=["cached", "mooncake"], help="cached,mooncake (both)")
    g.add_argument("--cached-tokens", type=int, default=512, help="cached_prompt tokens (512)")
    g.add_argument("--input-tokens", type=int, default=16, help="input tokens (16)")
    g.add_argument("--prefix-requests", type=int, default=16,
                   help="measured cached_prompt requests, one at a time (16)")
    g.add_argument("--prefix-output", type=int, default=8, help="their output tokens (8)")
    g.add_argument("--mooncake-model", type=Path, default=None,
                   help="model of the Mooncake replay (default --model)")
    g.add_argument("--mooncake-requests", type=int, default=64, help="requests replayed (64)")
    g.add_argument("--mooncake-max-output", type=int, default=32, help="output cap (32)")
    g.add_argument("--mooncake-select", choices=("first", "conversations"), default="first",
                   help="first N rows, or N rows of multi-turn conversations")
    g.add_argument("--mooncake-arrival", choices=("trace", "all"), default="trace",
                   help="trace timestamps / --mooncake-speedup, or all at once")
    g.add_argument("--mooncake-speedup", type=float, default=1.0,
                   help="trace time / speedup (1: the first 64 rows arrive over 18 s)")
    g.add_argument("--mooncake-max-concurrency", type=int, default=None,
                   help="Mooncake requests in flight at most (no cap)")

    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("throughput", parents=[common, srv, hf],
                   help="seqserve vs HF generate tokens/s (issue 2)")
    sub.add_parser("sweep", parents=[common, swp], help="max_sparsity x max_splits grid (issue 3)")
    sub.add_parser("partition", parents=[common, prt], help="plan_partition timing (issue 3)")
    sub.add_parser("prefix", parents=[common, pfx], help="prefix cache figures (issue 5)")
    sub.add_parser("serve", parents=[common, srv, slo, load, prs],
                   help="load generator: arrivals, rate sweep, vLLM alongside (issue 7)")
    sub.add_parser("peers", parents=[common, srv, hf, slo, prs],
                   help="seqserve vs HF, transformers CB, vLLM; the ceiling (issue 7)")
    ce = sub.add_parser("ceiling", parents=[common, hf],
                        help="the model's own forward throughput at given shapes (issue 7)")
    ce.add_argument("--batch", type=int, required=True, help="decode rows")
    ce.add_argument("--context", type=int, required=True, help="cached tokens per row")
    ce.add_argument("--prompt-len", type=int, required=True, help="prefill prompt length")
    ce.add_argument("--prefill-batch", type=int, default=None,
                    help="prompts per prefill forward (default: batch, <= 4096 tokens)")
    ce.add_argument("--repeats", type=int, default=7, help="timed repeats; the fastest counts")
    sub.add_parser("all", parents=[common, srv, hf, slo, prs, load, swp, prt, pfx],
                   help="every figure: peers, sweep, partition, prefix, Poisson sweep")
    return parser


def main(argv: Sequence[str] | None, doc: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in COMMANDS for a in argv) and not {"-h", "--help"} & set(argv):
        argv.insert(0, "throughput")
    args = build_parser(doc).parse_args(argv)
    _ARGV[:] = argv
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"throughput": cmd_throughput, "sweep": cmd_sweep, "partition": cmd_partition,
                "prefix": cmd_prefix, "serve": cmd_serve, "peers": cmd_peers,
                "ceiling": cmd_ceiling, "all": cmd_all}
    commands[args.command](args)
    return 0
