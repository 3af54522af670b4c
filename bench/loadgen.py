"""The load generator: streams requests to a seqserve scheduler over gRPC at given arrival
times (all at once, Poisson, or a trace's timestamps), optionally at most N in flight, and
records when every token arrives."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path
from typing import Callable, Sequence

from bench.bandwidth_probe import probed
from bench.deployment import Deployment, flags
from bench.metrics import GaugePeak, scrape, server_metrics, worker_metrics
from bench.profiling import Profiler
from bench.stats import RequestResult, Slo, summarize
from bench.workload import BenchRequest, make_prompt, round_trip_tokens

logger = logging.getLogger("seqserve.bench")


def _params(req: BenchRequest) -> dict:
    params = dict(max_new_tokens=req.output_len, ignore_eos=True)
    if req.cached_prompt:
        params["cached_prompt"] = req.cached_prompt
    if req.priority:
        params["priority"] = req.priority
    return params


async def _stream_one(client, req: BenchRequest) -> RequestResult:
    params = _params(req)
    res = RequestResult(req.index, req.prompt_len, req.output_len, time.perf_counter())
    async for chunk in client.stream(req.wire_prompt, **params):
        now = time.perf_counter()
        if chunk.token_id is not None:
            res.token_times.append(now)
        if chunk.finish_reason is not None:
            res.end = now
            res.finish_reason = chunk.finish_reason
            res.generated = chunk.generated_tokens
            res.prompt_tokens = chunk.prompt_tokens
            res.cached_tokens = chunk.cached_tokens
    return res


async def _unary_one(client, req: BenchRequest) -> RequestResult:
    """One GenerateUnary call, as client/offline.py makes them: every token at the end."""
    from client.api import FINISH_REASONS, build_request

    res = RequestResult(req.index, req.prompt_len, req.output_len, time.perf_counter(),
                        streamed=False)
    reply = await client.stub.GenerateUnary(build_request(req.wire_prompt, **_params(req)),
                                            timeout=client.timeout, metadata=client.metadata)
    res.end = time.perf_counter()
    if len(reply.tokens) != reply.usage.generated_tokens:
        raise RuntimeError(f"request {req.index}: the reply holds {len(reply.tokens)} tokens "
                           f"but counts {reply.usage.generated_tokens}")
    res.finish_reason = FINISH_REASONS[reply.finish_reason]
    res.generated = reply.usage.generated_tokens
    res.prompt_tokens = reply.usage.prompt_tokens
    res.cached_tokens = reply.usage.cached_tokens
    return res


def check_results(results: Sequence[RequestResult]) -> None:
    for r in results:
        if (r.tokens_received != r.output_len or r.generated != r.output_len
                or r.prompt_tokens != r.prompt_len):
            how = "streamed" if r.streamed else "returned"
            raise RuntimeError(
                f"request {r.index}: asked for {r.output_len} tokens after {r.prompt_len}, got "
                f"{r.tokens_received} {how}, {r.generated} counted, prompt {r.prompt_tokens}"
                f" tokens (finish {r.finish_reason})")


async def send_requests(address: str, requests: Sequence[BenchRequest],
                        offsets: Sequence[float] | None = None,
                        max_concurrency: int | None = None, stream: bool = True
                        ) -> list[RequestResult]:
    """Send request i at `offsets[i]` seconds after the start (all at once when None), at most
    `max_concurrency` in flight (a request waiting for a slot is not yet sent: its TTFT starts
    when it is, as in vLLM's benchmark), on one channel; wait for all. `stream=False` sends
    GenerateUnary calls: no per-token times, and no per-token messages for the client to
    read on the server's cores."""
    from client.api import AsyncClient
    from seqserve_common.startup_gc import freeze_startup_objects

    # The driver shares the machine with the server: a full collection walking every
    # object its imports made (torch, the tokenizer, the trace) took 3-4% of the CPU in a
    # run, time taken from the server being measured.
    freeze_startup_objects()
    offsets = list(offsets) if offsets is not None else [0.0] * len(requests)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with AsyncClient(address) as client:
        # Connected before the clock starts: the first request's TTFT does not hold the
        # channel's connection set-up, which the others do not pay.
        await client.channel.channel_ready()
        t0 = time.perf_counter()

        send = _stream_one if stream else _unary_one

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await send(client, req)
            async with sem:
                return await send(client, req)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    check_results(results)
    return list(results)


async def send_all(address: str, requests: Sequence[BenchRequest]) -> list[RequestResult]:
    """Send every request at once on one channel; wait for all."""
    return await send_requests(address, requests)


async def send_sequential(address: str, requests: Sequence[BenchRequest]) -> list[RequestResult]:
    """One request at a time, each after the previous one finished."""
    from client.api import AsyncClient

    async with AsyncClient(address) as client:
        await client.channel.channel_ready()
        results = [await _stream_one(client, r) for r in requests]
    check_results(results)
    return results


def warmup(address: str, tokenizer, safe: Sequence[int] | None = None) -> None:
    """One short request (16 prompt tokens, 8 out) of its own text."""
    safe = safe or round_trip_tokens(tokenizer)
    text, ids = make_prompt(tokenizer, 16, random.Random(12345), safe)
    asyncio.run(send_all(address, [BenchRequest(-1, text, ids, 8)]))


class SeqserveTarget:
    """A started deployment (or a running server at `address`) that runs measured load.

    Each `run` scrapes the scheduler's and worker's /metrics before and after and polls the
    padded-slots gauge during the run."""

    def __init__(self, model_dir: Path | None, tokenizer, *, logdir: Path, dtype: str = "auto",
                 device: str = "auto", max_sparsity: float = 0.33, max_splits: int = 3,
                 max_rolling_batch_size: int = 64, worker_options: dict | None = None,
                 address: str | None = None, metrics_url: str | None = None,
                 poll_interval: float = 1.0, warm: bool = True,
                 server_options: dict | None = None):
        worker_options, server_options = worker_options or {}, server_options or {}
        scheduler = {"max_sparsity": max_sparsity, "max_splits": max_splits,
                     "max_rolling_batch_size": max_rolling_batch_size}
        self.config = dict(scheduler)
        if worker_options:
            self.config["worker_flags"] = flags(worker_options)
        if server_options:
            self.config["server_flags"] = flags(server_options)
        self.tokenizer, self.poll_interval, self.warm = tokenizer, poll_interval, warm
        # server_options go to both processes, after each one's own (a later flag wins);
        # the worker's own options come last. No HTTP port: the load is sent over gRPC.
        self.deployment = None if address else Deployment(
            model_dir, logdir,
            options={"http_port": -1, **scheduler, **server_options},
            worker_options={"dtype": dtype, "device": device, **server_options,
                            **worker_options},
            start_timeout=300.0, stop_timeout=30.0)
        self._address, self._metrics_url = address, metrics_url
        if address:  # a server someone else started: its configuration is not ours to say
            self.config = {"external_address": address}
        self.worker_metrics_url: str | None = None

    @property
    def address(self) -> str:
        return self._address or self.deployment.address

    @property
    def metrics_url(self) -> str | None:
        return self._metrics_url or (self.deployment.metrics_url if self.deployment else None)

    def __enter__(self) -> SeqserveTarget:
        if self.deployment:
            self.deployment.start()
            self.worker_metrics_url = self.deployment.worker_metrics_url
        try:
            if self.warm:
                warmup(self.address, self.tokenizer)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.deployment:
            self.deployment.stop()

    def _scrape(self, url: str | None) -> dict[str, float]:
        return scrape(url) if url else {}

    def run(self, requests: Sequence[BenchRequest], offsets: Sequence[float] | None = None,
            max_concurrency: int | None = None, slo: Slo | None = None,
            sequential: bool = False, profile_dir: Path | None = None,
            stream: bool = True) -> dict:
        profiler = (Profiler(self.deployment, profile_dir)
                    if profile_dir is not None and self.deployment else None)
        if profiler:
            profiler.__enter__()
        before = self._scrape(self.metrics_url)
        wbefore = self._scrape(self.worker_metrics_url)
        peak = (GaugePeak(self.metrics_url, "seqserve_kv_padded_slots", self.poll_interval)
                if self.metrics_url and not sequential else None)
        if peak:
            peak.__enter__()
        try:
            if sequential:
                results = asyncio.run(send_sequential(self.address, requests))
            else:
                results = asyncio.run(send_requests(self.address, requests, offsets,
                                                    max_concurrency, stream))
        finally:
            if peak:
                peak.__exit__()
            if profiler:
                profiler.__exit__()
        after = self._scrape(self.metrics_url)
        wafter = self._scrape(self.worker_metrics_url)
        summary = summarize(results, slo)
        summary["config"] = dict(self.config)
        if self.metrics_url:
            summary["server"] = server_metrics(before, after, peak)
        if self.worker_metrics_url:
            summary["worker"] = worker_metrics(wbefore, wafter)
        if profiler:
            summary["profile"] = profiler.summary()
        return summary


def fresh_prompts(tokenizer, requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The same lengths with each prompt's tokens reversed: a second run that the first one's
    prefix cache cannot serve (safe tokens re-tokenize to themselves in any order)."""
    out = []
    for r in requests:
        ids = r.prompt_ids[::-1]
        text = tokenizer.decode(ids)
        if tokenizer(text).input_ids != ids:
            return list(requests)
        out.append(BenchRequest(r.index, text, ids, r.output_len))
    return out


def bench_seqserve(model_dir: Path, requests: Sequence[BenchRequest], tokenizer, *,
                   max_sparsity: float, max_splits: int, max_rolling_batch_size: int,
                   logdir: Path, dtype: str, device: str, poll_interval: float = 0.1,
                   worker_options: dict | None = None, slo: Slo | None = None,
                   profile_dir: Path | None = None, server_options: dict | None = None,
                   bandwidth_probe: Callable[[], float] | None = None,
                   stream: bool = True) -> dict:
    """Start a deployment, warm it up with one short request, run `requests` at once (as
    GenerateUnary calls with `stream=False`), stop it.

    With `profile_dir`, a second run of the same shape (fresh prompts) follows with py-spy
    sampling both processes; only its profile is kept (sampling costs CPU, so the measured
    figures come from the first run). With `bandwidth_probe` (bytes/s), the memory's
    bandwidth is probed just before and just after the measured run, the deployment idle
    (`bandwidth_probes` in the summary: the floor of that run is charged at them)."""
    with SeqserveTarget(model_dir, tokenizer, logdir=logdir, dtype=dtype, device=device,
                        max_sparsity=max_sparsity, max_splits=max_splits,
                        max_rolling_batch_size=max_rolling_batch_size,
                        worker_options=worker_options, poll_interval=poll_interval,
                        server_options=server_options) as target:
        summary = probed(lambda: target.run(requests, slo=slo, stream=stream), bandwidth_probe)
        if profile_dir is not None:
            profiled = target.run(fresh_prompts(tokenizer, requests), profile_dir=profile_dir)
            summary["profile"] = profiled["profile"]
            summary["profile"]["run"] = {"duration_s": profiled["duration_s"],
                                         "output_throughput": profiled["output_throughput"]}
    s = summary["server"]
    logger.info("seqserve %s%s: %.1f output tokens/s in %.2f s (peak padded KV slots %g, mean "
                "splits %.2f, mean sparsity %.3f)", summary["config"],
                "" if stream else " (not streamed)", summary["output_throughput"],
                summary["duration_s"], s["peak_kv_padded_slots"], s["mean_batch_splits"],
                s["mean_batch_sparsity"])
    return summary
