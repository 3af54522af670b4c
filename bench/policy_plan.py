"""The plan of `python -m bench policies` (issue 19): which servers run, which requests are
urgent, which rows warm a server up, the checks on the command line, and how long a run
should take. Pure: no server, no clock.

Every policy is its own server, started with option.scheduling_policy=NAME (fcfs-unchunked:
FCFS with enable_chunked_prefill=false, the control for chunked prefill's effect on ITL;
priority-unshielded: priority with priority_background_chunk_tokens=0, the control for the
urgent shield; priority-shieldN: priority with the shield's cap at N background prompt tokens
a Step, to compare caps against the default; priority-swap and mlfq-swap: their victims'
KV swapped to host memory instead of recomputed).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.stats import latency_stats, percentile
from bench.workload import WORKLOADS, BenchRequest, TraceItem

# name -> the serving options that make it; they win over --server-option.
POLICIES: dict[str, dict[str, str]] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "fcfs-unchunked": {"scheduling_policy": "fcfs", "enable_chunked_prefill": "false"},
    "priority": {"scheduling_policy": "priority"},
    # priority without its urgent shield (docs/scheduling.md): what the shield buys,
    # measured on the same knee and requests; asked for by name only.
    "priority-unshielded": {"scheduling_policy": "priority",
                            "priority_background_chunk_tokens": "0"},
    "mlfq": {"scheduling_policy": "mlfq"},
    "length-aware": {"scheduling_policy": "length-aware"},
}
# The urgent shield's cap (priority_background_chunk_tokens, default 128) is a trade:
# lower, the Steps around an urgent prompt are shorter and background prompts' TTFT longer.
# These servers measure other caps on the same knee and requests; by name only.
SHIELD_CAPS = (32, 64, 256)
POLICIES.update({f"priority-shield{cap}": {"scheduling_policy": "priority",
                                           "priority_background_chunk_tokens": str(cap)}
                 for cap in SHIELD_CAPS})
# Preemption by swap instead of recompute (docs/scheduling.md): the worker keeps 1 GiB of
# host memory for victims' KV, which a CPU worker has none of by default.
SWAP = {"preemption_mode": "swap", "swap_space_bytes": str(1 << 30)}
POLICIES.update({"priority-swap": {"scheduling_policy": "priority", **SWAP},
                 "mlfq-swap": {"scheduling_policy": "mlfq", **SWAP}})
BY_NAME_ONLY = frozenset({"priority-unshielded", "priority-swap", "mlfq-swap",
                          *(f"priority-shield{c}" for c in SHIELD_CAPS)})
CONTROL = "fcfs"  # every ratio column is taken against it
DEFAULT_POLICIES = tuple(p for p in POLICIES if p not in BY_NAME_ONLY)
DEFAULT_FRACTIONS = (0.5, 0.8, 1.0)  # of FCFS's knee
DEFAULT_WORKLOADS = ("azure-conv", "azure-code", "mooncake")
# The batch limit of every server (and vLLM's max_num_seqs). The policies differ only in
# which waiting request goes next, so a run must make requests wait: with the shared
# default of 64 and 32 requests none ever waited (docs/benchmarks.md). At 16 slots FCFS's
# knee on Azure conversation is where the batch is full and a queue forms (2.95 requests/s
# on the quiet machine), so 0.8 and 1.0 of it put a queue in front of the policies.
DEFAULT_BATCH_LIMIT = 16
# Measured requests per trace: 4x the batch limit on the Azure traces, so the batch fills
# and refills several times in a run, and the urgent class is 6 requests (a p99 over 6 is
# close to their maximum; fewer would be one request's luck). Mooncake's prompts are about
# 3x Azure code's, so it gets half (2x the limit). With these the default run (3 traces x
# 3 fractions x 5 policies, knee probes, idle TTFTs, warm-ups) is estimated at about 45
# minutes on the quiet 2-core machine without vLLM (`estimate_seconds`).
DEFAULT_REQUESTS = {"azure-conv": 64, "azure-code": 64, "mooncake": 32}
# Warm-up rows per server: 2x the batch limit is enough for length-aware's predictor to
# have a sample under most prompt-length bins (it needs three), and halves the warm-up of
# the earlier 64, which the measured rows' increase pays for.
DEFAULT_WARMUP = 32
DEFAULT_URGENT_FRACTION = 0.1
URGENT_PRIORITY = -10
# Seeds of the prompts (offsets from --seed): the knee probes use seed and seed + 1 + i
# (bench/rate_points.py); the measured fraction i uses MEASURED_SEED + i, the warm-up set
# WARMUP_SEED, so no measured prompt is in a cache that a probe or the warm-up filled.
MEASURED_SEED = 100
WARMUP_SEED = 1000


def num_requests(args, workload: str) -> int:
    """--num-requests for every trace where given, else the trace's default."""
    return args.num_requests or DEFAULT_REQUESTS[workload]


