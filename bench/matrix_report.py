"""The benchmark matrix's tables (`python -m bench matrix`): one ratio row per model, trace
and arrival rate, seqserve against vLLM (and, all at once, the HF baselines), each system's
fraction of the floor; the knees; the measured machine rates. Pure: dicts in, markdown out."""

from __future__ import annotations

import statistics
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
    """floor duration / the system's measured duration at this point: the floor at the
    bandwidth probed around that system's run where it was, else the point's one floor."""
    s, fl = point.get(system), point.get("floor")
    if not s or "skipped" in s or not fl:
        return None
    own = (fl.get("by_system") or {}).get(system)
    return ratio((own or fl)["duration_s"], s.get("duration_s"))


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


AIM_FRACTION = 0.8  # issue 21: p99 TTFT and ITL at 80% of vLLM's knee


def aim_point(cell: dict, fraction: float = AIM_FRACTION) -> dict | None:
    """The Poisson point nearest `fraction` x vLLM's knee, among those at or below the
    knee that both systems ran; None where vLLM's knee is unknown or no such point ran."""
    knee_vllm = cell.get("knee", {}).get("vllm")
    if not knee_vllm:
        return None
    ran = [p for p in cell["points"] if p.get("rate") and p["rate"] <= knee_vllm
           and _tput(p.get("seqserve")) is not None and _tput(p.get("vllm")) is not None]
    return min(ran, key=lambda p: abs(p["rate"] - fraction * knee_vllm), default=None)


def aim_table(cells: Sequence[dict], fraction: float = AIM_FRACTION) -> str | None:
    """Per model and trace: at the point nearest `fraction` of vLLM's knee, p99 TTFT and
    p99 ITL of both systems, and whether seqserve's are no worse than vLLM's (None: no
    model and trace has such a point)."""
    rows = []
    for c in cells:
        p = aim_point(c, fraction)
        if p is None:
            continue
        seq, vllm = p["seqserve"], p["vllm"]
        worse = [m.upper() for m in ("ttft", "itl")
                 if seq.get(m, {}).get("p99_ms", 0) > vllm.get(m, {}).get("p99_ms", 0)]
        rows.append([c["model"], c["trace"], f"{c['knee']['vllm']:g}",
                     f"{fraction * c['knee']['vllm']:.3g}", f"{p['rate']:g}",
                     _pair(seq, vllm, "ttft", "p99_ms"), _pair(seq, vllm, "itl", "p99_ms"),
                     "yes" if not worse else f"no ({', '.join(worse)})"])
    if not rows:
        return None
    return md_table(["model", "trace", "knee vLLM req/s", f"{fraction:g} x knee",
                     "nearest point run req/s", "TTFT p99 ms seqserve / vLLM",
                     "ITL p99 ms seqserve / vLLM", "seqserve no worse"], rows)


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
             "(bench/floor.py); % of floor = floor time / measured time, each system's "
             "floor at the bandwidth probed just before and after its run (the floor tok/s "
             "column: at the bandwidth measured once per command).",
             "Knees (highest offered rate at which the system kept up and p99 E2E stayed "
             "within 2x its lowest-rate value):", knee_table(cells)]
    aims = aim_table(cells)
    if aims:
        parts += [f"Latency near {AIM_FRACTION:g} of vLLM's knee (the measured Poisson "
                  "point nearest it, at or below the knee):", aims]
    if machine:
        parts += [f"Machine rates: memory bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s "
                  f"(copy {machine['memory']['copy_bytes_per_s'] / 1e9:.1f}, read "
                  f"{machine['memory']['read_bytes_per_s'] / 1e9:.1f}); bfloat16 GEMM "
                  f"GFLOP/s ({machine['threads']} threads, fastest of F.linear, oneDNN "
                  f"prepacked and the worker's C product where it runs):",
                  rates_table(machine)]
    extra = notes(cells, result.get("vllm_skipped", {}))
    if extra:
        parts.append("Skipped:\n" + "\n".join(extra))
    return "\n\n".join(parts)


MEDIAN_HEADER = ["model", "trace", "arrivals", "seqserve / vLLM, median (runs)",
                 "seqserve tok/s median", "vLLM tok/s median",
                 "TTFT p99 ms seqserve / vLLM (medians)", "ITL p99 ms seqserve / vLLM (medians)",
                 "% of floor seqserve / vLLM (medians)"]


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None and v == v]  # not NaN
    return statistics.median(known) if known else None


def median_table(results: Sequence[dict]) -> str:
    """One row per (model, trace, arrivals) found in every run: the median over the runs
    of seqserve / vLLM output tok/s (each run's ratio listed), of each system's tok/s, p99
    TTFT, p99 ITL and fraction of the floor. Poisson rows pair by their order within the
    cell (each run sets its own rates from its own all-at-once rate)."""
    def points(result: dict) -> dict[tuple[str, str, int], dict]:
        return {(c["model"], c["trace"], i): p for c in result["cells"]
                for i, p in enumerate(c["points"])}

    runs = [points(r) for r in results]
    rows = []
    for key in runs[0]:
        if not all(key in run for run in runs):
            continue
        seq = [run[key].get("seqserve") for run in runs]
        vllm = [run[key].get("vllm") for run in runs]
        vllm = [None if v and "skipped" in v else v for v in vllm]
        ratios = [ratio(_tput(a), _tput(b)) for a, b in zip(seq, vllm)]

        def med(systems, metric):
            return _median([(s or {}).get(metric, {}).get("p99_ms") for s in systems])

        floors = {name: _median([floor_fraction(run[key], name) for run in runs])
                  for name in ("seqserve", "vllm")}
        label = runs[0][key]["label"]
        if label != "all at once":
            label = f"Poisson {runs[0][key].get('fraction'):g}x"
        rows.append([key[0], key[1], label,
                     f"{f(_median(ratios), 2)} ({', '.join(f(r, 2) for r in ratios)})",
                     f(_median([_tput(s) for s in seq])), f(_median([_tput(v) for v in vllm])),
                     f"{f(med(seq, 'ttft'), 0)} / {f(med(vllm, 'ttft'), 0)}",
                     f"{f(med(seq, 'itl'), 0)} / {f(med(vllm, 'itl'), 0)}",
                     f"{_pct(floors['seqserve'])} / {_pct(floors['vllm'])}"])
    return md_table(MEDIAN_HEADER, rows)


def median_markdown(results: Sequence[dict]) -> str:
    """The median table of several `bench matrix` runs, with each run's commit and load."""
    runs = "\n".join(f"- run {i + 1}: commit {r['commit']}; `uptime` at the start "
                      f"`{r['uptime_start']}`, at the end `{r['uptime_end']}`"
                      for i, r in enumerate(results))
    return "\n\n".join([f"## The matrix, median of {len(results)} runs", runs,
                         median_table(results)])
