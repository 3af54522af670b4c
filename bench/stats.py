"""Per-request timings and vLLM benchmark_serving's summary of a run, plus goodput.

TTFT = first token - send; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = every gap between
consecutive tokens; e2e = last message - send. Throughputs divide by the run's duration: the
first send to the last reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / p90 / p99 in milliseconds."""
    if not values_s:
        return {k: float("nan") for k in ("mean_ms", "median_ms", "p90_ms", "p99_ms")}
    return {"mean_ms": 1000 * sum(values_s) / len(values_s),
            "median_ms": 1000 * percentile(values_s, 50),
            "p90_ms": 1000 * percentile(values_s, 90),
            "p99_ms": 1000 * percentile(values_s, 99)}


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    output_len: int
    send: float  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)
    end: float = float("nan")  # final message
    generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    # False: a GenerateUnary call, whose tokens all came at `end` (no per-token times).
    streamed: bool = True

    @property
    def tokens_received(self) -> int:
        return len(self.token_times) if self.streamed else self.generated

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class Slo:
    """Goodput limits in milliseconds (None: no limit on that metric)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def describe(self) -> str:
        parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms),
                                                 ("E2E", self.e2e_ms)) if v is not None]
        return " and ".join(parts) or "no limits"


def meets(ttft_s: float, tpot_s: float | None, e2e_s: float, slo: Slo) -> bool:
    """vLLM's rule: a request is good when it meets every given limit; a one-token request's
    TPOT counts as 0."""
    tpot_s = tpot_s or 0.0
    return ((slo.ttft_ms is None or 1000 * ttft_s <= slo.ttft_ms)
            and (slo.tpot_ms is None or 1000 * tpot_s <= slo.tpot_ms)
            and (slo.e2e_ms is None or 1000 * e2e_s <= slo.e2e_ms))


def goodput(per_request: Sequence[dict], duration_s: float, slo: Slo) -> dict:
    """Requests meeting `slo`, per second of the run (vLLM's request goodput)."""
    good = sum(meets(r["ttft_s"], r["tpot_s"], r["e2e_s"], slo) for r in per_request)
    return {"slo": slo.describe(), "good_requests": good,
            "good_fraction": good / len(per_request) if per_request else float("nan"),
            "request_goodput": good / duration_s if duration_s > 0 else float("nan")}


def summarize(results: Sequence[RequestResult], slo: Slo | None = None) -> dict:
    """vLLM benchmark_serving's summary of one run. Requests that were not streamed count
    in the throughput and E2E only (no TTFT, TPOT or ITL: their tokens came at once)."""
    start = min(r.send for r in results)
    duration = max(r.end for r in results) - start
    out_tokens = sum(r.tokens_received for r in results)
    in_tokens = sum(r.prompt_len for r in results)
    streamed = [r for r in results if r.streamed]
    per_request = [{"index": r.index, "prompt_len": r.prompt_len, "output_len": r.output_len,
                    "send_s": r.send - start, "ttft_s": r.ttft if r.streamed else None,
                    "e2e_s": r.e2e, "tpot_s": r.tpot if r.streamed else None,
                    "cached_tokens": r.cached_tokens} for r in results]
    summary = {
        "completed": len(results),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in results),
        "request_throughput": len(results) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    if streamed:
        summary.update({
            "ttft": latency_stats([r.ttft for r in streamed]),
            "tpot": latency_stats([t for r in streamed if (t := r.tpot) is not None]),
            "itl": latency_stats([x for r in streamed for x in r.itls])})
    summary["e2e"] = latency_stats([r.e2e for r in results])
    summary["per_request"] = per_request
    if slo:
        summary["goodput"] = goodput(per_request, duration, slo)
    return summary


def results_from_times(rows: Sequence[dict], prompt_lens: Sequence[int],
                       output_lens: Sequence[int]) -> list[RequestResult]:
    """RequestResults from a peer's {"send", "token_times", "end"} rows (seconds, one clock)."""
    out = []
    for i, (row, p, o) in enumerate(zip(rows, prompt_lens, output_lens)):
        times = list(row["token_times"])
        out.append(RequestResult(i, p, o, row["send"], times, row.get("end", times[-1]),
                                 generated=len(times), prompt_tokens=p))
    return out
