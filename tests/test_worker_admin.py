"""The scheduler's admin API over real processes: a worker registered while the scheduler
serves takes requests (exactly, as `model.generate`); a drained worker finishes its streams
unchanged, gets no new request, leaves the pool and can come back; the API refuses callers
without the control-plane token, a duplicate address and an unreachable one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.metrics import scrape
from client import AsyncClient, cli
from client.admin import CONTROL_METADATA_KEY, AdminClient
from seqserve.admin.v1 import admin_pb2, admin_pb2_grpc
from tests import reference
from tests.test_control_plane import wait_until
from tests.test_generation import _run_staggered, check_against_reference, make_requests

TOKEN = "admin-test-control-token-0123456789"


def deployment(model_dir, tmp_path):
    from bench.deployment import Deployment

    return Deployment(model_dir, tmp_path, env={"OPTION_CONTROL_TOKEN": TOKEN})


def placed(d) -> dict[str, float]:
    """Placements per worker address."""
    prefix = "seqserve_requests_placed_total{worker="
    return {k[len(prefix):-1]: v for k, v in scrape(d.metrics_url).items()
            if k.startswith(prefix)}


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_worker_registered_at_runtime_serves_exactly(llama_dir, tmp_path, monkeypatch,
                                                       capsys):
    d = deployment(llama_dir, tmp_path)
    try:
        d.start_worker()
        second = d.start_worker(index=1).address
        d.start_scheduler(worker_port=d.worker.ports["grpc"])  # the first worker only
        with grpc.insecure_channel(d.address) as ch:
            stub = admin_pb2_grpc.WorkerAdminStub(ch)
            for metadata in ((), ((CONTROL_METADATA_KEY, "guessed-token"),)):
                err = refusal(lambda: stub.RegisterWorker(
                    admin_pb2.RegisterWorkerRequest(address=second), timeout=10,
                    metadata=metadata))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "control-plane token" in err.details()
                err = refusal(lambda: stub.ListWorkers(admin_pb2.ListWorkersRequest(),
                                                       timeout=10, metadata=metadata))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        with AdminClient(d.address, TOKEN) as admin:
            assert [w.address for w in admin.list()] == [d.worker.address]
            joined = admin.register(second)
            assert (joined.address, joined.state) == (second, "serving")
            assert joined.kv_capacity_tokens > 0
            err = refusal(lambda: admin.register(second))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert f"worker {second} is already in the pool" in err.details()
            err = refusal(lambda: admin.register("127.0.0.1:1"))  # nothing listens there
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not answer" in err.details()
            assert [(w.address, w.state) for w in admin.list()] == [
                (d.worker.address, "serving"), (second, "serving")]
        monkeypatch.setenv("SEQSERVE_CONTROL_TOKEN", TOKEN)
        assert cli.main(["--address", d.address, "workers", "list"]) == 0
        listed = [line.split("\t")[:2] for line in capsys.readouterr().out.splitlines()]
        assert listed == [[d.worker.address, "serving"], [second, "serving"]]
        requests = make_requests(llama_dir, 24, seed=11)
        replies = asyncio.run(_run_staggered(d.address, requests, seed=5))
        counts = placed(d)
    finally:
        d.stop()
    check_against_reference(llama_dir, requests, replies)
    assert set(counts) == {d.worker.address, second} and min(counts.values()) > 0, counts
    assert sum(counts.values()) == 24, counts


@pytest.mark.slow  # 15-16 s; make test keeps under its 15 minutes
def test_a_drained_worker_finishes_its_streams_then_leaves(llama_dir, tmp_path):
    d = deployment(llama_dir, tmp_path)
    prompts = [(f"the knight number {i} rode to the tower " * (1 + i % 3), 48) for i in range(12)]
    late = [(f"a late traveller {i} came to the inn", 12) for i in range(6)]
    try:
        d.start(workers=2)
        first, second = (w.address for w in d.workers)
        admin = AdminClient(d.address, TOKEN)

        async def scenario():
            progress: dict[int, int] = {}
            started = asyncio.Event()
            async with AsyncClient(d.address, timeout=300) as c:
                async def one(i, prompt, n):
                    out = []
                    async for ch in c.stream(prompt, max_new_tokens=n, ignore_eos=True):
                        if ch.token_id is not None:
                            out.append(ch.token_id)
                            progress[i] = len(out)
                            if len(progress) == len(prompts) and min(progress.values()) >= 3:
                                started.set()
                    return out

                async def drain_then_send():
                    await started.wait()
                    before = placed(d)
                    state = await asyncio.to_thread(admin.drain, second)
                    late_out = await asyncio.gather(*(c.generate(p, max_new_tokens=n)
                                                      for p, n in late))
                    return before, state, late_out

                results = await asyncio.gather(
                    *(one(i, p, n) for i, (p, n) in enumerate(prompts)), drain_then_send())
                return results[:-1], results[-1]

        outputs, (before, state, late_replies) = asyncio.run(scenario())
        after = placed(d)
        wait_until(lambda: [w.address for w in admin.list()] == [first], 60, "the drain")
        gone = scrape(d.metrics_url)
        err = refusal(lambda: admin.drain(first))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "only one" in err.details()
        assert refusal(lambda: admin.drain("127.0.0.1:9")).code() == grpc.StatusCode.NOT_FOUND
        back = admin.register(second)  # a drained worker can come back
        admin.close()
    finally:
        d.stop()
    assert before[second] > 0, before  # it had streams to finish
    assert state.state == "draining" and state.running > 0, state
    # Nothing new on it, and nothing moved off it: every stream finished where it ran.
    assert after[second] == before[second], (before, after)
    assert sum(after.values()) == len(prompts) + len(late), after
    eos = reference.load(str(llama_dir))[0].eos_token_id
    for (prompt, n), got in zip(prompts, outputs):
        assert len(got) == n
        assert reference.same_until_eos(got, reference.greedy(llama_dir, prompt, n), eos)
    for (prompt, n), reply in zip(late, late_replies):
        assert reply.token_ids == reference.greedy(llama_dir, prompt, n)
    assert gone["seqserve_workers_ready"] == 1
    assert f"seqserve_worker_ready{{worker={second}}}" not in gone
    assert back.state == "serving"
