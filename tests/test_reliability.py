"""Reliability over real processes: backpressure, cancellation, deadlines, worker crash with no
lost token, no worker at all, and graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest

from bench.metrics import scrape
from bench.processes import health_status
from client import AsyncClient, Client
from client.api import build_request, response_tokens
from tests import reference
from tests.conftest import LONG_CONTEXT, long_context_model


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_full_queue_is_refused_at_once(llama_dir, deploy):
    d = deploy(llama_dir, max_queue=2, max_rolling_batch_size=1)
    with Client(d.address, timeout=120) as c:
        running = c.stub.Generate(build_request(
            "the king " * 20, max_new_tokens=400, ignore_eos=True))
        next(running)  # the first request is running and holds the only batch slot
        queued = [threading.Thread(target=lambda: c.generate("hi", max_new_tokens=2))
                  for _ in range(2)]
        for t in queued:
            t.start()
        wait_until(lambda: scrape(d.metrics_url)["seqserve_num_requests_waiting"] == 2, 30,
                   "two waiting requests")
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.generate("one too many", max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        assert time.monotonic() - t0 < 2.0
        running.cancel()
        for t in queued:
            t.join(60)


def _worker_sequences(d) -> float:
    return scrape(f"http://127.0.0.1:{d.worker.ports['metrics']}/metrics")["seqserve_worker_sequences"]


def test_cancel_and_deadline_release_the_sequence(deploy):
    # Longer than any machine decodes in the 1 s deadline below.
    n = LONG_CONTEXT - 16
    d = deploy(long_context_model(), max_new_tokens_limit=n)
    with Client(d.address) as c:
        call = c.stub.Generate(build_request(
            "once upon a time", max_new_tokens=n, ignore_eos=True))
        for _ in range(5):
            next(call)
        assert _worker_sequences(d) == 1
        call.cancel()
        wait_until(lambda: _worker_sequences(d) == 0, 5, "the worker to drop the cancelled sequence")
        m = scrape(d.metrics_url)
        assert m["seqserve_num_requests_running"] == 0
        assert m["seqserve_requests_finished_total{reason=cancelled}"] == 1
        # A deadline that passes mid-generation releases the sequence the same way.
        with pytest.raises(grpc.RpcError) as err:
            Client(d.address, timeout=1.0).generate("once upon a time", max_new_tokens=n,
                                                     ignore_eos=True)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: _worker_sequences(d) == 0, 5, "the worker to drop the expired sequence")
        # ... and for a unary call, whose handler waits for the end alone (all_events).
        with Client(d.address) as c, pytest.raises(grpc.RpcError) as err:
            c.stub.GenerateUnary(build_request("once upon a time", max_new_tokens=n,
                                               ignore_eos=True), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: _worker_sequences(d) == 0, 5, "the worker to drop the unary sequence")
        m = scrape(d.metrics_url)
        assert m["seqserve_requests_finished_total{reason=cancelled}"] == 3
        worker = scrape(f"http://127.0.0.1:{d.worker.ports['metrics']}/metrics")
        assert worker["seqserve_worker_kv_tokens"] == 0


def test_worker_crash_loses_no_token(llama_dir, deploy):
    d = deploy(llama_dir)
    prompts = [("the king " * (i + 1) + "dragon", 60) for i in range(6)]
    sampled = [("the river flows", 50, 11), ("castle light", 50, 22)]
    tokens_seen = asyncio.Event()

    async def scenario():
        async with AsyncClient(d.address, timeout=300) as c:
            async def greedy(p, n):
                out = []
                async for ch in c.stream(p, max_new_tokens=n, ignore_eos=True):
                    if ch.token_id is not None:
                        out.append(ch.token_id)
                        if len(out) == 8:
                            tokens_seen.set()
                return out

            async def sample(p, n, seed):
                return [ch.token_id async for ch in c.stream(
                    p, max_new_tokens=n, ignore_eos=True, decoding_strategy="sample", seed=seed,
                    temperature=0.9, top_k=40) if ch.token_id is not None]

            async def crash():
                await tokens_seen.wait()
                d.worker.proc.kill()  # kill -9 in the middle of generation
                d.worker.proc.wait()
                await asyncio.sleep(0.5)
                await asyncio.to_thread(d.start_worker, d.worker.ports["grpc"])

            results = await asyncio.gather(*(greedy(p, n) for p, n in prompts),
                                           *(sample(*s) for s in sampled), crash())
            return results[: len(prompts)], results[len(prompts): -1]

    got_greedy, got_sampled = asyncio.run(scenario())
    eos = reference.load(str(llama_dir))[0].eos_token_id
    for (p, n), got in zip(prompts, got_greedy):
        assert len(got) == n
        assert reference.same_until_eos(got, reference.greedy(llama_dir, p, n), eos)
    with Client(d.address, timeout=120) as c:  # the same sampled requests, undisturbed
        for (p, n, seed), got in zip(sampled, got_sampled):
            again = c.generate(p, max_new_tokens=n, ignore_eos=True, decoding_strategy="sample",
                               seed=seed, temperature=0.9, top_k=40)
            assert got == again.token_ids
    m = scrape(d.metrics_url)
    assert m["seqserve_workers_ready"] == 1


# Slow (12 s): test_control_plane's readiness test also waits out worker_timeout on a
# dead worker and checks the UNAVAILABLE.
@pytest.mark.slow
def test_no_worker_within_timeout_gives_unavailable(llama_dir, deploy):
    d = deploy(llama_dir, worker_timeout=2)
    with Client(d.address, timeout=60) as c:
        call = c.stub.Generate(build_request(
            "once upon a time", max_new_tokens=500, ignore_eos=True))
        next(call)
        d.worker.proc.kill()
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker has served" in err.value.details()


def test_sigterm_drains_running_requests(llama_dir, deploy):
    d = deploy(llama_dir)
    with Client(d.address, timeout=120) as c:
        call = c.stub.Generate(build_request(
            "once upon a time", max_new_tokens=150, ignore_eos=True))
        first = next(call)
        d.scheduler.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(d) != "SERVING", 5, "health to leave SERVING")
        rest = list(call)
        assert rest[-1].finish_reason  # the running request finished normally
        # A message may carry several tokens (a stream that fell behind): count tokens.
        assert sum(len(response_tokens(m)) for m in [first, *rest]) == 150
        assert d.scheduler.proc.wait(30) == 0


def _status(d) -> str:
    try:
        return health_status(d.address)
    except grpc.RpcError:
        return "GONE"


def test_step_stream_answers_in_order_and_a_reset_voids_it(llama_dir, tmp_path):
    """The worker's Steps stream runs pipelined Steps in order (the scheduler sends the
    next one before the previous answer arrives); after a Reset the old stream takes no
    more Steps, so none of its Steps can run on the reset worker."""
    from scheduler_service.batch_plan import StepPlan
    from scheduler_service.params import DecodingConfig
    from scheduler_service.partition import Partition
    from scheduler_service.sequence import Sequence
    from scheduler_service.worker_client import StepFailed, WorkerClient
    from seqserve_common.decoding import DecodingStrategy
    from seqserve_common.config import ServingConfig
    from seqserve_common.control_auth import control_token
    from bench.deployment import Deployment

    d = Deployment(llama_dir, tmp_path)
    d.start_worker()

    def seq(i):
        return Sequence(seq_id=i, request_id=str(i), prompt_ids=[5, 6, 7], params=DecodingConfig(
            max_new_tokens=8, strategy=DecodingStrategy.GREEDY), detokenizer=None, stops=None,
            sampling_seed=0)

    def step(step_id, live, new=(), release=()):
        return step_id, StepPlan(list(release), [seq(i) for i in new], [live],
                                 Partition((), 0, 0.0), regrouped=True)

    async def scenario():
        client = WorkerClient(d.worker.address, control_token(ServingConfig()))
        await client.wait_ready(30)
        stream = client.open_steps()
        plans = [step(1, [1], new=[1]), step(2, [1, 2], new=[2]), step(3, [2], release=[1]),
                 step(4, [2, 3], new=[3])]
        for p in plans[:2]:
            await stream.send(*p)
        answers = []
        for p in plans[2:]:
            answers.append(await stream.receive())
            await stream.send(*p)
        answers += [await stream.receive(), await stream.receive()]
        got = [(a.step_id, sorted(t.seq_id for t in a.tokens)) for a in answers]
        await client.reset()
        await stream.send(*step(5, [2, 3]))
        with pytest.raises(StepFailed) as err:
            await stream.receive()
        stream.close()
        fresh = client.open_steps()
        await fresh.send(*step(6, [9], new=[9]))
        after = await fresh.receive()
        fresh.close()
        await client.close()
        return got, err.value, after

    try:
        got, err, after = asyncio.run(scenario())
    finally:
        d.stop()
    assert got == [(1, [1]), (2, [1, 2]), (3, [2]), (4, [2, 3])]
    assert err.code == "FAILED_PRECONDITION" and "reset" in err.details
    assert [t.seq_id for t in after.tokens] == [9]
