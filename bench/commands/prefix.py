"""`python -m bench prefix`: the prefix cache. Time to first token with a warm `cached_prompt`
against the cache off, and the Mooncake conversation trace replayed with the cache on and off."""

from __future__ import annotations

import random
from datetime import datetime, timezone
from pathlib import Path

from bench.commands.common import (check_context, command_line, ensure_model, logger,
                                   server_options, workload_meta)
from bench.env import environment, model_context, model_dtype
from bench.loadgen import SeqserveTarget
from bench.report import prefix_markdown, write
from bench.stats import percentile
from bench.workload import (WORKLOADS, BenchRequest, Scale, TraceItem, build_workload_requests,
                            describe_arrivals, load_mooncake, make_prompt, mooncake_scale,
                            round_trip_tokens, trace_arrivals)


CACHE_OFF = {"prompt_cache_bytes": 0}


def _cache_on_and_off(args, model_dir: Path, tokenizer, part: str, on_name: str):
    """Yield (name, started deployment) with the prefix cache on, then off; each deployment
    stops when the caller asks for the next one."""
    for name, worker_options in ((on_name, {}), ("cache_off", CACHE_OFF)):
        with SeqserveTarget(model_dir, tokenizer, logdir=Path(args.out) / "logs" / f"{part}-{name}",
                            dtype=model_dtype(model_dir), device=args.device,
                            worker_options=worker_options,
                            max_rolling_batch_size=args.max_rolling_batch_size,
                            server_options=server_options(args)) as target:
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
    check_context(model_dir, items)
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


def run(args) -> dict:
    from transformers import AutoTokenizer

    model_dir = ensure_model(Path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = set(args.prefix_parts)
    result: dict = {"benchmark": "prefix", "model": str(model_dir),
                    "dtype": model_dtype(model_dir), "env": environment(),
                    "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": command_line()}
    if "cached" in parts:
        result["cached_prompt"] = _cached_prompt_part(args, model_dir, tokenizer)
    if "mooncake" in parts:
        result["mooncake"] = _mooncake_part(args, tokenizer)
    text = prefix_markdown(result)
    write(Path(args.out), "prefix", result, text)
    print(text, flush=True)
    return result
