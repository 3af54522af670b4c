"""The tables of `python -m bench policies` (issue 19): per trace, one row per fraction of
FCFS's knee and policy (vLLM's rows beside them where it ran), with the urgent class's TTFT
against the same prompts on an idle server and the ratios against FCFS and vLLM at the same
fraction. Pure: the run's dict in, markdown out."""

from __future__ import annotations

from collections.abc import Sequence

from bench.policy_plan import CONTROL
from bench.report import f, md_table, ratio

VLLM = "vllm"
HEADER = ["policy", "x knee", "req/s offered / achieved", "TTFT ms mean / p50 / p99",
          "TPOT ms mean / p50 / p99", "ITL ms mean / p50 / p99", "E2E ms mean / p50 / p99",
          "output tok/s", "goodput req/s", "urgent TTFT p99 ms", "idle TTFT ms (median)",
          "urgent p99 / idle", "urgent p99 / idle p99", "urgent slowdown p99",
          "FCFS E2E mean / this",
          "ITL p99 / vLLM's"]


def _triple(summary: dict, metric: str) -> str:
    s = summary.get(metric) or {}
    return " / ".join(f(s.get(k), 0) for k in ("mean_ms", "median_ms", "p99_ms"))


def _get(run: dict | None, metric: str, key: str) -> float | None:
    if not run:
        return None
    return (run["summary"].get(metric) or {}).get(key)


def e2e_gain(run: dict, control: dict | None) -> float:
    """FCFS's mean E2E over this run's at the same fraction (> 1: this one is faster)."""
    return ratio(_get(control, "e2e", "mean_ms"), _get(run, "e2e", "mean_ms"))


def itl_vs_vllm(run: dict, vllm: dict | None) -> float:
    """This run's p99 ITL over vLLM's at the same fraction (<= 1: no worse than vLLM)."""
    return ratio(_get(run, "itl", "p99_ms"), _get(vllm, "itl", "p99_ms"))


def _same_fraction(runs: Sequence[dict], policy: str, fraction: float) -> dict | None:
    return next((r for r in runs if r["policy"] == policy and r["fraction"] == fraction), None)


def run_row(run: dict, runs: Sequence[dict]) -> list[str]:
    """One table row; the ratios look up FCFS's and vLLM's runs at the same fraction."""
    s, u = run["summary"], run.get("urgent") or {}
    good = (s.get("goodput") or {}).get("request_goodput")
    control = _same_fraction(runs, CONTROL, run["fraction"])
    vllm = _same_fraction(runs, VLLM, run["fraction"])
    return [run["policy"], f"{run['fraction']:g}",
            f"{f(run['rate'], 2)} / {f(s.get('request_throughput'), 2)}",
            _triple(s, "ttft"), _triple(s, "tpot"), _triple(s, "itl"), _triple(s, "e2e"),
            f(s.get("output_throughput")), f(good, 2),
            f((u.get("ttft") or {}).get("p99_ms"), 0), f(u.get("idle_ttft_median_ms"), 0),
            f(u.get("p99_over_idle"), 2), f(u.get("p99_over_idle_p99"), 2),
            f(u.get("slowdown_p99"), 2),
            f(e2e_gain(run, control), 2) if run["policy"] != CONTROL else "1.00",
            f(itl_vs_vllm(run, vllm), 2) if vllm and run["policy"] != VLLM else "n/a"]


def ordered(runs: Sequence[dict], policies: Sequence[str]) -> list[dict]:
    """By fraction, then in --policies order with vLLM last: rows to compare sit together."""
    rank = {p: i for i, p in enumerate([*policies, VLLM])}
    return sorted(runs, key=lambda r: (r["fraction"], rank.get(r["policy"], len(rank))))


def trace_table(trace: dict, policies: Sequence[str]) -> str:
    runs = trace["runs"]
    return md_table(HEADER, [run_row(r, runs) for r in ordered(runs, policies)])


def _knee_line(trace: dict) -> str:
    k = trace["knee"]
    probes = ", ".join(f"{p['rate']:g}/s" for p in k["points"] if p["rate"] is not None)
    rule = ("FCFS's knee **as given (--knee-rate), not probed**" if k.get("given") else
            "FCFS's knee" if k["found"] else
            "**no knee: even the lowest probe failed the rule; the fractions are of that "
            "probe's rate**")
    return (f"{rule}: {f(k['rate'], 3)} requests/s (all at once {f(k['offline_rate'], 3)}/s; "
            f"probes {probes})")


def trace_section(trace: dict, policies: Sequence[str]) -> str:
    u = trace["urgent_positions"]
    lines = [f"### {trace['name']}", "",
             f"{trace['num_requests']} requests (trace rows {trace['first_row']}-"
             f"{trace['first_row'] + trace['num_requests'] - 1}; {trace['scale_text']}), "
             f"warm-up {trace['warmup']} rows before them on every server; "
             f"{len(u)} urgent (priority {trace['urgent_priority']}) at positions "
             f"{', '.join(map(str, u)) or 'none'}.", "",
             _knee_line(trace) + ".", "",
             f"`uptime` at the start: {trace['uptime_start'] or 'n/a'}; at the end: "
             f"{trace['uptime_end'] or 'n/a'}.", "", trace_table(trace, policies)]
    return "\n".join(lines)


def policies_markdown(result: dict) -> str:
    est, wall = result.get("estimate_s"), result.get("wall_s")
    head = [
        f"## Scheduling policies against FCFS ({result['model']}, {result['dtype']})", "",
        f"Commit {result['commit']}; `uptime` at the start: {result['uptime_start'] or 'n/a'};"
        f" at the end: {result['uptime_end'] or 'n/a'}. Estimated "
        f"{f(est / 60 if est else None, 0)} min, took {f(wall / 60 if wall else None, 0)} min.",
        "",
        "Poisson arrivals (one seed) at fractions of FCFS's knee, the same prompts and "
        "arrivals for every policy, each its own server warmed up alike. Urgent: the "
        "class's TTFT; idle: the same prompts alone on an idle server; urgent p99 / idle: "
        "the class's p99 over the idle median; urgent p99 / idle p99: over the idle p99 "
        "of the same prompts; slowdown: p99 of each urgent request's "
        "loaded / idle TTFT. FCFS E2E mean / this > 1: faster than FCFS. ITL p99 / vLLM's "
        "<= 1: no worse than vLLM (which gets no priorities).",
    ]
    if result.get("slo"):
        head += ["", f"Goodput: requests meeting {result['slo']}, per second."]
    if result.get("vllm_skipped"):
        head += ["", f"No vLLM rows: {result['vllm_skipped']}"]
    sections = [trace_section(t, result["policies"]) for t in result["traces"]]
    return "\n\n".join(["\n".join(head), *sections])
