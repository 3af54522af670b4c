"""The benchmark matrix's tables (`python -m bench matrix`): one ratio row per model, trace
and arrival rate, seqserve against vLLM (and, all at once, the HF baselines), each system's
fraction of the floor; the knees; the measured machine rates. Pure: dicts in, markdown out."""

from __future__ import annotations

from typing import Sequence

from bench.report import f, md_table, ratio

RATIO_HEADER = ["model", "trace", "arrivals", "seqserve tok/s", "vLLM tok/s",
                "seqserve / vLLM", "TTFT p50 ms seqserve / vLLM", "TTFT p99 ms",
                "ITL p50 ms", "ITL p99 ms", "floor tok/s", "% of floor seqserve / vLLM",
                "seqserve / HF static", "seqserve / HF CB"]


def _pair(a: dict | None, b: dict | None, metric: str, key: str) -> str:
    def one(s: dict | None) -> str:
        return f((s or {}).get(metric, {}).get(key), 0) if s and metric in s else "n/a"
    return f"{one(a)} / {one(b)}"


def _tput(s: dict | None) -> float | None:
    return None if not s or "skipped" in s else s.get("output_throughput")


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.0f}%"


def floor_fraction(point: dict, system: str) -> float | None:
    """floor duration / the system's measured duration at this point."""
    s, fl = point.get(system), point.get("floor")
    if not s or "skipped" in s or not fl:
        return None
    return ratio(fl["duration_s"], s.get("duration_s"))


def ratio_row(cell: dict, point: dict) -> list[str]:
    seq, vllm = point.get("seqserve"), point.get("vllm")
    vllm = None if vllm and "skipped" in vllm else vllm
    fl = point.get("floor")
    return [cell["model"], cell["trace"], point["label"], f(_tput(seq)), f(_tput(vllm)),
            f(ratio(_tput(seq), _tput(vllm)), 2),
            _pair(seq, vllm, "ttft", "median_ms"), _pair(seq, vllm, "ttft", "p99_ms"),
            _pair(seq, vllm, "itl", "median_ms"), _pair(seq, vllm, "itl", "p99_ms"),
            f(fl["output_throughput"]) if fl else "n/a",
            f"{_pct(floor_fraction(point, 'seqserve'))} / {_pct(floor_fraction(point, 'vllm'))}",
            f(ratio(_tput(seq), _tput(point.get("hf"))), 2),
            f(ratio(_tput(seq), _tput(point.get("hf-cb"))), 2)]


def ratio_table(cells: Sequence[dict]) -> str:
    return md_table(RATIO_HEADER, [ratio_row(c, p) for c in cells for p in c["points"]])


def knee_table(cells: Sequence[dict]) -> str:
    def rate(x):
        return "not reached" if x is None else f"{x:g}"

    rows = [[c["model"], c["trace"], f(c.get("offline_request_rate"), 2),
             rate(c.get("knee", {}).get("seqserve")),
             rate(c.get("knee", {}).get("vllm")) if c.get("knee", {}).get("vllm_ran") else "n/a"]
            for c in cells]
    return md_table(["model", "trace", "seqserve offline req/s", "knee seqserve req/s",
                     "knee vLLM req/s"], rows)


def rates_table(machine: dict) -> str:
    """GFLOP/s of every measured (K x N) at each M, and the memory bandwidth."""
    ms = sorted({m for pts in machine["gemm"].values() for m, _ in pts})
    rows = []
    for key, pts in machine["gemm"].items():
        by_m = dict(pts)
        rows.append([f"{machine['names'].get(key, '')} {key}".strip(),
                     *[f(by_m[m] / 1e9, 0) if m in by_m else "" for m in ms]])
    return md_table(["product (K x N)", *[f"M={m}" for m in ms]], rows)


def notes(cells: Sequence[dict], skipped: dict[str, str]) -> list[str]:
    out = [f"- {name}: {why}" for name, why in skipped.items()]
    for c in cells:
        for p in c["points"]:
            for system in ("hf", "hf-cb"):
                s = p.get(system)
                if s and "skipped" in s:
                    out.append(f"- {system} on {c['model']} / {c['trace']}: {s['skipped']}")
    return out


def matrix_markdown(result: dict) -> str:
    cells, machine = result["cells"], result.get("machine")
    parts = ["## seqserve against vLLM and the HF baselines: models x traces x arrivals",
             f"Commit {result['commit']}; {result['cores']} cores. `uptime` at the start: "
             f"`{result['uptime_start']}`; at the end: `{result['uptime_end']}`.",
             f"Workloads: first {result['num_requests']} requests of each trace ("
             + "; ".join(f"{k}: {v}" for k, v in result["scales"].items())
             + f"); Poisson rates are fractions "
             f"{', '.join(f'{x:g}' for x in result['rate_fractions'])} of seqserve's "
             f"all-at-once request rate on that model and trace (the same rates for vLLM). "
             f"Latencies: vLLM's definitions (vLLM streams through AsyncLLM in every row).",
             ratio_table(cells),
             "Floor: the linear layers' FLOPs at this machine's measured bfloat16 GEMM rate "
             "at each step's row count, plus the weights and the KV read at the measured "
             "memory bandwidth, summed over the steps of an ideal continuous-batching engine "
             "(bench/floor.py); % of floor = floor time / measured time.",
             "Knees (highest offered rate at which the system kept up and p99 E2E stayed "
             "within 2x its lowest-rate value):", knee_table(cells)]
    if machine:
        parts += [f"Machine rates: memory bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s "
                  f"(copy {machine['memory']['copy_bytes_per_s'] / 1e9:.1f}, read "
                  f"{machine['memory']['read_bytes_per_s'] / 1e9:.1f}); bfloat16 GEMM "
                  f"GFLOP/s ({machine['threads']} threads, fastest of F.linear and oneDNN "
                  f"prepacked):", rates_table(machine)]
    extra = notes(cells, result.get("vllm_skipped", {}))
    if extra:
        parts.append("Skipped:\n" + "\n".join(extra))
    return "\n\n".join(parts)
