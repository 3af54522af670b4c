"""The control plane against an attacker and against failures, on real processes: an
unauthenticated local client cannot drive or read a worker, readiness tells whether a
worker serves, a request never hangs on a dead worker, and a worker drops the sequences
of a scheduler that went silent, and a shutdown keeps to its drain timeout."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from bench.metrics import scrape
from client import Client
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc
from seqserve_common.config import ServingConfig
from seqserve_common.control_auth import METADATA_KEY, control_token
from tests.reference import greedy
from seqserve_common.steps_link import HEADER, frame, read_frame


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health(address: str, service: str) -> str:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as exc:
        return exc.code().name


def ping(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def worker_sequences(d) -> float:
    return scrape(d.worker_metrics_url)["seqserve_worker_sequences"]


PROMPT, N = "the king rode to the castle and", 120


def test_an_unauthenticated_local_client_cannot_drive_or_read_the_worker(llama_dir, deploy):
    d = deploy(llama_dir)
    with Client(d.address, timeout=300) as c:
        undisturbed = c.generate(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids
        victim: list[int] = []
        streaming = threading.Event()

        def run_victim():
            for ch in c.stream(PROMPT, max_new_tokens=N, ignore_eos=True):
                if ch.token_id is not None:
                    victim.append(ch.token_id)
                    streaming.set()

        t = threading.Thread(target=run_victim)
        t.start()
        assert streaming.wait(60)
        refusals = []
        with grpc.insecure_channel(d.worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for metadata in ((), ((METADATA_KEY, "guessed-token-0123456789"),)):
                calls = [
                    lambda: stub.Info(worker_pb2.InfoRequest(), timeout=5, metadata=metadata),
                    lambda: stub.Reset(worker_pb2.ResetRequest(), timeout=5, metadata=metadata),
                    # Steal the victim's next tokens (sequence ids are small integers).
                    lambda: list(stub.Steps(iter([worker_pb2.StepRequest(
                        step_id=1, groups=[worker_pb2.Group(sequence_ids=list(range(1, 9)))])]),
                        timeout=5, metadata=metadata)),
                    lambda: list(stub.Steps(iter([worker_pb2.StepRequest(
                        step_id=1, release=list(range(1, 9)))]), timeout=5, metadata=metadata)),
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    refusals.append((err.value.code(), err.value.details()))
        # The same theft over the direct Steps link, without a hello or with a wrong one.
        link = ("127.0.0.1", d.worker.ports["steps_link"])
        steal = worker_pb2.StepRequest(
            step_id=1, groups=[worker_pb2.Group(sequence_ids=list(range(1, 9)))])
        for hello in (b"", worker_pb2.StepsLinkHello(
                control_token="guessed-token-0123456789").SerializeToString()):
            with socket.create_connection(link, timeout=10) as sock:
                if hello:
                    sock.sendall(frame(hello))
                sock.sendall(frame(steal.SerializeToString()))
                answer = worker_pb2.StepsLinkFrame.FromString(read_frame(sock))
                assert read_frame(sock) is None  # and the worker closed the link
            refusals.append((grpc.StatusCode[answer.error.code], answer.error.details))
        # A frame too long to be a hello is not read, only closed.
        with socket.create_connection(link, timeout=10) as sock:
            sock.sendall(HEADER.pack(1 << 30) + b"x" * 1024)
            assert read_frame(sock) is None
        t.join(300)
    assert len(refusals) == 10
    for code, details in refusals:
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
        assert not any(ch.isdigit() for ch in details), details  # no sequence ids revealed
    assert victim == undisturbed
    assert "Steps over the direct link" in d.scheduler.log.read_text()
    # With the token, a Step the worker refuses ends the link with the reason, also when
    # another Step follows it, and the link closes once we have read it and closed ours.
    bad = frame(worker_pb2.StepRequest(step_id=1, chunks=[
        worker_pb2.PrefillChunk(sequence_id=10**6, end=4)] * 2).SerializeToString())
    with socket.create_connection(link, timeout=10) as sock:
        sock.sendall(frame(worker_pb2.StepsLinkHello(
            control_token=control_token(ServingConfig())).SerializeToString()) + bad + bad)
        answer = worker_pb2.StepsLinkFrame.FromString(read_frame(sock))
        assert answer.error.code == "FAILED_PRECONDITION", answer
        assert "two prefill chunks" in answer.error.details
        sock.shutdown(socket.SHUT_WR)
        assert read_frame(sock) is None
    # Health and reflection stay open for probes.
    assert health(d.worker.address, "") == "SERVING"


def reflected_services(address: str, version: str) -> list[str]:
    """The services listed by grpc.reflection.<version> (v1 and v1alpha share messages)."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        [answer] = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                             timeout=5))
    return [s.name for s in answer.list_services_response.service]


