"""The floor of a benchmark run: the least time this machine could take for the run's work,
from two measured rates (bench/machine_rates.py) and the model's shapes, to set beside each
system's measured time.

Work counted (docs/benchmarks.md, "The floor"):
- compute: the model's linear layers only (fused qkv, o, fused gate/up, down per layer, the
  LM head), 2 * M * K * N FLOPs for M rows, at this CPU's bfloat16 GEMM rate measured at that
  (K, N) and that M (the rate of thin products differs from square ones severalfold, so one
  peak figure would not do). The LM head runs only for rows that produce a token, and so
  does the last layer after its q/k/v product: a prompt token that yields none needs that
  layer's keys and values, never its hidden state (seqserve and llama.cpp skip the rest;
  vLLM does not). Attention's own FLOPs, norms, activations and sampling are not counted:
  a floor, not an estimate.
- memory: every step reads all weights once and the KV of every sequence in it (its whole
  context, bfloat16), at the measured memory bandwidth. KV writes are not counted.
- a step's floor = compute + memory: the two are added, as if no step overlapped its weight
  streaming with arithmetic; `overlap_s` keeps the sum of max(compute, memory) per step, the
  strict bound for an engine that overlapped them perfectly.

Steps: an ideal continuous-batching engine (`simulate`) with the run's batch limit. Requests
join at their arrival times in arrival order; in the step after a request joins, its whole
prompt (less what an unbounded prefix cache already holds: `ideal_cached_tokens`) is
prefilled and yields its first token; every other running request decodes one token per
step; a request leaves when it has all its tokens. Prefill rows and decode rows share a
step's products (M = prompt rows + decode rows), as in a packed or chunked-prefill step. The
clock advances by each step's floor and jumps to the next arrival when nothing runs, so for
Poisson runs the floor includes the arrival span, as a measured run's duration does.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PREFIX_BLOCK = 16  # tokens per block of the ideal prefix cache (vLLM's block size)


@dataclass(frozen=True)
class Gemm:
    """One linear product of the model: [M, k] x [k, n], `count` times per forward row
    (the number of layers, or 1 for the LM head)."""

    name: str
    k: int
    n: int
    count: int

    @property
    def key(self) -> str:
        return f"{self.k}x{self.n}"


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs of a Llama-style decoder (Llama, Qwen2, Mistral, SmolLM2)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, cfg: Mapping) -> ModelShape:
        """From a config.json dict; an architecture without these fields (GPT-2, OPT) has
        other layer shapes, which this floor does not model."""
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"the floor models Llama-style decoders; this config lacks "
                             f"{missing} (model_type {cfg.get('model_type')!r})")
        heads = cfg["num_attention_heads"]
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        return cls(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   dtype_bytes=DTYPE_BYTES.get(dtype, 2),
                   tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    def gemms(self) -> list[Gemm]:
        """The per-layer products fused as serving engines run them (q, k, v in one product;
        gate and up in one), then the LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [Gemm("qkv", self.hidden, q + 2 * kv, self.layers),
                Gemm("o", q, self.hidden, self.layers),
                Gemm("gate_up", self.hidden, 2 * self.intermediate, self.layers),
                Gemm("down", self.intermediate, self.hidden, self.layers),
                Gemm("lm_head", self.hidden, self.vocab, 1)]

    def layer_gemms(self) -> list[Gemm]:
        return [g for g in self.gemms() if g.name != "lm_head"]

    def lm_head(self) -> Gemm:
        return self.gemms()[-1]

    def row_gemms(self, rows: int, logit_rows: int) -> list[tuple[Gemm, int]]:
        """The products a forward of `rows` tokens needs, each with its row count, when
        `logit_rows` of them yield a token: every layer's q/k/v for every row, the rest of
        the last layer and the LM head only for the rows that yield a token."""
        out = []
        for g in self.layer_gemms():
            if g.name == "qkv" or g.count < 1:
                out.append((g, rows))
                continue
            out.append((replace(g, count=g.count - 1), rows))
            out.append((replace(g, count=1), logit_rows))
        return out + [(self.lm_head(), logit_rows)]

    def linear_flops(self, rows: int, logit_rows: int) -> float:
        """FLOPs of the linear layers for `rows` tokens, `logit_rows` of them yielding a
        token (row_gemms)."""
        return sum(2 * m * g.k * g.n * g.count for g, m in self.row_gemms(rows, logit_rows))

    def weight_bytes(self) -> int:
        """Bytes of weights a forward reads: every linear weight (the LM head once, tied or
        not: a tied LM head is the embedding matrix)."""
        return sum(g.k * g.n * g.count for g in self.gemms()) * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class MachineRates:
    """Measured rates: bfloat16 GEMM FLOP/s per (k x n) at given row counts M, and memory
    bandwidth in bytes/s."""

    gemm: dict[str, list[tuple[int, float]]]
    bandwidth: float
    detail: dict = field(default_factory=dict)

    def gemm_rate(self, gemm: Gemm, m: int) -> float:
        """FLOP/s of `gemm` at `m` rows: measured points interpolated linearly in log2(M),
        the nearest measured M's rate outside them."""
        pts = sorted(self.gemm.get(gemm.key) or ())
        if not pts:
            raise KeyError(f"no GEMM rate measured for {gemm.name} ({gemm.key}); measure the "
                           f"model's shapes first (bench.machine_rates.measure_model)")
        ms = [p[0] for p in pts]
        if m <= ms[0]:
            return pts[0][1]
        if m >= ms[-1]:
            return pts[-1][1]
        i = bisect_left(ms, m)
        (m0, r0), (m1, r1) = pts[i - 1], pts[i]
        w = (math.log2(m) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
        return r0 + w * (r1 - r0)

    def gemm_seconds(self, gemm: Gemm, m: int) -> float:
        if m <= 0:
            return 0.0
        return gemm.count * 2 * m * gemm.k * gemm.n / self.gemm_rate(gemm, m)


@dataclass(frozen=True)
class StepFloor:
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.memory_s


def step_floor(shape: ModelShape, rates: MachineRates, rows: int, logit_rows: int,
               kv_tokens: int) -> StepFloor:
    """One forward step: `rows` tokens through the layers, `logit_rows` of them yielding a
    token (the last layer's rest and the LM head), `kv_tokens` cached tokens read by
    attention."""
    compute = sum(rates.gemm_seconds(g, m) for g, m in shape.row_gemms(rows, logit_rows))
    memory = (shape.weight_bytes() + kv_tokens * shape.kv_bytes_per_token()) / rates.bandwidth
    return StepFloor(compute, memory)


@dataclass(frozen=True)
class FloorRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    cached_tokens: int = 0  # prompt tokens an ideal prefix cache holds when it arrives


@dataclass
class FloorRun:
    duration_s: float = 0.0  # first arrival (0) to the last token
    steps: int = 0
    prefill_steps: int = 0  # steps that prefilled at least one prompt
    compute_s: float = 0.0
    memory_s: float = 0.0
    overlap_s: float = 0.0  # sum of max(compute, memory) per step
    prompt_rows: int = 0
    decode_rows: int = 0
    output_tokens: int = 0
    linear_flops: float = 0.0
    bytes_read: float = 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__},
                "output_throughput": self.output_throughput}