def policy_options(name: str, given: dict[str, str]) -> dict[str, str]:
    """The serving options of policy `name`'s server: --server-option's, then its own."""
    return {**given, **POLICIES[name]}


def check_args(args) -> None:
    """SystemExit naming what is wrong with the command line and what to give instead."""
    def fail(msg: str):
        raise SystemExit(f"bench policies: {msg}")

    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        fail(f"unknown polic(ies) {bad}; choose from {','.join(POLICIES)}")
    if len(set(args.policies)) != len(args.policies):
        fail(f"--policies names a policy twice: {','.join(args.policies)}")
    if CONTROL not in args.policies:
        fail(f"--policies must include {CONTROL}: every ratio column is taken against it")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        fail(f"unknown or no workload(s) {bad}; choose from {','.join(WORKLOADS)}")
    if len(set(args.workloads)) != len(args.workloads):
        fail(f"--workloads names a trace twice: {','.join(args.workloads)}")
    for flag, values in (("--rate-fractions", args.rate_fractions),
                         ("--knee-fractions", args.knee_fractions)):
        if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
            fail(f"{flag} wants positive fractions, got {values}")
    if args.knee_rate is not None and not (args.knee_rate > 0 and math.isfinite(args.knee_rate)):
        fail(f"--knee-rate wants a positive rate in requests/s, got {args.knee_rate}")
    if args.knee_rate is not None and len(args.workloads) != 1:
        fail("--knee-rate is one trace's knee: give one --workloads, got "
             f"{','.join(args.workloads)}")
    if not 0 <= args.urgent_fraction < 1:
        fail(f"--urgent-fraction must be in [0, 1), got {args.urgent_fraction}")
    if not -100 <= args.urgent_priority <= -1:
        fail(f"--urgent-priority must be in [-100, -1] (lower is more urgent than the "
             f"others' 0), got {args.urgent_priority}")
    if args.warmup < 0:
        fail(f"--warmup must be >= 0, got {args.warmup}")
    if args.num_requests is not None and args.num_requests < 2:
        fail(f"--num-requests must be >= 2 (a Poisson run needs two arrivals), got "
             f"{args.num_requests}")
    if args.max_rolling_batch_size < 1:
        fail(f"--max-rolling-batch-size must be >= 1, got {args.max_rolling_batch_size}")
    full = [w for w in args.workloads if num_requests(args, w) <= args.max_rolling_batch_size]
    if full:
        fail(f"{full}: --num-requests {[num_requests(args, w) for w in full]} <= "
             f"--max-rolling-batch-size {args.max_rolling_batch_size}: every request gets a "
             "batch slot at once, no queue forms and the policies cannot differ; give more "
             "requests than the batch limit, or a smaller limit")
    others = [p for p in args.peers if p != "vllm"]
    if others:
        fail(f"only the vllm peer runs here (a serving comparison), not {others}")
    for opt in args.server_option or ():
        if opt.partition("=")[0].strip().replace("-", "_") == "scheduling_policy":
            fail("--server-option scheduling_policy=...: each policy sets its own; choose "
                 "them with --policies")


def split_rows(items: Sequence[TraceItem], warmup: int) -> tuple[list[TraceItem],
                                                                   list[TraceItem]]:
    """(warm-up rows, measured rows): the first `warmup` rows of the trace warm the servers
    up (the past a server could have learned from); the next ones are measured."""
    if warmup >= len(items):
        raise ValueError(f"{len(items)} rows leave none to measure after {warmup} warm-up "
                         "rows")
    return list(items[:warmup]), list(items[warmup:])


