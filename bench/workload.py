"""Workloads: trace rows, length scaling, prompts of exact token length, Mooncake block
prefixes, and arrival times.

Traces hold lengths and arrival times only, no text. A prompt is made of "safe" tokens (a
space and ASCII letters, each its own pre-token, see `round_trip_tokens`), so its text
tokenizes back to exactly its token ids: every system under test sees the same ids.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data"


@dataclass(frozen=True)
class TraceSpec:
    path: Path
    name: str
    kind: str  # "azure" (CSV) or "mooncake" (JSON lines with hash_ids)


WORKLOADS: dict[str, TraceSpec] = {
    "azure-conv": TraceSpec(
        DATA / "AzureLLMInferenceTrace_conv.csv",
        "Azure LLM inference trace 2023, conversation (CC-BY 4.0, Patel et al., ISCA 2024)",
        "azure"),
    "azure-code": TraceSpec(
        DATA / "AzureLLMInferenceTrace_code.csv",
        "Azure LLM inference trace 2023, code (CC-BY 4.0, Patel et al., ISCA 2024)", "azure"),
    "mooncake": TraceSpec(
        DATA / "mooncake_conversation_trace.jsonl",
        "Mooncake conversation trace (Apache-2.0, Qin et al., FAST 2025)", "mooncake"),
}
TRACE = WORKLOADS["azure-conv"].path
TRACE_NAME = WORKLOADS["azure-conv"].name
MOONCAKE_BLOCK = 512  # tokens per hash_id in the Mooncake trace
_SAFE_TOKEN = re.compile(r" [A-Za-z]+")


# --------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """How trace lengths are mapped to the benchmark: round(n * scale), clipped to [1, cap]."""

    prompt_scale: float = 0.25
    max_prompt: int = 512
    output_scale: float = 0.5
    max_output: int = 128

    def prompt(self, n: int) -> int:
        return scale_length(n, self.prompt_scale, self.max_prompt)

    def output(self, n: int) -> int:
        return scale_length(n, self.output_scale, self.max_output)

    def describe(self) -> str:
        return (f"prompt lengths x{self.prompt_scale:g} capped at {self.max_prompt}, "
                f"output lengths x{self.output_scale:g} capped at {self.max_output} (min 1)")


def scale_length(n: int, scale: float, cap: int) -> int:
    """`n * scale` rounded half up, clipped to [1, cap]."""
    return max(1, min(cap, math.floor(n * scale + 0.5)))


def mooncake_scale(block_tokens: int, context: int, max_output: int) -> Scale:
    """Mooncake lengths scaled like its blocks (512 -> `block_tokens`); the prompt is capped
    at the model's context minus the longest output."""
    f = block_tokens / MOONCAKE_BLOCK
    return Scale(f, context - max_output, f, max_output)


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceItem:
    index: int
    trace_prompt: int  # lengths as in the trace
    trace_output: int
    prompt_len: int  # lengths the benchmark uses
    output_len: int
    arrival_s: float = 0.0  # the trace's timestamp, seconds after its first row
    hash_ids: tuple[int, ...] = ()  # Mooncake: ids of the trace's 512-token prefix blocks


