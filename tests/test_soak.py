"""A soak test. 256 concurrent streaming clients for 5 minutes against
one deployment with a bounded queue; every answer is checked against model.generate, the
only failures allowed are explicit RESOURCE_EXHAUSTED, and the RSS of the scheduler and
the worker must stop growing after a warm-up.

    make soak                                   # 300 s, 256 clients
    SOAK_SECONDS=60 .venv/bin/python -m pytest -q -m soak -o addopts="" -s tests/test_soak.py

Environment: SOAK_SECONDS (default 300), SOAK_CLIENTS (256), SOAK_REPORT (also write the
JSON summary to this path). The summary is printed and written to soak.json in the test's
tmp directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import grpc
import pytest
import torch

from bench.metrics import scrape
from bench.processes import health_status
from client import AsyncClient
from tests import reference

SECONDS = float(os.environ.get("SOAK_SECONDS", "300"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "256"))
CLIENTS_PER_CHANNEL = 16
PROMPTS = 32
MIN_NEW, MAX_NEW = 4, 24
SAMPLE_EVERY = 3.0  # seconds between RSS samples
WARMUP = min(60.0, 0.2 * SECONDS)  # memory growth is measured after this
MAX_GROWTH = 0.10
CALL_TIMEOUT = 120.0


def _prompts(model_dir) -> list[str]:
    tok = reference.load(str(model_dir))[0]
    rng = random.Random(8)
    return [reference.prompt_of_tokens(tok, rng.randint(2, 48), rng) for _ in range(PROMPTS)]


def _window_mean(samples: list[tuple[float, int]], lo: float, hi: float) -> float:
    values = [v for t, v in samples if lo <= t <= hi]
    return statistics.fmean(values) if values else float("nan")


@pytest.mark.soak
@pytest.mark.timeout(int(SECONDS) + 600)
def test_soak(llama_dir, deploy, tmp_path):
    psutil = pytest.importorskip("psutil")  # in the bench extra, not dev
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # references only; two threads contend on a 2-core machine
    try:
        prompts = _prompts(llama_dir)
        expected = [reference.greedy(llama_dir, p, MAX_NEW) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    d = deploy(llama_dir, max_queue=512, max_rolling_batch_size=64)
    procs = {"scheduler": psutil.Process(d.scheduler.proc.pid),
             "worker": psutil.Process(d.worker.proc.pid)}
    rss: dict[str, list[tuple[float, int]]] = {name: [] for name in procs}
    stats = {"completed": 0, "tokens": 0, "resource_exhausted": 0}
    failures: list[str] = []
    latencies: list[float] = []

    async def client(c: AsyncClient, rng: random.Random, stop_at: float):
        while time.monotonic() < stop_at:
            i, n = rng.randrange(PROMPTS), rng.randint(MIN_NEW, MAX_NEW)
            ids, finish, t0 = [], None, time.monotonic()
            try:
                async for chunk in c.stream(prompts[i], max_new_tokens=n):
                    if chunk.token_id is not None:
                        ids.append(chunk.token_id)
                    finish = chunk.finish_reason or finish
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    stats["resource_exhausted"] += 1
                    await asyncio.sleep(rng.uniform(0.05, 0.2))
                else:
                    failures.append(f"prompt {i}, n {n}: {err.code().name}: {err.details()}")
                continue
            latencies.append(time.monotonic() - t0)
            stats["tokens"] += len(ids)
            want = expected[i][:n]
            if ids != want or finish not in ("length", "eos"):
                failures.append(f"prompt {i}, n {n}: got {ids} ({finish}), want {want}")
            else:
                stats["completed"] += 1

    async def sampler(t_start: float, stop: asyncio.Event):
        while not stop.is_set():
            now = time.monotonic() - t_start
            for name, p in procs.items():
                rss[name].append((now, p.memory_info().rss))
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)
            except asyncio.TimeoutError:
                pass

    async def run():
        channels = [AsyncClient(d.address, timeout=CALL_TIMEOUT)
                    for _ in range((CLIENTS + CLIENTS_PER_CHANNEL - 1) // CLIENTS_PER_CHANNEL)]
        t_start = time.monotonic()
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(t_start, stop))
        await asyncio.gather(*(client(channels[k // CLIENTS_PER_CHANNEL], random.Random(k),
                                      t_start + SECONDS) for k in range(CLIENTS)))
        elapsed = time.monotonic() - t_start
        stop.set()
        await sampling
        for c in channels:
            await c.close()
        return elapsed

    elapsed = asyncio.run(run())

    # After the load: nothing left running, waiting or holding KV on the worker.
    assert health_status(d.address) == "SERVING"
    assert d.scheduler.proc.poll() is None and d.worker.proc.poll() is None
    worker_url = f"http://127.0.0.1:{d.worker.ports['metrics']}/metrics"
    deadline = time.monotonic() + 10  # the last releases ride on the loop's next step
    while scrape(worker_url)["seqserve_worker_sequences"] and time.monotonic() < deadline:
        time.sleep(0.1)
    m, worker_m = scrape(d.metrics_url), scrape(worker_url)

    growth = {}
    for name, samples in rss.items():
        # Mean of the first samples after the warm-up against the mean of the last ones.
        base = _window_mean(samples, WARMUP, WARMUP + 3 * SAMPLE_EVERY)
        end = _window_mean(samples, elapsed - 3 * SAMPLE_EVERY, elapsed)
        growth[name] = {"rss_start_mb": round(samples[0][1] / 2**20, 1),
                        "rss_after_warmup_mb": round(base / 2**20, 1),
                        "rss_end_mb": round(end / 2**20, 1),
                        "rss_peak_mb": round(max(v for _, v in samples) / 2**20, 1),
                        "growth_after_warmup": round(end / base - 1, 4)}
    lat = sorted(latencies)
    summary = {
        "seconds": round(elapsed, 1), "clients": CLIENTS, "warmup_s": WARMUP,
        "requests_completed": stats["completed"], "tokens": stats["tokens"],
        "tokens_per_s": round(stats["tokens"] / elapsed, 1),
        "resource_exhausted": stats["resource_exhausted"], "failures": len(failures),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        "rss_samples": len(rss["worker"]), "processes": growth,
        "scheduler_running_after": m["seqserve_num_requests_running"],
        "scheduler_waiting_after": m["seqserve_num_requests_waiting"],
        "worker_sequences_after": worker_m["seqserve_worker_sequences"],
    }
    text = json.dumps(summary, indent=1)
    print("\nsoak summary:", text)
    (tmp_path / "soak.json").write_text(text)
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            f.write(text)

    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert stats["completed"] > CLIENTS, summary
    assert m["seqserve_num_requests_running"] == 0 and m["seqserve_num_requests_waiting"] == 0
    assert worker_m["seqserve_worker_sequences"] == 0
    for name, g in growth.items():
        assert g["growth_after_warmup"] < MAX_GROWTH, (name, summary)
