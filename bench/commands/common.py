"""What every subcommand shares: the model, the requests and the record of how they were
made, the command line, and the seqserve options given on it."""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.bandwidth_probe import bandwidth_now, probed
from bench.env import environment, model_context, model_dtype
from bench.loadgen import bench_seqserve
from bench.peer_systems import PEERS, bench_hf, bench_hf_cb
from bench.stats import Slo
from bench.workload import (WORKLOADS, BenchRequest, Scale, TraceItem, build_workload_requests,
                            ideal_prefix_hit_rate, length_stats, load_workload, mooncake_scale)

logger = logging.getLogger("seqserve.bench")

DEFAULT_MODEL = Path("models/mid-llama-bf16")


def ensure_model(model_dir: Path) -> Path:
    """The model directory; the default mid model is written if missing."""
    if not (model_dir / "config.json").exists():
        if model_dir != DEFAULT_MODEL:
            raise SystemExit(f"no model at {model_dir} (config.json missing)")
        from worker_service.fixtures import make_model

        logger.info("writing the benchmark model to %s (mid llama, bfloat16)", model_dir)
        make_model(model_dir, arch="llama", size="mid", dtype="bfloat16")
    return model_dir


def workload_scale(args, model_dir: Path) -> Scale:
    """The length scale of args.workload: Azure traces by --prompt-scale/--output-scale;
    Mooncake by its block size (512 -> --mooncake-block tokens), capped at the context."""
    if WORKLOADS[args.workload].kind == "mooncake":
        max_out = args.max_output or 32
        return mooncake_scale(args.mooncake_block, model_context(model_dir) or 2048, max_out)
    return Scale(args.prompt_scale, args.max_prompt, args.output_scale, args.max_output or 128)


def check_context(model_dir: Path, items: Sequence[TraceItem]) -> None:
    max_pos = model_context(model_dir)
    longest = max(it.prompt_len + it.output_len for it in items)
    if max_pos and longest > max_pos:
        raise SystemExit(f"a request needs {longest} positions; the model has {max_pos}: "
                         f"lower --max-prompt / --max-output")


def prepare(args, workload: str | None = None) -> tuple[Path, list[BenchRequest], Any, dict]:
    """Model (made if it is the missing default), requests, tokenizer and the workload record."""
    from transformers import AutoTokenizer

    workload = workload or args.workload
    model_dir = ensure_model(Path(args.model))
    args_w = argparse.Namespace(**{**vars(args), "workload": workload})
    scale = workload_scale(args_w, model_dir)
    spec = WORKLOADS[workload]
    trace = args.trace if (args.trace and workload == args.workload) else spec.path
    items = load_workload(workload, args.num_requests, scale, trace)
    check_context(model_dir, items)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload_requests(tokenizer, workload, items, args.seed, args.mooncake_block)
    meta = workload_meta(args, model_dir, workload, trace, items, requests, scale)
    return model_dir, requests, tokenizer, meta


