"""Writing results: strict JSON, markdown tables, PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

from bench.peer_systems import PEER_NAMES

logger = logging.getLogger("seqserve.bench")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_json(result: dict) -> str:
    """Strict JSON: nan and infinities (no value) become null."""
    def clean(x):
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, Path):
            return str(x)
        return x
    return json.dumps(clean(result), indent=2, allow_nan=False) + "\n"


def write(out_dir: Path, name: str, result: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(to_json(result))
    (out_dir / f"{name}.md").write_text(markdown + "\n")
    logger.info("wrote %s and %s", out_dir / f"{name}.json", out_dir / f"{name}.md")


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(b):
        return float("nan")
    return a / b


def f(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def latency_rows(summary: dict) -> list[list[str]]:
    """TTFT / TPOT / ITL / E2E: mean, median, p90, p99 (ms)."""
    return [[name, f(summary[k]["mean_ms"]), f(summary[k]["median_ms"]),
             f(summary[k].get("p90_ms")), f(summary[k]["p99_ms"])]
            for name, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
            if k in summary]


LATENCY_HEADER = ["metric", "mean", "median", "p90", "p99"]


# --------------------------------------------------------------------------------------------
# Markdown of each benchmark
# --------------------------------------------------------------------------------------------


def workload_line(meta: dict) -> str:
    return (f"Workload: {meta['trace_name']}, first {meta['num_requests']} requests, "
            f"{meta['arrival']}; {meta['scale_text']}. Prompt tokens {meta['prompt']['sum']} "
            f"(mean {meta['prompt']['mean']:.0f}, max {meta['prompt']['max']}), output tokens "
            f"{meta['output']['sum']} (mean {meta['output']['mean']:.0f}, max "
            f"{meta['output']['max']}). Model {meta['model']} ({meta['dtype']}), "
            f"{meta['env']['cores']} cores (load average {meta['env'].get('load_average')} at "
            f"start), seed {meta['seed']}.")


def throughput_markdown(result: dict) -> str:
    meta, seq, hf = result["workload"], result["seqserve"], result["hf"]
    ratio_hf = result["ratio_seqserve_over_hf"]
    c = seq["config"]
    rows = [["seqserve", f"max_sparsity {c['max_sparsity']:g}, max_splits {c['max_splits']}, "
             f"max_rolling_batch_size {c['max_rolling_batch_size']}",
             f(seq["duration_s"], 2), seq["output_tokens"], f(seq["output_throughput"]),
             f(seq["request_throughput"], 2)]]
    if hf:
        rows.append(["HF generate", f"static batches of {hf['config']['batch_size']}, left "
                     f"padding, {hf['config']['torch_threads']} torch threads",
                     f(hf["duration_s"], 2), hf["output_tokens"], f(hf["output_throughput"]),
                     f(hf["request_throughput"], 2)])
    return "\n\n".join([
        "## Offline throughput: seqserve vs Hugging Face generate",
        workload_line(meta),
        md_table(["system", "configuration", "duration s", "output tokens", "output tokens/s",
                  "requests/s"], rows),
        (f"**seqserve / HF output tokens/s: {ratio_hf:.2f}x** ({meta['scale_text']})"
         if ratio_hf else "HF baseline skipped (--no-hf)."),
        "seqserve latency (ms, vLLM definitions):",
        md_table(LATENCY_HEADER, latency_rows(seq)),
    ])


def sweep_markdown(result: dict, plot_link: str | None = None) -> str:
    meta = result["workload"]
    rows = [[f(r["config"]["max_sparsity"], 2), r["config"]["max_splits"],
             f(r["output_throughput"]), f(r["duration_s"], 2),
             f(r["server"]["peak_kv_padded_slots"], 0), f(r["server"]["mean_batch_sparsity"], 3),
             f(r["server"]["mean_batch_splits"], 2), f(r["server"]["regroup_bytes"] / 2**20, 1),
             f(r["tpot"]["median_ms"])] for r in result["runs"]]
    parts = ["## max_sparsity x max_splits sweep", workload_line(meta),
             md_table(["max_sparsity", "max_splits", "output tokens/s", "duration s",
                       "peak padded KV slots", "mean sparsity", "mean splits",
                       "regroup MiB", "median TPOT ms"], rows)]
    if "reference" in result:
        r = result["reference"]
        point = r["point"]
        parts.append(f"**At max_sparsity {point['max_sparsity']:g}, max_splits "
                     f"{point['max_splits']} vs max_splits 1:** peak padded KV slots x"
                     f"{f(r['peak_padded_slots_ratio_to_splits_1'], 3)}, output tokens/s x"
                     f"{f(r['throughput_ratio_to_splits_1'], 3)} ({meta['scale_text']}).")
    if plot_link:
        parts.append(f"![sweep]({plot_link})")
    return "\n\n".join(parts)


def partition_markdown(result: dict) -> str:
    rows = [[f"{r['max_sparsity']:g}", r["splits"], f"{r['sparsity']:.4f}",
             f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}"] for r in result["runs"]]
    return "\n\n".join([
        "## plan_partition time",
        f"512 random lengths in [1, 2048] (seed {result['seed']}), max_splits 8; median of "
        f"{result['repeats']} repeats (timeit).",
        md_table(["max_sparsity", "groups", "sparsity", "median ms", "min ms"], rows)])


def prefix_markdown(result: dict) -> str:
    model_dir = result["model"]
    md = ["## Prefix cache"]
    if "cached_prompt" in result:
        c = result["cached_prompt"]
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
                        [["warm", w["prompt_tokens"], spread(w["cached_tokens"]),
                          f(w["ttft_mean_ms"]), f(w["ttft_median_ms"])],
                         ["off", o["prompt_tokens"], spread(o["cached_tokens"]),
                          f(o["ttft_mean_ms"]), f(o["ttft_median_ms"])]]),
               f"**TTFT warm / off: {c['ttft_ratio_mean']:.3f} (means), "
               f"{c['ttft_ratio_median']:.3f} (medians)**; aim <= {c['aim']}."]
    if "mooncake" in result:
        m = result["mooncake"]
        meta, on, off = m["workload"], m["runs"]["cache_on"], m["runs"]["cache_off"]

        def row(name: str, s: dict) -> list:
            return [name, f(100 * s["prefix_hit_rate_worker"]),
                    f(100 * s["prefix_hit_rate_scheduler"]), f(s["output_throughput"]),
                    f(s["total_token_throughput"]), f(s["duration_s"], 2),
                    f(s["ttft"]["mean_ms"]), f(s["ttft"]["p99_ms"])]

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
    return "\n\n".join(md)


def spread(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


NOT_STREAMED = "seqserve, not streamed"


def peers_markdown(result: dict) -> str:
    meta, seq = result["workload"], result["seqserve"]
    unary = result.get("seqserve_not_streamed")
    header = ["system", "duration s", "output tokens", "output tokens/s", "seqserve / system"]

    def row(name: str, s: dict, vs_streamed: str, vs_unary: str) -> list:
        cells = [name, f(s["duration_s"], 2), s["output_tokens"], f(s["output_throughput"]),
                 vs_streamed]
        return cells + [vs_unary] if unary else cells

    rows = [row("seqserve", seq, "1.00", f(ratio(unary["output_throughput"],
                                                 seq["output_throughput"]), 2) if unary else "")]
    if unary:
        header.append("seqserve not streamed / system")
        rows.append(row(NOT_STREAMED, unary, f(ratio(seq["output_throughput"],
                                                    unary["output_throughput"]), 2), "1.00"))
    notes = []
    for name, s in result["peers"].items():
        if "skipped" in s:
            notes.append(f"- {PEER_NAMES[name]}: {s['skipped']}")
            rows.append([PEER_NAMES[name], "skipped", "", "", ""] + ([""] if unary else []))
            continue
        rows.append(row(PEER_NAMES[name], s, f(result["ratios"][name], 2),
                        f(result.get("ratios_not_streamed", {}).get(name), 2)))
    parts = ["## seqserve and its peers, all requests at once", workload_line(meta),
             md_table(header, rows)]
    if unary:
        parts.append(f"seqserve streams every token to its request's client; {NOT_STREAMED} "
                     "is the same requests as GenerateUnary calls (client/offline.py's way) "
                     "on a fresh deployment, the like of vLLM's offline `generate` and the HF "
                     "baselines, which do not stream either.")
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
    if "floor" in result:
        fl = result["floor"]

        def name(k: str) -> str:
            return {"seqserve": "seqserve", "seqserve_not_streamed": NOT_STREAMED}.get(
                k) or PEER_NAMES[k]

        own = fl.get("by_system") or {}
        shares = ", ".join(f"{name(k)} {100 * v:.0f}%" for k, v in fl["fraction"].items())
        parts.append(
            f"**Floor** (bench/floor.py: the linear layers at this machine's measured bf16 GEMM "
            f"rate plus weights and KV at its measured bandwidth "
            f"{fl['bandwidth'] / 1e9:.1f} GB/s{', probed after every run' if own else ''}, "
            f"over {fl['steps']} ideal steps): "
            f"{fl['duration_s']:.2f} s, {fl['output_throughput']:.1f} output tokens/s. "
            f"**Fraction of the floor"
            f"{', each run at the bandwidth probed around it' if own else ''}: {shares}.**")
        if own:
            rows = [[name(k), " / ".join(f"{b / 1e9:.1f}" for b in v["probes"]),
                     f"{v['duration_s']:.2f}", f"{100 * fl['fraction'][k]:.0f}%",
                     f"{100 * fl['fraction_end_probe'][k]:.0f}%"] for k, v in own.items()]
            parts += ["Each run's floor at the bandwidth probed just before / after it (the "
                      "fractions above); the last column is against the one floor above, "
                      "probed after every run:",
                      md_table(["system", "bandwidth GB/s", "floor s", "fraction",
                                "fraction (probe after all runs)"], rows)]
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
            f"{w['forward_s']:.2f}, sampling {w['sampling_s']:.2f}, regroup {w['regroup_s']:.2f}"
            f"{_regroup_gb(w)}, prefix cache {w.get('prefix_cache_s', 0):.2f}), postprocess "
            f"{s['postprocess']:.2f}; run duration {seq['duration_s']:.2f} s.")
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
            row = [name, p["label"], f(p["offered_rate"], 2) if p["offered_rate"] else "inf",
                   f(p.get("realized_rate"), 2) if p.get("realized_rate") not in (
                       None, float("inf")) else "inf",
                   f(s["request_throughput"], 2), f(s["output_throughput"]),
                   f"{f(s['ttft']['median_ms'])} / {f(s['ttft']['p99_ms'])}",
                   f"{f(s['tpot']['median_ms'])} / {f(s['tpot']['p99_ms'])}",
                   f"{f(s['itl']['median_ms'])} / {f(s['itl']['p99_ms'])}",
                   f"{f(s['e2e']['median_ms'])} / {f(s['e2e']['p99_ms'])}"]
            if result.get("slo"):
                row.append(f(s.get("goodput", {}).get("request_goodput"), 2))
            rows.append(row)
    parts.append(md_table(header, rows))
    if result.get("vllm_skipped"):
        parts.append(f"vLLM: {result['vllm_skipped']}")
    if result["seqserve"] and result["vllm"]:
        rr = [[p["label"], f(ratio(p["summary"]["output_throughput"],
                                   v["summary"]["output_throughput"]), 2),
               f(ratio(p["summary"]["e2e"]["p99_ms"], v["summary"]["e2e"]["p99_ms"]), 2)]
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


def ceiling_markdown(out: dict) -> str:
    return "\n\n".join(["## Forward-pass ceiling", md_table(
        ["model", "decode batch x context", "ms/step (min / median)", "decode tokens/s",
         "prefill batch x tokens", "prefill tokens/s"],
        [[f"{out['model']} ({out['dtype']})", f"{out['batch']} x {out['context']}",
          f"{out['decode_step_ms']:.1f} / {out['decode_step_ms_median']:.1f}",
          f"{out['decode_tokens_per_s']:.0f}", f"{out['prefill_batch']} x {out['prompt_len']}",
          f"{out['prefill_tokens_per_s']:.0f}"]])])


def _regroup_gb(worker: dict) -> str:
    """The KV bytes regrouping copied, where the run's summary has them."""
    n = worker.get("regroup_bytes")
    return f" copying {n / 1e9:.2f} GB" if isinstance(n, (int, float)) and n == n else ""
