"""Benchmarks: seqserve against a Hugging Face `generate` baseline, and the splitting sweep.

    python -m client.bench throughput     # seqserve vs HF generate, output tokens/s (issue 2)
    python -m client.bench sweep          # max_sparsity x max_splits grid (issue 3)
    python -m client.bench partition      # plan_partition time for 512 lengths
    python -m client.bench all            # the three above

With no subcommand `throughput` runs. The workload is the Azure LLM inference trace 2023
(conversation service, bench/data/): the first --num-requests rows, prompt and output lengths
scaled down for a small CPU model (the scale is printed with every result), every request
sent at once (offline throughput). Prompts are random text of exactly the trace's token
length; every request generates exactly its output length (ignore_eos).

Each seqserve run starts its own worker and scheduler processes on loopback ephemeral ports
and stops them before the next run; the HF baseline runs in this process while no server
runs, so the two never compete for the cores. Results go to --out as JSON and markdown.
Latency definitions follow vLLM's benchmark_serving: TTFT = first token - send,
TPOT = (e2e - TTFT) / (output tokens - 1), ITL = every gap between consecutive tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import logging
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
import timeit
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger("seqserve.bench")

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"
TRACE_NAME = "Azure LLM inference trace 2023, conversation (CC-BY 4.0, Patel et al., ISCA 2024)"
DEFAULT_MODEL = Path("models/mid-llama-bf16")
COMMANDS = ("throughput", "sweep", "partition", "all")
SWEEP_SPARSITIES = (0.0, 0.1, 0.33, 0.6, 0.9)
SWEEP_SPLITS = (1, 2, 3, 4, 8)
REFERENCE_POINT = (0.33, 3)  # the default configuration, compared with max_splits=1
_SAFE_TOKEN = re.compile(r" [A-Za-z]+")


# --------------------------------------------------------------------------------------------
# Workload: trace rows, scaling, prompts of exact token length
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


@dataclass(frozen=True)
class TraceItem:
    index: int
    trace_prompt: int  # lengths as in the trace
    trace_output: int
    prompt_len: int  # lengths the benchmark uses
    output_len: int


def load_trace(path: str | Path, num_requests: int, scale: Scale) -> list[TraceItem]:
    """The first `num_requests` rows of an Azure trace CSV, with scaled lengths."""
    items: list[TraceItem] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(items) == num_requests:
                break
            p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            items.append(TraceItem(len(items), p, o, scale.prompt(p), scale.output(o)))
    if len(items) < num_requests:
        raise ValueError(f"{path} has {len(items)} rows; asked for {num_requests}")
    return items


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


def make_prompt(tokenizer, n: int, rng: random.Random, safe: Sequence[int]) -> tuple[str, list[int]]:
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

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def build_requests(tokenizer, items: Sequence[TraceItem], seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    safe = round_trip_tokens(tokenizer)
    out = []
    for it in items:
        text, ids = make_prompt(tokenizer, it.prompt_len, rng, safe)
        out.append(BenchRequest(it.index, text, ids, it.output_len))
    return out


def length_stats(values: Sequence[int]) -> dict[str, float]:
    return {"sum": int(sum(values)), "min": min(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "max": max(values)}


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


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
    """mean / median / p99 in milliseconds."""
    if not values_s:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    return {"mean_ms": 1000 * sum(values_s) / len(values_s),
            "median_ms": 1000 * percentile(values_s, 50),
            "p99_ms": 1000 * percentile(values_s, 99)}


# --------------------------------------------------------------------------------------------
# Deployment: a worker and a scheduler process on loopback, ephemeral ports
# --------------------------------------------------------------------------------------------


def _wait_port_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode}; log {log}:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"{proc.args[2]} wrote no port file in {timeout:.0f} s; log {log}")


class Deployment:
    """One worker and one scheduler started with `python -m`; a context manager."""

    def __init__(self, model_dir: Path, logdir: Path, *, max_sparsity: float, max_splits: int,
                 max_rolling_batch_size: int, dtype: str = "auto", device: str = "auto",
                 start_timeout: float = 300.0):
        self.model_dir, self.logdir = Path(model_dir).resolve(), Path(logdir)
        self.scheduler_flags = ["--max-sparsity", str(max_sparsity), "--max-splits",
                                str(max_splits), "--max-rolling-batch-size",
                                str(max_rolling_batch_size)]
        self.dtype, self.device, self.start_timeout = dtype, device, start_timeout
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.worker_ports: dict = {}
        self.scheduler_ports: dict = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler_ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler_ports['metrics']}/metrics"

    def _spawn(self, name: str, module: str, args: list[str]) -> dict:
        port_file = self.logdir / f"{name}.ports.json"
        port_file.unlink(missing_ok=True)
        log = self.logdir / f"{name}.log"
        cmd = [sys.executable, "-m", module, *args, "--port-file", str(port_file)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.procs.append((name, proc))
        return _wait_port_file(port_file, proc, log, self.start_timeout)

    def start(self) -> Deployment:
        self.logdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            self.worker_ports = self._spawn("worker", "worker_service.main", [
                "--model-id", str(self.model_dir), "--host", "127.0.0.1", "--worker-port", "0",
                "--worker-metrics-port", "0", "--dtype", self.dtype, "--device", self.device])
            self.scheduler_ports = self._spawn("scheduler", "scheduler_service.main", [
                "--model-id", str(self.model_dir), "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--http-port", "-1",
                "--worker-addresses", f"127.0.0.1:{self.worker_ports['grpc']}",
                *self.scheduler_flags])
            self._wait_serving(time.monotonic() + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        logger.info("deployment up in %.1f s at %s (%s; logs in %s)", time.perf_counter() - t0,
                    self.address, " ".join(self.scheduler_flags), self.logdir)
        return self

    def _wait_serving(self, deadline: float) -> None:
        """Wait for the scheduler's health service to say SERVING (a worker is connected)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                for name, proc in self.procs:
                    if proc.poll() is not None:
                        log = self.logdir / f"{name}.log"
                        raise RuntimeError(f"{name} exited with {proc.returncode}; log {log}:\n"
                                           f"{log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"scheduler not SERVING after {self.start_timeout:.0f} s;"
                                       f" logs in {self.logdir}")
                time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the scheduler, then the worker; SIGKILL whatever outlives `timeout`."""
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0f s; killing it", name, timeout)
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# Scheduler metrics
# --------------------------------------------------------------------------------------------


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of a Prometheus text page: `name{label="v",...}` (labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class GaugePeak:
    """Polls one gauge of a /metrics page every `interval` seconds in a thread; keeps the max.

    Only polls that see running sequences (`seqserve_num_requests_running` > 0) count, so a
    run too short to be seen gives nan rather than 0."""

    def __init__(self, url: str, name: str, interval: float = 0.1):
        self.url, self.name, self.interval = url, name, interval
        self.peak = float("nan")
        self.polls = self.active_polls = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                page = scrape(self.url, timeout=2.0)
                self.polls += 1
                value = page.get(self.name)
                if page.get("seqserve_num_requests_running", 0) > 0 and value is not None:
                    self.active_polls += 1
                    if not value <= self.peak:  # nan-safe max
                        self.peak = value
            except Exception as exc:  # noqa: BLE001 - a missed poll is not fatal
                self.errors += 1
                logger.debug("metrics poll failed: %s", exc)
            self._stop.wait(self.interval)

    def __enter__(self) -> GaugePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.active_polls < 20:
            logger.warning("peak %s from only %d polls during the run: too short a run for "
                           "a reliable peak", self.name, self.active_polls)


def server_metrics(before: dict[str, float], after: dict[str, float], peak: GaugePeak) -> dict:
    """What the scheduler says about the measured run (counters as deltas)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(hist: str) -> float:
        n = delta(f"{hist}_count")
        return delta(f"{hist}_sum") / n if n else float("nan")

    return {
        "peak_kv_padded_slots": peak.peak,
        "metrics_polls": peak.polls,
        "metrics_polls_while_running": peak.active_polls,
        "metrics_poll_errors": peak.errors,
        "steps": delta("seqserve_batch_splits_count"),
        "mean_batch_sparsity": mean("seqserve_batch_sparsity"),
        "mean_batch_splits": mean("seqserve_batch_splits"),
        "mean_batch_size": mean("seqserve_batch_size"),
        "regroup_bytes": delta("seqserve_regroup_bytes_total"),
        "regroups": delta("seqserve_regroups_total"),
        "generation_tokens": delta("seqserve_generation_tokens_total"),
        "prefix_cache_hit_tokens": delta("seqserve_prefix_cache_hit_tokens_total"),
    }