def _azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> POSIX seconds (7 fractional digits are allowed); nan
    when unreadable (such a trace can still be sent all at once or at a Poisson rate)."""
    head, _, frac = text.strip().partition(".")
    try:
        t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
        return t + (float(f"0.{frac}") if frac else 0.0)
    except ValueError:
        return float("nan")


def load_trace(path: str | Path, num_requests: int, scale: Scale) -> list[TraceItem]:
    """The first `num_requests` rows of an Azure trace CSV, with scaled lengths."""
    items: list[TraceItem] = []
    t0 = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(items) == num_requests:
                break
            p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            t = _azure_time(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            items.append(TraceItem(len(items), p, o, scale.prompt(p), scale.output(o), t - t0))
    if len(items) < num_requests:
        raise ValueError(f"{path} has {len(items)} rows; asked for {num_requests}")
    return items


def load_mooncake(path: str | Path, num_requests: int, scale: Scale) -> list[TraceItem]:
    """The first `num_requests` lines of a Mooncake trace (timestamps in ms), scaled."""
    items: list[TraceItem] = []
    t0 = None
    with open(path) as f:
        for line in f:
            if len(items) == num_requests:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            p, o = int(row["input_length"]), int(row["output_length"])
            t = float(row["timestamp"]) / 1000
            t0 = t if t0 is None else t0
            items.append(TraceItem(len(items), p, o, scale.prompt(p), scale.output(o), t - t0,
                                   tuple(int(h) for h in row["hash_ids"])))
    if len(items) < num_requests:
        raise ValueError(f"{path} has {len(items)} rows; asked for {num_requests}")
    return items


def load_workload(name: str, num_requests: int, scale: Scale,
                  path: str | Path | None = None) -> list[TraceItem]:
    spec = WORKLOADS[name]
    loader = load_mooncake if spec.kind == "mooncake" else load_trace
    return loader(path or spec.path, num_requests, scale)


def ideal_prefix_hit_rate(items: Sequence[TraceItem], block_tokens: int) -> float:
    """Fraction of prompt tokens an unbounded block cache could serve, replaying `items` in
    order (each finished before the next starts): the leading blocks of a request already
    seen, whole blocks only (a partial last block is never matched)."""
    seen: set[int] = set()
    hit = total = 0
    for it in items:
        blocks = mooncake_blocks(it, block_tokens)
        for h, n in blocks:
            if h not in seen or n < block_tokens:
                break
            hit += n
        seen.update(h for h, n in blocks if n == block_tokens)
        total += it.prompt_len
    return hit / total if total else 0.0


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def round_trip_tokens(tokenizer) -> list[int]:
    """Token ids whose text is a space and ASCII letters and that encode back to themselves.

    Text made of such tokens tokenizes to exactly those ids (each is its own pre-token)."""
    special = set(tokenizer.all_special_ids)
    safe = []
    for tid in range(len(tokenizer)):
        if tid in special:
            continue
        text = tokenizer.decode([tid])
        if _SAFE_TOKEN.fullmatch(text) and tokenizer(text).input_ids == [tid]:
            safe.append(tid)
    if not safe:
        raise ValueError("the tokenizer has no token of the form ' letters' that round-trips")
    return safe


def make_prompt(tokenizer, n: int, rng: random.Random,
                safe: Sequence[int]) -> tuple[str, list[int]]:
    """Random text of exactly `n` tokens (as the scheduler tokenizes it) and its token ids."""
    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    ids = [rng.choice(safe) for _ in range(n)]
    text = tokenizer.decode(ids)
    encoded = tokenizer(text).input_ids
    for _ in range(4 * n + 100):
        if len(encoded) == n:
            break
        if len(encoded) < n:
            ids.append(rng.choice(safe))
        else:
            ids.pop()
        text = tokenizer.decode(ids)
        encoded = tokenizer(text).input_ids
    assert len(encoded) == n, f"could not build a prompt of {n} tokens (got {len(encoded)})"
    return text, list(encoded)


@dataclass
class BenchRequest:
    index: int
    prompt: str
    prompt_ids: list[int]
    output_len: int
    cached_prompt: str = ""  # sent as `cached_prompt`; its tokens are part of prompt_ids
    priority: int = 0  # sent as GenerateRequest.priority (lower is more urgent)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def wire_prompt(self) -> str | list[int]:
        """What the load generator sends seqserve: the token ids, as vLLM (TokensPrompt)
        and the HF baselines are given them, so that no system tokenizes inside its timed
        run; the text where `cached_prompt` needs one (the server takes it only with a
        text prompt)."""
        return self.prompt if self.cached_prompt else self.prompt_ids


def build_requests(tokenizer, items: Sequence[TraceItem], seed: int) -> list[BenchRequest]:
    """Random safe-token prompts of each item's exact length, from `seed`."""
    rng = random.Random(seed)
    safe = round_trip_tokens(tokenizer)
    out = []
    for it in items:
        text, ids = make_prompt(tokenizer, it.prompt_len, rng, safe)
        out.append(BenchRequest(it.index, text, ids, it.output_len))
    return out


