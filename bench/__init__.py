"""Benchmarks: seqserve against its peers, splitting sweep, prefix cache, a load generator.

    python -m bench throughput   # seqserve vs HF generate, output tokens/s
    python -m bench sweep        # max_sparsity x max_splits grid
    python -m bench partition    # plan_partition time for 512 lengths
    python -m bench prefix       # cached_prompt TTFT warm vs off, Mooncake
    python -m bench peers        # seqserve vs HF, transformers CB, vLLM; ceiling
    python -m bench serve        # load generator: at once, Poisson, trace times
    python -m bench ceiling      # the model's own forward throughput at given shapes
    python -m bench matrix       # seqserve vs vLLM/HF: models x traces x rates; the floor
    python -m bench policies     # scheduling policies vs FCFS at fractions of its knee
    python -m bench all          # every figure of docs/benchmarks.md

With no subcommand `throughput` runs.

Workloads (--workload): the Azure LLM inference traces 2023 (azure-conv, azure-code) and the
Mooncake conversation trace (mooncake), in bench/data/ with their licenses. Lengths are scaled
down for a small CPU model (the scale is printed with every result); prompts are token ids
drawn from a seed (text that tokenizes back to exactly those ids), and every request generates
exactly its output length (ignore_eos). Mooncake prompts are built block by block from the
trace's hash_ids, so requests that share blocks share a token prefix.

Each seqserve run starts its own worker and scheduler processes on loopback ephemeral ports
(or loads a running server: serve --address) and stops them after; in-process peers (HF static
batches, transformers continuous batching) and the forward-pass ceiling run while no server
runs; vLLM runs as a subprocess in .bench-peers-venv/ (`make bench-peers`), skipped with a
message where that is missing. Results go to --out as JSON and markdown, plots to --plot-dir.
Latency definitions follow vLLM's benchmark_serving: TTFT = first token - send,
TPOT = (e2e - TTFT) / (output tokens - 1), ITL = every gap between consecutive tokens;
goodput counts requests meeting every --goodput-* limit, per second.
"""

from __future__ import annotations

from typing import Sequence

from bench.ceiling import decode_shape, forward_ceiling, run_ceiling
from bench.commands.common import DEFAULT_MODEL, prepare
from bench.commands.prefix import cached_prompt_requests, select_conversations
from bench.commands.serve import RATE_FRACTIONS, knee
from bench.commands.sweep import REFERENCE_POINT, SWEEP_SPARSITIES, SWEEP_SPLITS
from bench.deployment import Deployment
from bench.metrics import GaugePeak, scrape, server_metrics, worker_metrics
from bench.env import environment, machine_cores, model_dtype, resolve_device
from bench.loadgen import (SeqserveTarget, bench_seqserve, send_all, send_requests,
                           send_sequential)
from bench.parser import COMMANDS
from bench.peer_systems import PEERS, bench_hf, bench_hf_cb, run_vllm, vllm_available
from bench.profiling import Profiler, summarize_collapsed
from bench.stats import (RequestResult, Slo, goodput, latency_stats, meets, percentile,
                         summarize)
from bench.workload import (MOONCAKE_BLOCK, TRACE, TRACE_NAME, WORKLOADS, BenchRequest,
                            Scale, TraceItem, arrivals, block_tokens_for,
                            build_mooncake_requests, build_requests,
                            ideal_prefix_hit_rate, length_stats, load_mooncake,
                            load_trace, load_workload, make_prompt, mooncake_blocks,
                            mooncake_prompt_ids, mooncake_scale, poisson_arrivals,
                            round_trip_tokens, scale_length, trace_arrivals)


__all__ = [
    "main", "decode_shape", "forward_ceiling", "run_ceiling", "COMMANDS", "DEFAULT_MODEL",
    "RATE_FRACTIONS", "REFERENCE_POINT", "SWEEP_SPARSITIES", "SWEEP_SPLITS",
    "cached_prompt_requests", "knee", "prepare", "select_conversations", "Deployment",
    "GaugePeak", "Profiler", "scrape", "server_metrics", "summarize_collapsed",
    "worker_metrics", "environment", "machine_cores", "model_dtype", "resolve_device",
    "SeqserveTarget", "bench_seqserve", "send_all", "send_requests", "send_sequential",
    "PEERS", "bench_hf", "bench_hf_cb", "run_vllm", "vllm_available", "RequestResult", "Slo",
    "goodput", "latency_stats", "meets", "percentile", "summarize", "MOONCAKE_BLOCK", "TRACE",
    "TRACE_NAME", "WORKLOADS", "BenchRequest", "Scale", "TraceItem", "arrivals",
    "block_tokens_for", "build_mooncake_requests", "build_requests", "ideal_prefix_hit_rate",
    "length_stats", "load_mooncake", "load_trace", "load_workload", "make_prompt",
    "mooncake_blocks", "mooncake_prompt_ids", "mooncake_scale", "poisson_arrivals",
    "round_trip_tokens", "scale_length", "trace_arrivals",
]


def main(argv: Sequence[str] | None = None) -> int:
    from bench.cli import main as _main

    return _main(argv, __doc__)
