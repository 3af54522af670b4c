"""Poisson points at fractions of a deployment's all-at-once request rate, and the knee over
them: how `bench matrix` finds where a system stops keeping up, shared with `bench serve`
(the knee rule) and `bench policies` (FCFS's knee, which sets the rates its policies run at).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from bench.bandwidth_probe import probed
from bench.stats import Slo
from bench.workload import BenchRequest, TraceItem, arrivals, build_workload_requests

logger = logging.getLogger("seqserve.bench")

KNEE_RULE = ("highest offered rate up to which the system keeps up (achieved >= 90% of n / "
             "(arrival span + the lowest rate's mean E2E)) with p99 E2E <= 2x its value at "
             "the lowest rate")


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


def curve(points: Sequence[dict], system: str = "seqserve") -> list[dict]:
    """The Poisson points `system` ran, in `knee`'s terms."""
    return [{"rate": p["rate"], "arrival_span_s": max(p["offsets"]), "summary": p[system]}
            for p in points if p["rate"] is not None and system in p]


def past_knee(points: Sequence[dict], system: str = "seqserve") -> bool:
    """Whether the last Poisson point failed the knee rule; points at higher rates cannot
    move the knee then (the rule stops at the first failure)."""
    c = curve(points, system)
    return bool(c) and knee(c) != c[-1]["rate"]


def run_rate_points(target, tokenizer, name: str, items: Sequence[TraceItem],
                    requests: Sequence[BenchRequest], fractions: Sequence[float], *,
                    seed: int, block_tokens: int, slo: Slo | None,
                    stop_past_knee: bool = False,
                    probe: Callable[[], float] | None = None) -> tuple[float, list[dict]]:
    """`requests` all at once on `target`, then Poisson points at `fractions` of that run's
    request rate. Returns (that rate, the points: label, rate, fraction, requests, offsets,
    realized_rate and the run's summary under "seqserve").

    Each point's prompts have a seed of their own (seed + 1 + i), so no point is served
    from a prefix cache an earlier one filled; one arrival seed for all points, so they
    differ in load only. `stop_past_knee`: stop after the first point that fails the knee
    rule (ascending fractions; the knee is the same, the higher points are not run).
    `probe` (bytes/s): the memory's bandwidth probed just before and after each run
    (`bandwidth_probes` in its summary), for that run's floor."""

    def run(*args, **kwargs) -> dict:
        return probed(lambda: target.run(*args, **kwargs), probe)

    cap = run(requests, slo=slo)
    base = cap["request_throughput"]
    points = [{"label": "all at once", "rate": None, "requests": list(requests),
               "offsets": [0.0] * len(requests), "seqserve": cap}]
    for i, fr in enumerate(fractions):
        rate = round(base * fr, 3)
        reqs = build_workload_requests(tokenizer, name, items, seed + 1 + i, block_tokens)
        offs = arrivals("poisson", items, rate=rate, seed=seed)
        logger.info("%s: Poisson %g requests/s (%g x the all-at-once rate)", name, rate, fr)
        points.append({"label": f"Poisson {rate:g}/s ({fr:g}x)", "rate": rate,
                       "fraction": fr, "requests": reqs, "offsets": offs,
                       "realized_rate": realized_rate(offs),
                       "seqserve": run(reqs, offs, None, slo)})
        if stop_past_knee and past_knee(points):
            break
    return base, points