def workload_meta(args, model_dir: Path, workload: str, trace, items, requests, scale: Scale,
                  arrival: str = "all at once") -> dict:
    meta = {
        "workload": workload, "trace": str(Path(trace)), "trace_name": WORKLOADS[workload].name,
        "num_requests": len(requests), "seed": args.seed, "arrival": arrival,
        "scale": asdict(scale), "scale_text": scale.describe(),
        "prompt": length_stats([r.prompt_len for r in requests]),
        "output": length_stats([r.output_len for r in requests]),
        "model": str(model_dir), "dtype": model_dtype(model_dir), "device": args.device,
        "env": environment(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }
    if WORKLOADS[workload].kind == "mooncake":
        meta["mooncake_block_tokens"] = args.mooncake_block
        meta["ideal_prefix_hit_rate"] = ideal_prefix_hit_rate(items, args.mooncake_block)
    return meta


_ARGV: list[str] = []


def command_line() -> str:
    """The command that made a result, as a person would type it."""
    return "python -m bench " + " ".join(shlex.quote(a) for a in _ARGV)


def set_command_line(argv: Sequence[str]) -> None:
    _ARGV[:] = argv


def server_options(args) -> dict[str, str]:
    """--server-option KEY=VALUE (repeatable): serving options for both seqserve processes."""
    options = {}
    for opt in getattr(args, "server_option", None) or ():
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise SystemExit(f"--server-option wants KEY=VALUE, got {opt!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


def slo_limits(args) -> Slo | None:
    slo = Slo(args.goodput_ttft_ms, args.goodput_tpot_ms, args.goodput_e2e_ms)
    return slo if slo else None


def run_seqserve_offline(args, model_dir, requests, tokenizer, meta, name: str,
                         slo: Slo | None = None, probe_bandwidth: bool = False,
                         stream: bool = True) -> dict:
    """seqserve on `requests` all at once, streamed (or as GenerateUnary calls). The peak
    padded-slots gauge is not reported by these commands, so it is polled once a second
    rather than ten times. With `probe_bandwidth`, the memory's bandwidth is probed around
    the run (bytes/s in `bandwidth_probes`)."""
    profile = Path(args.out) / "profile" / name if getattr(args, "profile", False) else None
    return bench_seqserve(model_dir, requests, tokenizer, max_sparsity=args.max_sparsity,
                          max_splits=args.max_splits,
                          max_rolling_batch_size=args.max_rolling_batch_size,
                          logdir=Path(args.out) / "logs" / name, dtype=meta["dtype"],
                          device=args.device, slo=slo, profile_dir=profile,
                          poll_interval=1.0, server_options=server_options(args),
                          bandwidth_probe=bandwidth_now if probe_bandwidth else None,
                          stream=stream)


def run_hf_peers(args, model_dir: Path, requests: Sequence[BenchRequest], peers: Sequence[str],
                 slo: Slo | None, what: str = "") -> dict[str, dict]:
    """The HF baselines among `peers` on `requests` all at once, in process, each probed
    around its run unless --no-floor; transformers continuous batching's failure is
    reported as skipped (`what`: the workload, for the log)."""
    measure = None if args.no_floor else bandwidth_now
    out: dict[str, dict] = {}
    if "hf" in peers:
        out["hf"] = probed(lambda: bench_hf(model_dir, requests, batch_size=args.hf_batch_size,
                                            threads=args.hf_threads, device=args.device),
                           measure)
    if "hf-cb" in peers:
        try:
            out["hf-cb"] = probed(lambda: bench_hf_cb(model_dir, requests,
                                                      threads=args.hf_threads,
                                                      device=args.device, slo=slo),
                                  measure)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is reported, not fatal
            logger.exception("transformers continuous batching failed%s",
                             f" on {what}" if what else "")
            out["hf-cb"] = {"skipped": f"transformers continuous batching failed: {exc!r}"}
    return out


def selected_peers(args) -> list[str]:
    return [p for p in args.peers if p in PEERS]


def vllm_kwargs(args) -> dict:
    return {"max_num_seqs": args.max_rolling_batch_size, "kv_space_gib": args.vllm_kv_gib,
            "threads_bind": args.vllm_threads_bind, "enforce_eager": args.vllm_enforce_eager,
            "preload": args.vllm_preload, "dtype": args.vllm_dtype}


def without_per_request(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "per_request"}


def offline_floor(args, model_dir: Path, requests: Sequence[BenchRequest],
                  systems: Mapping[str, dict] | None = None) -> dict | None:
    """The floor of `requests` all at once (bench/floor.py), rates measured here and now
    (no server may run meanwhile); None with --no-floor. Each of `systems` (name -> its
    run's summary) whose run has `bandwidth_probes` also gets a floor of its own in
    `by_system`: the same GEMM rates, and the bandwidth at the mean of its probes, since
    the host's bandwidth moves between runs minutes apart."""
    if getattr(args, "no_floor", False):
        return None
    import json

    from bench.floor import ModelShape, floors_by_system, run_floor
    from bench.machine_rates import measure_model

    shape = ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    rates = measure_model(shape, threads=getattr(args, "hf_threads", None))

    def floor_at(r):
        return run_floor(shape, r, [q.prompt_ids for q in requests],
                         [q.output_len for q in requests], None, args.max_rolling_batch_size)

    run = floor_at(rates)
    by_system = floors_by_system(systems or {},
                                 lambda bandwidth: floor_at(replace(rates, bandwidth=bandwidth)))
    return {**run.as_dict(), "bandwidth": rates.bandwidth, "by_system": by_system,
            "gemm_gflops": {k: [(m, r / 1e9) for m, r in pts] for k, pts in rates.gemm.items()}}