def mooncake_blocks(item: TraceItem, block_tokens: int) -> list[tuple[int, int]]:
    """(block id, tokens taken from it) covering `item.prompt_len` tokens: whole blocks, then a
    partial last one. Blocks past the trace's hash_ids (rounding) get ids of their own."""
    n_blocks = math.ceil(item.prompt_len / block_tokens)
    out = []
    for b in range(n_blocks):
        h = item.hash_ids[b] if b < len(item.hash_ids) else -(item.index * 100_000 + b + 1)
        out.append((h, min(block_tokens, item.prompt_len - b * block_tokens)))
    return out


def block_tokens_for(h: int, block_tokens: int, safe: Sequence[int], seed: int) -> list[int]:
    """The token ids of block `h`: a fixed function of (seed, h)."""
    rng = random.Random(f"mooncake-block:{seed}:{h}")
    return [rng.choice(safe) for _ in range(block_tokens)]


def mooncake_prompt_ids(item: TraceItem, block_tokens: int, safe: Sequence[int],
                        seed: int) -> list[int]:
    """Prompt token ids built block by block: requests sharing leading hash_ids share a token
    prefix; a partial last block uses a prefix of its block's tokens."""
    ids: list[int] = []
    for h, n in mooncake_blocks(item, block_tokens):
        ids += block_tokens_for(h, block_tokens, safe, seed)[:n]
    return ids


def build_mooncake_requests(tokenizer, items: Sequence[TraceItem], block_tokens: int,
                            seed: int) -> list[BenchRequest]:
    """Mooncake prompts from block ids; checks that each text tokenizes back to its ids."""
    safe = round_trip_tokens(tokenizer)
    out = []
    for it in items:
        ids = mooncake_prompt_ids(it, block_tokens, safe, seed)
        text = tokenizer.decode(ids)
        got = tokenizer(text).input_ids
        if got != ids:
            raise AssertionError(f"request {it.index}: the prompt text tokenizes to {len(got)} "
                                 f"ids that differ from its {len(ids)} block ids")
        out.append(BenchRequest(it.index, text, ids, it.output_len))
    return out


def build_workload_requests(tokenizer, name: str, items: Sequence[TraceItem], seed: int,
                            block_tokens: int) -> list[BenchRequest]:
    if WORKLOADS[name].kind == "mooncake":
        return build_mooncake_requests(tokenizer, items, block_tokens, seed)
    return build_requests(tokenizer, items, seed)


def length_stats(values: Sequence[int]) -> dict[str, float]:
    from bench.stats import percentile

    return {"sum": int(sum(values)), "min": min(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "max": max(values)}


# --------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------


ARRIVALS = ("all", "poisson", "trace")


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process of `rate` requests/s: the first at 0, then
    exponential gaps of mean 1/rate, from `random.Random(seed)` (vLLM sends the first at
    once and sleeps a gap after each)."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def trace_arrivals(items: Sequence[TraceItem], speedup: float) -> list[float]:
    """The trace's own timestamps, relative to the first replayed row, divided by `speedup`."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    t0 = items[0].arrival_s if items else 0.0
    out = [(it.arrival_s - t0) / speedup for it in items]
    if any(math.isnan(x) for x in out):
        raise ValueError("the trace has unreadable timestamps: use Poisson or all-at-once arrivals")
    return out


def arrivals(kind: str, items: Sequence[TraceItem], *, rate: float | None = None,
             speedup: float = 1.0, seed: int = 0) -> list[float]:
    if kind == "all":
        return [0.0] * len(items)
    if kind == "poisson":
        if not rate:
            raise ValueError("Poisson arrivals need a rate (requests/s)")
        return poisson_arrivals(len(items), rate, seed)
    if kind == "trace":
        return trace_arrivals(items, speedup)
    raise ValueError(f"unknown arrival {kind!r}; choose one of {', '.join(ARRIVALS)}")


def describe_arrivals(kind: str, *, rate: float | None = None, speedup: float = 1.0,
                      max_concurrency: int | None = None) -> str:
    text = {"all": "all at once", "poisson": f"Poisson at {rate:g} requests/s" if rate else
            "Poisson", "trace": f"trace timestamps sped up x{speedup:g}"}[kind]
    return text + (f", at most {max_concurrency} in flight" if max_concurrency else "")