# --------------------------------------------------------------------------------------------
# seqserve run
# --------------------------------------------------------------------------------------------


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
    finish_reason: str | None = None

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


async def _stream_one(client, req: BenchRequest) -> RequestResult:
    res = RequestResult(req.index, req.prompt_len, req.output_len, time.perf_counter())
    async for chunk in client.stream(req.prompt, max_new_tokens=req.output_len, ignore_eos=True):
        now = time.perf_counter()
        if chunk.token_id is not None:
            res.token_times.append(now)
        if chunk.finish_reason is not None:
            res.end = now
            res.finish_reason = chunk.finish_reason
            res.generated = chunk.generated_tokens
            res.prompt_tokens = chunk.prompt_tokens
    return res


async def send_all(address: str, requests: Sequence[BenchRequest]) -> list[RequestResult]:
    """Send every request at once on one channel; wait for all."""
    from client.api import AsyncClient

    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(_stream_one(client, r) for r in requests))
    for r in results:
        if (len(r.token_times) != r.output_len or r.generated != r.output_len
                or r.prompt_tokens != r.prompt_len):
            raise RuntimeError(
                f"request {r.index}: asked for {r.output_len} tokens after {r.prompt_len}, got "
                f"{len(r.token_times)} streamed, {r.generated} counted, prompt {r.prompt_tokens}"
                f" tokens (finish {r.finish_reason})")
    return list(results)