def test_readiness_follows_the_worker_and_requests_never_hang(llama_dir, deploy):
    d = deploy(llama_dir, worker_timeout=3)
    for name in ("", "readiness", "liveness", "seqserve.v1.Generation"):
        assert health(d.address, name) == "SERVING", name
    for address in (d.address, d.worker.address):  # grpcurl and friends speak v1 today
        for version in ("v1", "v1alpha"):
            assert "grpc.health.v1.Health" in reflected_services(address, version)
    assert ping(d.http_url) == 200
    worker_port = d.worker.ports["grpc"]
    d.worker.proc.kill()  # kill -9, and nothing restarts it yet
    d.worker.proc.wait()
    wait_until(lambda: health(d.address, "readiness") == "NOT_SERVING", 10, "readiness to drop")
    assert health(d.address, "") == "NOT_SERVING"
    assert health(d.address, "liveness") == "SERVING"  # the scheduler itself is fine
    assert ping(d.http_url) == 503
    assert scrape(d.metrics_url)["seqserve_workers_ready"] == 0
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        Client(d.address, timeout=60).generate("hello there", max_new_tokens=4)
    waited = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "no worker" in err.value.details()
    assert waited < 3 + 5, waited  # worker_timeout, not the client's deadline
    assert scrape(d.metrics_url)["seqserve_num_requests_running"] == 0
    d.start_worker(worker_port)  # a restarted worker on the same address is taken up again
    wait_until(lambda: health(d.address, "readiness") == "SERVING", 30, "readiness to return")
    assert ping(d.http_url) == 200
    with Client(d.address, timeout=60) as c:
        assert len(c.generate("hello there", max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_a_worker_drops_the_sequences_of_a_scheduler_gone_silent(llama_dir, deploy):
    d = deploy(llama_dir, worker_options={"worker_lease": 2})
    with Client(d.address, timeout=300) as c:
        call = c.stub.Generate(__import__("client.api", fromlist=["x"]).build_request(
            PROMPT, max_new_tokens=900, ignore_eos=True))
        for _ in range(3):
            next(call)
        assert worker_sequences(d) == 1
        d.scheduler.proc.kill()  # kill -9: no Reset, no release
        d.scheduler.proc.wait()
        t0 = time.monotonic()
        wait_until(lambda: worker_sequences(d) == 0, 15, "the lease to release the sequence")
        assert time.monotonic() - t0 < 2 + 5
    d.start_scheduler()  # a new scheduler takes over cleanly
    with Client(d.address, timeout=60) as c:
        assert len(c.generate(PROMPT, max_new_tokens=5, ignore_eos=True).token_ids) == 5


def test_drain_timeout_bounds_every_request_and_late_calls_get_unavailable(llama_dir, deploy):
    d = deploy(llama_dir, drain_timeout=2)
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 900,
                                                        "ignore_eos": True}}).encode()

    def http_request():
        req = urllib.request.Request(f"{d.http_url}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except (urllib.error.URLError, ConnectionError, OSError):
            pass  # cut by the shutdown: what matters is when

    with Client(d.address, timeout=120) as c:
        stream = c.stub.Generate(__import__("client.api", fromlist=["x"]).build_request(
            PROMPT, max_new_tokens=900, ignore_eos=True))
        next(stream)
        t = threading.Thread(target=http_request)
        t.start()
        wait_until(lambda: scrape(d.metrics_url)["seqserve_num_requests_running"] == 2, 30,
                   "both requests to run")
        t0 = time.monotonic()
        d.scheduler.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health(d.address, "readiness") != "SERVING", 5, "readiness to drop")
        with pytest.raises(grpc.RpcError) as late:
            c.generate("hello", max_new_tokens=2)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in late.value.details()
        assert d.scheduler.proc.wait(30) == 0
        elapsed = time.monotonic() - t0
        t.join(30)
    assert elapsed < 2 + 3, elapsed


def test_a_worker_without_a_steps_link_gets_its_steps_over_grpc(llama_dir, deploy):
    """worker_steps_link_port=-1: no link is offered and the Steps call carries the Steps,
    with model.generate's tokens (every other test here runs over the link)."""
    d = deploy(llama_dir, worker_options={"worker_steps_link_port": -1})
    prompts = [PROMPT, "a short one", PROMPT]
    with Client(d.address, timeout=300) as c, ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(
            lambda p: c.generate(p, max_new_tokens=24, ignore_eos=True).token_ids, prompts))
    assert d.worker.ports["steps_link"] == -1
    assert "Steps over gRPC" in d.scheduler.log.read_text()
    assert got[0] == got[2] == greedy(llama_dir, PROMPT, 24)