def urgent_positions(n: int, fraction: float, seed: int) -> list[int]:
    """Positions (0..n-1) of the urgent requests: round(fraction x n) of them, at least one
    when fraction > 0, drawn from `seed` alone, so every policy and fraction has the same."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the urgent fraction must be in [0, 1), got {fraction}")
    k = 0 if fraction == 0 else max(1, round(fraction * n))
    return sorted(random.Random(f"urgent:{seed}").sample(range(n), k))


def with_priority(requests: Sequence[BenchRequest], positions: Sequence[int],
                  priority: int) -> list[BenchRequest]:
    """Copies of `requests`; those at `positions` carry `priority`, the others 0."""
    urgent = set(positions)
    return [replace(r, priority=priority if i in urgent else 0)
            for i, r in enumerate(requests)]


def urgent_class(summary: dict, positions: Sequence[int],
                 idle_ttfts_s: Sequence[float]) -> dict | None:
    """The urgent requests' TTFT in a run (`summary["per_request"]`, in request order)
    against the same prompts' TTFT alone on an idle server (`idle_ttfts_s`, in the order
    of `positions`): the class's p99 over the idle median and over the idle p99 (the
    same percentile of the same prompts: the median is pulled below it by short ones), and
    the p99 of each request's own slowdown (loaded / idle). None without urgent
    requests."""
    if not positions:
        return None
    per = summary["per_request"]
    loaded = [per[i]["ttft_s"] for i in positions]
    stats = latency_stats(loaded)
    idle_ms = 1000 * percentile(list(idle_ttfts_s), 50)
    idle_p99 = 1000 * percentile(list(idle_ttfts_s), 99)
    slowdowns = [a / b for a, b in zip(loaded, idle_ttfts_s) if b > 0]
    return {"count": len(positions), "ttft": stats, "idle_ttft_median_ms": idle_ms,
            "idle_ttft_p99_ms": idle_p99,
            "p99_over_idle": stats["p99_ms"] / idle_ms if idle_ms > 0 else float("nan"),
            "p99_over_idle_p99": (stats["p99_ms"] / idle_p99 if idle_p99 > 0
                                  else float("nan")),
            "slowdown_p99": percentile(slowdowns, 99)}


# --------------------------------------------------------------------------------------------
# How long a run takes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Speed:
    """What the estimate assumes. Rates of SmolLM2-135M in bfloat16 on the 2-core machine:
    the matrix's quiet SmolLM2 run served Azure conversation's first 64 requests (9,031
    prompt + 3,841 output tokens) all at once in 14.1 s, split between prefill and decode
    as the mid model's conversation and code runs split (docs/benchmarks.md, issue 21);
    its knee was 0.75 x the all-at-once rate. Other models run at other speeds."""

    prefill_tps: float = 1100.0
    decode_tps: float = 640.0
    server_start_s: float = 20.0
    knee_fraction: float = 0.75
    tail_s: float = 2.0  # a Poisson run's last request after its arrival
    vllm_load_s: float = 150.0


@dataclass(frozen=True)
class TraceWork:
    """Tokens of one trace's measured and warm-up sets, and the urgent prompts' tokens."""

    prompt_tokens: int
    output_tokens: int
    requests: int
    warmup_prompt_tokens: int = 0
    warmup_output_tokens: int = 0
    urgent_prompt_tokens: int = 0


def all_at_once_s(prompt_tokens: int, output_tokens: int, speed: Speed) -> float:
    return prompt_tokens / speed.prefill_tps + output_tokens / speed.decode_tps


def knee_probe_s(work: TraceWork, knee_fractions: Sequence[float], speed: Speed) -> float:
    """All at once, then the probes up to the first past the assumed knee."""
    t_all = all_at_once_s(work.prompt_tokens, work.output_tokens, speed)
    total = t_all
    for fr in sorted(knee_fractions):
        total += t_all / fr + speed.tail_s  # n requests at fr x n / t_all per second
        if fr > speed.knee_fraction:
            break
    return total


def policy_runs_s(work: TraceWork, policies: int, fractions: Sequence[float],
                  knee_rate: float, warmup_s: float, speed: Speed) -> float:
    """Each policy's server: start, warm-up, one Poisson run per fraction of the knee."""
    runs = sum(work.requests / (fr * knee_rate) + speed.tail_s for fr in fractions)
    return policies * (speed.server_start_s + warmup_s + runs)


def estimate_seconds(works: Sequence[TraceWork], *, policies: int,
                     fractions: Sequence[float], knee_fractions: Sequence[float],
                     vllm: bool, speed: Speed = Speed()) -> float:
    """The whole run: per trace a knee server (start, idle TTFTs, probes), then a server
    per policy; vLLM last (one load, every trace's points)."""
    total = vllm_runs = 0.0
    for w in works:
        t_all = all_at_once_s(w.prompt_tokens, w.output_tokens, speed)
        knee_rate = speed.knee_fraction * w.requests / t_all
        idle = len(fractions) * (w.urgent_prompt_tokens / speed.prefill_tps + 0.1)
        warm = all_at_once_s(w.warmup_prompt_tokens, w.warmup_output_tokens, speed)
        total += (speed.server_start_s + idle + knee_probe_s(w, knee_fractions, speed)
                  + policy_runs_s(w, policies, fractions, knee_rate, warm, speed))
        vllm_runs += policy_runs_s(w, 1, fractions, knee_rate, 0.0, speed) - speed.server_start_s
    return total + (speed.vllm_load_s + vllm_runs if vllm else 0.0)
