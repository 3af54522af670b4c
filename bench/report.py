"""Writing results: strict JSON, markdown tables, PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

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
# Plots
# --------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    logger.info("wrote %s", path)


def plot_load_sweep(series: dict[str, list[dict]], path: Path, title: str) -> None:
    """Output tokens/s and p99 latencies (TTFT, TPOT, E2E) against offered load (the arrivals'
    realized requests/s), one line per system. `series`: name -> [{"rate", "realized_rate",
    "summary"}] sorted by rate."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    panels = [("output_throughput", None, "output tokens/s", "Throughput"),
              ("ttft", "p99_ms", "p99 TTFT (ms)", "p99 time to first token"),
              ("tpot", "p99_ms", "p99 TPOT (ms)", "p99 time per output token"),
              ("e2e", "p99_ms", "p99 E2E (ms)", "p99 end-to-end latency")]
    for ax, (key, sub, ylabel, panel_title) in zip(axes, panels):
        for name, points in series.items():
            xs = [p.get("realized_rate") or p["rate"] for p in points]
            ys = [p["summary"][key] if sub is None else p["summary"][key][sub] for p in points]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set(xlabel="offered load (requests/s, as sent)", ylabel=ylabel, title=panel_title)
        if sub is not None:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_cdfs(runs: dict[str, dict], path: Path, title: str) -> None:
    """Empirical CDFs of TTFT, TPOT and E2E latency, one line per run (name -> summary)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"),
                                       ("e2e_s", "E2E latency (ms)"))):
        for name, summary in runs.items():
            xs = sorted(1000 * r[key] for r in summary.get("per_request", ())
                        if r.get(key) is not None)
            if xs:
                ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))],
                        where="post", label=name)
        ax.set(xlabel=label, ylabel="fraction of requests", title=f"CDF of {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_sweep(result: dict, path: Path) -> None:
    """The max_sparsity x max_splits sweep: throughput and peak padded KV slots."""
    plt = _plt()
    meta = result["workload"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for k in sorted({r["config"]["max_splits"] for r in result["runs"]}):
        runs = sorted((r for r in result["runs"] if r["config"]["max_splits"] == k),
                      key=lambda r: r["config"]["max_sparsity"])
        xs = [r["config"]["max_sparsity"] for r in runs]
        ax1.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=f"max_splits {k}")
        ax2.plot(xs, [r["server"]["peak_kv_padded_slots"] for r in runs], marker="o",
                 label=f"max_splits {k}")
    ax1.set(xlabel="max_sparsity", ylabel="output tokens/s", title="Throughput")
    ax2.set(xlabel="max_sparsity", ylabel="peak seqserve_kv_padded_slots",
            title="Peak padded KV slots")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(meta['model']).name}, {meta['num_requests']} Azure conv requests at once; "
                 f"{meta['scale_text']}", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