def simulate(shape: ModelShape, rates: MachineRates, requests: Sequence[FloorRequest],
             max_batch: int) -> FloorRun:
    """The ideal engine of the module docstring, stepped until every request is done."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    run, clock, nxt = FloorRun(), 0.0, 0
    running: dict[int, int] = {}  # request -> tokens generated so far
    kv_bytes = shape.kv_bytes_per_token()
    while nxt < len(order) or running:
        if not running and requests[order[nxt]].arrival_s > clock:
            clock = requests[order[nxt]].arrival_s  # idle until the next arrival
        new = []
        while (nxt < len(order) and len(running) + len(new) < max_batch
               and requests[order[nxt]].arrival_s <= clock):
            new.append(order[nxt])
            nxt += 1
        prompt_rows = sum(requests[i].prompt_len - min(requests[i].cached_tokens,
                                                       requests[i].prompt_len - 1) for i in new)
        kv = (sum(requests[i].prompt_len for i in new)
              + sum(requests[i].prompt_len + g for i, g in running.items()))
        rows, logit_rows = prompt_rows + len(running), len(new) + len(running)
        step = step_floor(shape, rates, rows, logit_rows, kv)
        clock += step.seconds
        run.steps += 1
        run.prefill_steps += bool(new)
        run.compute_s += step.compute_s
        run.memory_s += step.memory_s
        run.overlap_s += max(step.compute_s, step.memory_s)
        run.prompt_rows += prompt_rows
        run.decode_rows += len(running)
        run.linear_flops += shape.linear_flops(rows, logit_rows)
        run.bytes_read += shape.weight_bytes() + kv * kv_bytes
        for i in list(running):
            running[i] += 1
        for i in new:
            running[i] = 1
        run.output_tokens += logit_rows
        for i in [i for i, g in running.items() if g >= requests[i].output_len]:
            del running[i]
    run.duration_s = clock
    return run


def ideal_cached_tokens(prompts: Sequence[Sequence[int]], arrivals: Sequence[float],
                        block: int = PREFIX_BLOCK) -> list[int]:
    """Per prompt, the tokens an unbounded prefix cache holds when it arrives: the longest
    whole-block prefix that an earlier prompt (in arrival order) had."""
    # A block's key is the hash of its tokens and its predecessor's key: the whole prefix.
    seen: set[int] = set()
    out = [0] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda j: arrivals[j]):
        ids, key, keys = list(prompts[i]), 0, []
        for b in range(block, len(ids) + 1, block):
            key = hash((key, tuple(ids[b - block:b])))
            keys.append(key)
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        out[i] = hit * block
        seen.update(keys)
    return out


def run_floor(shape: ModelShape, rates: MachineRates, prompts: Sequence[Sequence[int]],
              output_lens: Sequence[int], arrivals: Sequence[float] | None,
              max_batch: int) -> FloorRun:
    """The floor of one run: these prompts (token ids) and output lengths sent at `arrivals`
    (all at once when None)."""
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    cached = ideal_cached_tokens(prompts, arrivals)
    reqs = [FloorRequest(a, len(p), o, c)
            for p, o, a, c in zip(prompts, output_lens, arrivals, cached)]
    return simulate(shape, rates, reqs, max_batch)


def floors_by_system(runs: Mapping[str, dict],
                     floor_at: Callable[[float], FloorRun]) -> dict[str, dict]:
    """For each of `runs` (system -> its run's summary) with `bandwidth_probes`, its own
    floor: `floor_at` the mean of its probes (bytes/s), the host's bandwidth moving
    between runs minutes apart (bench/bandwidth_probe.py)."""
    own = {}
    for name, summary in runs.items():
        probes = (summary or {}).get("bandwidth_probes")
        if probes:
            bandwidth = sum(probes) / len(probes)
            own[name] = {"bandwidth": bandwidth, "probes": probes,
                         "duration_s": floor_at(bandwidth).duration_s}
    return own


def fraction_of_floor(floor_s: float, measured_s: float | None) -> float:
    """floor time / measured time (1.0: the run took its floor)."""
    if not measured_s or measured_s <= 0 or math.isnan(measured_s):
        return float("nan")
    return floor_s / measured_s