def summarize(results: Sequence[RequestResult]) -> dict:
    """vLLM benchmark_serving's summary of one run."""
    start = min(r.send for r in results)
    duration = max(r.end for r in results) - start
    out_tokens = sum(len(r.token_times) for r in results)
    in_tokens = sum(r.prompt_len for r in results)
    return {
        "completed": len(results),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(results) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": latency_stats([r.ttft for r in results]),
        "tpot": latency_stats([t for r in results if (t := r.tpot) is not None]),
        "itl": latency_stats([x for r in results for x in r.itls]),
        "e2e": latency_stats([r.e2e for r in results]),
        "per_request": [{"index": r.index, "prompt_len": r.prompt_len,
                         "output_len": r.output_len, "ttft_s": r.ttft, "e2e_s": r.e2e,
                         "tpot_s": r.tpot} for r in results],
    }


def _warmup(address: str, tokenizer, safe: Sequence[int]) -> None:
    text, _ = make_prompt(tokenizer, 16, random.Random(12345), safe)
    asyncio.run(send_all(address, [BenchRequest(-1, text, tokenizer(text).input_ids, 8)]))


def bench_seqserve(model_dir: Path, requests: Sequence[BenchRequest], tokenizer, *,
                   max_sparsity: float, max_splits: int, max_rolling_batch_size: int,
                   logdir: Path, dtype: str, device: str, poll_interval: float = 0.1) -> dict:
    """Start a deployment, warm it up with one short request, run `requests`, stop it."""
    config = {"max_sparsity": max_sparsity, "max_splits": max_splits,
              "max_rolling_batch_size": max_rolling_batch_size}
    with Deployment(model_dir, logdir, dtype=dtype, device=device, **config) as d:
        _warmup(d.address, tokenizer, round_trip_tokens(tokenizer))
        before = scrape(d.metrics_url)
        with GaugePeak(d.metrics_url, "seqserve_kv_padded_slots", poll_interval) as peak:
            results = asyncio.run(send_all(d.address, requests))
        after = scrape(d.metrics_url)
    summary = summarize(results)
    summary["config"] = config
    summary["server"] = server_metrics(before, after, peak)
    logger.info("seqserve %s: %.1f output tokens/s in %.2f s (peak padded KV slots %g, mean "
                "splits %.2f, mean sparsity %.3f)", config, summary["output_throughput"],
                summary["duration_s"], summary["server"]["peak_kv_padded_slots"],
                summary["server"]["mean_batch_splits"], summary["server"]["mean_batch_sparsity"])
    return summary


