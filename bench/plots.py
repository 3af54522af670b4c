"""PNG plots of benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("seqserve.bench")


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