# --------------------------------------------------------------------------------------------
# Hugging Face baseline
# --------------------------------------------------------------------------------------------


def model_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint was saved in (config.json), e.g. "bfloat16"."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def bench_hf(model_dir: Path, requests: Sequence[BenchRequest], *, batch_size: int = 16,
             threads: int | None = None, device: str = "auto") -> dict:
    """`model.generate` on static batches in arrival order, left-padded, exact output lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = model_dtype(model_dir)
    device = resolve_device(device)
    threads = threads or machine_cores()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        model = model.to(device).eval()
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

        def generate(batch: Sequence[BenchRequest]) -> int:
            enc = tok.pad({"input_ids": [r.prompt_ids for r in batch]}, padding=True,
                          return_tensors="pt").to(device)
            n = max(r.output_len for r in batch)
            with torch.inference_mode():
                out = model.generate(input_ids=enc["input_ids"],
                                     attention_mask=enc["attention_mask"], do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
            if device == "cuda":
                torch.cuda.synchronize()
            got = out.shape[1] - enc["input_ids"].shape[1]
            assert got == n, f"HF generated {got} tokens, expected {n}"
            return n * len(batch)

        generate([BenchRequest(-1, "", requests[0].prompt_ids[:16], 4)])  # warm-up
        batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
        t0 = time.perf_counter()
        generated, ends = 0, []
        for batch in batches:
            generated += generate(batch)
            ends.append(time.perf_counter())
            logger.info("HF batch %d/%d done at %.1f s", len(ends), len(batches), ends[-1] - t0)
        duration = time.perf_counter() - t0
    finally:
        torch.set_num_threads(default_threads)
    useful = sum(r.output_len for r in requests)
    e2e = [ends[i // batch_size] - t0 for i in range(len(requests))]
    summary = {
        "config": {"batch_size": batch_size, "padding": "left", "dtype": dtype,
                   "device": device, "torch_threads": threads,
                   "torch_default_threads": default_threads},
        "completed": len(requests),
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": useful,
        "generated_tokens_incl_padding": generated,
        "request_throughput": len(requests) / duration,
        "output_throughput": useful / duration,
        "e2e": latency_stats(e2e),
    }
    logger.info("HF generate: %.1f useful output tokens/s in %.2f s (%d generated incl. "
                "padding rows)", summary["output_throughput"], duration, generated)
    return summary


# --------------------------------------------------------------------------------------------
# Reporting helpers
# --------------------------------------------------------------------------------------------


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cores": machine_cores(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    with contextlib.suppress(Exception):
        env["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
    return env


def workload_line(meta: dict) -> str:
    return (f"Workload: {meta['trace_name']}, first {meta['num_requests']} requests, all sent "
            f"at once; {meta['scale_text']}. Prompt tokens {meta['prompt']['sum']} (mean "
            f"{meta['prompt']['mean']:.0f}, max {meta['prompt']['max']}), output tokens "
            f"{meta['output']['sum']} (mean {meta['output']['mean']:.0f}, max "
            f"{meta['output']['max']}). Model {meta['model']} ({meta['dtype']}), "
            f"{meta['env']['cores']} cores, seed {meta['seed']}.")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _write(out_dir: Path, name: str, result: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(_to_json(result))
    (out_dir / f"{name}.md").write_text(markdown + "\n")
    logger.info("wrote %s and %s", out_dir / f"{name}.json", out_dir / f"{name}.md")


def _to_json(result: dict) -> str:
    """Strict JSON: nan (no value) becomes null."""
    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(result), indent=2, allow_nan=False) + "\n"


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# --------------------------------------------------------------------------------------------
# Subcommands
# --------------------------------------------------------------------------------------------


def prepare(args) -> tuple[Path, list[BenchRequest], Any, dict]:
    """Model (made if it is the missing default), requests, tokenizer and the workload record."""
    from transformers import AutoTokenizer

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        if model_dir != DEFAULT_MODEL:
            raise SystemExit(f"no model at {model_dir} (config.json missing)")
        from worker_service.fixtures import make_model

        logger.info("writing the benchmark model to %s (mid llama, bfloat16)", model_dir)
        make_model(model_dir, arch="llama", size="mid", dtype="bfloat16")
    scale = Scale(args.prompt_scale, args.max_prompt, args.output_scale, args.max_output)
    items = load_trace(args.trace, args.num_requests, scale)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_pos = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    longest = max(it.prompt_len + it.output_len for it in items)
    if max_pos and longest > max_pos:
        raise SystemExit(f"a request needs {longest} positions; the model has {max_pos}: "
                         f"lower --max-prompt / --max-output")
    t0 = time.perf_counter()
    requests = build_requests(tokenizer, items, args.seed)
    logger.info("built %d prompts of exact token length in %.1f s", len(requests),
                time.perf_counter() - t0)
    meta = {
        "trace": str(Path(args.trace)), "trace_name": TRACE_NAME,
        "num_requests": args.num_requests, "seed": args.seed, "arrival": "all at once",
        "scale": asdict(scale), "scale_text": scale.describe(),
        "prompt": length_stats([r.prompt_len for r in requests]),
        "output": length_stats([r.output_len for r in requests]),
        "model": str(model_dir), "dtype": model_dtype(model_dir), "device": args.device,
        "env": environment(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return model_dir, requests, tokenizer, meta


def cmd_throughput(args, prepared=None) -> dict:
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    logdir = Path(args.out) / "logs" / "throughput"
    seq = bench_seqserve(model_dir, requests, tokenizer, max_sparsity=args.max_sparsity,
                         max_splits=args.max_splits,
                         max_rolling_batch_size=args.max_rolling_batch_size, logdir=logdir,
                         dtype=meta["dtype"], device=args.device)
    hf = None if args.no_hf else bench_hf(model_dir, requests, batch_size=args.hf_batch_size,
                                           threads=args.hf_threads, device=args.device)
    ratio = seq["output_throughput"] / hf["output_throughput"] if hf else None
    result = {"benchmark": "throughput", "workload": meta, "seqserve": seq, "hf": hf,
              "ratio_seqserve_over_hf": ratio}
    c = seq["config"]
    rows = [["seqserve", f"max_sparsity {c['max_sparsity']:g}, max_splits {c['max_splits']}, "
             f"max_rolling_batch_size {c['max_rolling_batch_size']}",
             _f(seq["duration_s"], 2), seq["output_tokens"], _f(seq["output_throughput"]),
             _f(seq["request_throughput"], 2)]]
    if hf:
        rows.append(["HF generate", f"static batches of {hf['config']['batch_size']}, left "
                     f"padding, {hf['config']['torch_threads']} torch threads",
                     _f(hf["duration_s"], 2), hf["output_tokens"], _f(hf["output_throughput"]),
                     _f(hf["request_throughput"], 2)])
    lat = [[name, _f(seq[k]["mean_ms"]), _f(seq[k]["median_ms"]), _f(seq[k]["p99_ms"])]
           for name, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))]
    md = "\n\n".join([
        "## Offline throughput: seqserve vs Hugging Face generate",
        workload_line(meta),
        _md_table(["system", "configuration", "duration s", "output tokens", "output tokens/s",
                   "requests/s"], rows),
        (f"**seqserve / HF output tokens/s: {ratio:.2f}x** ({meta['scale_text']})"
         if ratio else "HF baseline skipped (--no-hf)."),
        "seqserve latency (ms, vLLM definitions):",
        _md_table(["metric", "mean", "median", "p99"], lat),
    ])
    _write(Path(args.out), "throughput", result, md)
    print(md, flush=True)
    return result


def cmd_sweep(args, prepared=None) -> dict:
    model_dir, requests, tokenizer, meta = prepared or prepare(args)
    sparsities, splits = args.sparsities, args.splits
    out_dir = Path(args.out)
    result: dict = {"benchmark": "sweep", "workload": meta,
                    "max_rolling_batch_size": args.max_rolling_batch_size, "runs": []}
    for s in sparsities:
        for k in splits:
            logger.info("sweep: max_sparsity %g, max_splits %d (%d of %d)", s, k,
                        len(result["runs"]) + 1, len(sparsities) * len(splits))
            summary = bench_seqserve(
                model_dir, requests, tokenizer, max_sparsity=s, max_splits=k,
                max_rolling_batch_size=args.max_rolling_batch_size, dtype=meta["dtype"],
                logdir=out_dir / "logs" / f"sweep-s{s:g}-k{k}", device=args.device)
            summary.pop("per_request")
            result["runs"].append(summary)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "sweep.partial.json").write_text(_to_json(result))

    def run(s: float, k: int) -> dict | None:
        return next((r for r in result["runs"] if r["config"]["max_sparsity"] == s
                     and r["config"]["max_splits"] == k), None)

    ref, base = run(*REFERENCE_POINT), run(REFERENCE_POINT[0], 1)
    if ref and base:
        result["reference"] = {
            "point": {"max_sparsity": REFERENCE_POINT[0], "max_splits": REFERENCE_POINT[1]},
            "peak_padded_slots_ratio_to_splits_1": _ratio(
                ref["server"]["peak_kv_padded_slots"], base["server"]["peak_kv_padded_slots"]),
            "throughput_ratio_to_splits_1":
                _ratio(ref["output_throughput"], base["output_throughput"]),
        }
    rows = [[_f(r["config"]["max_sparsity"], 2), r["config"]["max_splits"],
             _f(r["output_throughput"]), _f(r["duration_s"], 2),
             _f(r["server"]["peak_kv_padded_slots"], 0), _f(r["server"]["mean_batch_sparsity"], 3),
             _f(r["server"]["mean_batch_splits"], 2), _f(r["server"]["regroup_bytes"] / 2**20, 1),
             _f(r["tpot"]["median_ms"])] for r in result["runs"]]
    parts = ["## max_sparsity x max_splits sweep", workload_line(meta),
             _md_table(["max_sparsity", "max_splits", "output tokens/s", "duration s",
                        "peak padded KV slots", "mean sparsity", "mean splits",
                        "regroup MiB", "median TPOT ms"], rows)]
    if "reference" in result:
        r = result["reference"]
        parts.append(f"**At max_sparsity {REFERENCE_POINT[0]:g}, max_splits "
                     f"{REFERENCE_POINT[1]} vs max_splits 1:** peak padded KV slots x"
                     f"{_f(r['peak_padded_slots_ratio_to_splits_1'], 3)}, output tokens/s x"
                     f"{_f(r['throughput_ratio_to_splits_1'], 3)} ({meta['scale_text']}).")
    if args.plot:
        plot_sweep(result, Path(args.plot))
        result["plot"] = str(args.plot)
        parts.append(f"![sweep]({os.path.relpath(Path(args.plot).resolve(), out_dir.resolve())})")
    md = "\n\n".join(parts)
    _write(out_dir, "sweep", result, md)
    (out_dir / "sweep.partial.json").unlink(missing_ok=True)
    print(md, flush=True)
    return result


def plot_sweep(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


def cmd_partition(args) -> dict:
    from scheduler_service.partition import plan_partition

    rng = random.Random(args.seed)
    lengths = [rng.randint(1, 2048) for _ in range(512)]
    rows, result = [], {"benchmark": "partition", "n": 512, "length_range": [1, 2048],
                        "max_splits": 8, "seed": args.seed, "repeats": args.repeats, "runs": []}
    for s in (0.33, 0.0):
        part = plan_partition(lengths, max_sparsity=s, max_splits=8)
        timer = timeit.Timer(lambda s=s: plan_partition(lengths, max_sparsity=s, max_splits=8))
        number, total = timer.autorange()
        number = max(1, round(number * 0.02 / total))  # about 20 ms a repeat
        times = [t / number for t in timer.repeat(repeat=args.repeats, number=number)]
        run = {"max_sparsity": s, "median_ms": 1000 * percentile(times, 50),
               "min_ms": 1000 * min(times), "calls_per_repeat": number,
               "splits": part.num_splits, "sparsity": part.sparsity}
        result["runs"].append(run)
        rows.append([f"{s:g}", run["splits"], f"{run['sparsity']:.4f}", f"{run['median_ms']:.3f}",
                     f"{run['min_ms']:.3f}"])
    md = "\n\n".join([
        "## plan_partition time",
        f"512 random lengths in [1, 2048] (seed {args.seed}), max_splits 8; median of "
        f"{args.repeats} repeats (timeit).",
        _md_table(["max_sparsity", "groups", "sparsity", "median ms", "min ms"], rows)])
    result["env"] = {"python": platform.python_version(), "cores": machine_cores()}
    _write(Path(args.out), "partition", result, md)
    print(md, flush=True)
    return result


def cmd_all(args) -> dict:
    prepared = prepare(args)
    return {"throughput": cmd_throughput(args, prepared), "sweep": cmd_sweep(args, prepared),
            "partition": cmd_partition(args)}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("workload and output")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help=f"model directory (default {DEFAULT_MODEL}; made if missing)")
    g.add_argument("--trace", type=Path, default=TRACE, help="Azure trace CSV")
    g.add_argument("--num-requests", type=int, default=64, help="first N trace rows (64)")
    g.add_argument("--prompt-scale", type=float, default=0.25)
    g.add_argument("--max-prompt", type=int, default=512)
    g.add_argument("--output-scale", type=float, default=0.5)
    g.add_argument("--max-output", type=int, default=128)
    g.add_argument("--seed", type=int, default=0, help="prompt token and length seed")
    g.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="directory for JSON, markdown and server logs (bench-results/)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="worker and HF device (auto: cuda when torch sees it)")
    g.add_argument("--max-rolling-batch-size", type=int, default=64)
    g.add_argument("--log-level", default="INFO")

    thr = argparse.ArgumentParser(add_help=False)
    g = thr.add_argument_group("throughput")
    g.add_argument("--max-sparsity", type=float, default=0.33)
    g.add_argument("--max-splits", type=int, default=3)
    g.add_argument("--hf-batch-size", type=int, default=16)
    g.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads for the HF run (default: the machine's cores)")
    g.add_argument("--no-hf", action="store_true", help="skip the HF baseline")

    swp = argparse.ArgumentParser(add_help=False)
    g = swp.add_argument_group("sweep")
    g.add_argument("--sparsities", type=_floats, default=list(SWEEP_SPARSITIES),
                   help="comma-separated max_sparsity values (0,0.1,0.33,0.6,0.9)")
    g.add_argument("--splits", type=_ints, default=list(SWEEP_SPLITS),
                   help="comma-separated max_splits values (1,2,3,4,8)")
    g.add_argument("--plot", default="docs/sweep.png", help="PNG path ('' for none)")

    prt = argparse.ArgumentParser(add_help=False)
    g = prt.add_argument_group("partition")
    g.add_argument("--repeats", type=int, default=201, help="timeit repeats (201)")

    parser = argparse.ArgumentParser(prog="python -m client.bench",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("throughput", parents=[common, thr], help="seqserve vs HF generate tokens/s")
    sub.add_parser("sweep", parents=[common, swp], help="max_sparsity x max_splits grid")
    sub.add_parser("partition", parents=[common, prt], help="plan_partition timing")
    sub.add_parser("all", parents=[common, thr, swp, prt], help="throughput, sweep, partition")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in COMMANDS for a in argv) and not {"-h", "--help"} & set(argv):
        argv.insert(0, "throughput")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"throughput": cmd_throughput, "sweep": cmd_sweep, "partition": cmd_partition,
                "all": cmd_all}
    commands[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
