"""Defects found by adversarial testing, each pinned by a test: HTTP clients that go away,
send junk or trickle their bodies; oversized batches; parameters that cost too much or
explain themselves badly; what ModelInfo advertises; top-logprob text; the properties
parser; `make run` for a second instance.

Tests against the server start real scheduler and worker processes on 127.0.0.1 (one
deployment for the module); the rest are pure logic or an in-process HTTP app."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from bench.deployment import Deployment
from bench.metrics import scrape
from client import Client
from client.api import response_tokens
from scheduler_service import params
from scheduler_service.params import Limits, RequestError, resolve
from seqserve.v1 import generate_pb2, generate_pb2_grpc
from seqserve_common.config import parse_properties
from tests.conftest import LONG_CONTEXT, long_context_model, tiny_model

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 1024  # the tiny Llama's max_position_embeddings
LIMITS = Limits(vocab_size=1000, max_position_embeddings=CONTEXT, max_new_tokens_limit=100000,
                default_max_new_tokens=16)
FINISHED = "seqserve_requests_finished_total{reason=%s}"
RUNNING = "seqserve_num_requests_running"


# --- the shared deployment ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # max_new_tokens_limit past the context: ModelInfo must not advertise it (item 6). The
    # long context keeps a request decoding until its client goes away, however fast.
    d = Deployment(long_context_model(), tmp_path_factory.mktemp("hardening"),
                   {"max_new_tokens_limit": 100000})
    d.start()
    try:
        yield d
    finally:
        d.stop()


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def http_port(d: Deployment) -> int:
    return d.scheduler.ports["http"]


def raw_request(body: bytes, path: str = "/invocations") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def metric(d: Deployment, name: str) -> float:
    return scrape(d.metrics_url).get(name, 0.0)


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_still_serving(d: Deployment) -> None:
    status, answer = post(d.http_url + "/invocations",
                          json.dumps({"inputs": "Once upon a time",
                                      "parameters": {"max_new_tokens": 3}}).encode())
    assert status == 200, answer[:300]
    assert json.loads(answer)["details"]["generated_tokens"] >= 1


# --- 1. a non-streaming HTTP request whose client goes away is cancelled -------------------

def test_http_disconnect_cancels_a_non_streaming_request(server):
    """Before: the sequence ran on to max_new_tokens for nobody and counted as `length`."""
    d = server
    before = scrape(d.metrics_url)
    body = json.dumps({"inputs": "Once upon a time", "parameters": {
        "max_new_tokens": LONG_CONTEXT - 16, "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", http_port(d)))
    try:
        s.sendall(raw_request(body))
        # Close once it is decoding.
        assert wait_for(lambda: metric(d, RUNNING) >= 1, 30), "the request never ran"
    finally:
        s.close()
    t0 = time.monotonic()
    assert wait_for(lambda: metric(d, RUNNING) == 0, 1.5), \
        "the sequence kept running after its client went away"
    took = time.monotonic() - t0
    after = scrape(d.metrics_url)
    delta = {r: after.get(FINISHED % r, 0) - before.get(FINISHED % r, 0)
             for r in ("cancelled", "length")}
    assert delta == {"cancelled": 1, "length": 0}, (delta, took)


def test_http_disconnect_cancels_a_streaming_request(server):
    d = server
    before = metric(d, FINISHED % "cancelled")
    body = json.dumps({"inputs": "Once upon a time", "stream": True, "parameters": {
        "max_new_tokens": LONG_CONTEXT - 16, "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", http_port(d)))
    try:
        s.sendall(raw_request(body))
        assert s.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        s.close()
    # The headers can come before the request is admitted, so "nothing running" alone could
    # be read before it ran at all: wait for its end as cancelled.
    assert wait_for(lambda: metric(d, FINISHED % "cancelled") == before + 1, 5), \
        "the sequence was not cancelled after its client went away"
    assert wait_for(lambda: metric(d, RUNNING) == 0, 3)


# --- 2. a huge list of prompts is refused before it is tokenized --------------------------

def test_huge_prompt_list_gets_429_at_once(server):
    """200,000 prompts (1.2 MB, under the 4 MiB body limit) against a queue of 1024: 429 in
    about the time it takes to parse the JSON. Before the queue check moved ahead of
    tokenization this took 26-33 s and the scheduler grew from 371 MB to 1.3 GB."""
    d = server
    body = json.dumps({"inputs": ["a"] * 200_000, "parameters": {"max_new_tokens": 1}}).encode()
    assert len(body) < 4 << 20
    pid = d.scheduler.proc.pid
    hwm_before = _peak_rss_kib(pid)
    t0 = time.monotonic()
    status, answer = post(d.http_url + "/invocations", body)
    took = time.monotonic() - t0
    assert status == 429, (status, answer[:300])
    err = json.loads(answer)
    assert err["code"] == 429 and "queue" in err["error"], err
    assert took < 3, f"the 429 took {took:.1f} s"
    assert _peak_rss_kib(pid) - hwm_before < 300 * 1024, "the scheduler's memory jumped"
    assert_still_serving(d)


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


# --- 3. stopping the HTTP server is bounded (drain_timeout) ---------------------------------

class StubFrontend:
    """Ready, accepts anything, and never finishes a sequence; records closed generators."""

    def __init__(self):
        self.ready = True
        self.closed = 0

    async def submit(self, request):
        return [SimpleNamespace(request_id=request.request_id or "stub")]

    async def events(self, seq):
        try:
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            self.closed += 1

    async def all_events(self, seq):
        try:
            await asyncio.Event().wait()
        finally:
            self.closed += 1


async def _start_app(**attrs):
    from scheduler_service.http_api import InvocationsApp

    frontend = StubFrontend()
    app = InvocationsApp(frontend, **attrs)  # short timeouts: the defaults are minutes long
    port = await app.server.start("127.0.0.1", 0)
    return app, frontend, port


def test_http_stop_is_bounded_by_the_shutdown_timeout():
    """A request that never ends no longer holds `stop` for aiohttp's 60 s default: after
    shutdown_timeout its handler is cancelled, and its sequence with it."""
    async def scenario():
        app, frontend, port = await _start_app(shutdown_timeout=1.0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw_request(b'{"inputs": "x"}'))
        await writer.drain()
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await asyncio.wait_for(app.server.stop(), 10)
        took = time.monotonic() - t0
        writer.close()
        return took, frontend.closed

    took, closed = asyncio.run(scenario())
    assert took < 4, f"stop took {took:.1f} s"
    assert closed == 1, "the request's events were not closed (its sequence not cancelled)"


# --- 4. contrastive top_k is capped -------------------------------------------------------

def test_contrastive_top_k_is_capped():
    """Before: any top_k up to the vocabulary; four such requests slowed greedy neighbours
    5-7x (a forward row per candidate per step)."""
    cap = 64
    ok = resolve({"decoding_strategy": "contrastive", "top_k": cap}, LIMITS, 5)
    assert ok.top_k == cap
    for k in (cap + 1, LIMITS.vocab_size):
        with pytest.raises(RequestError) as exc:
            resolve({"decoding_strategy": "contrastive", "top_k": k}, LIMITS, 5)
        msg = str(exc.value)
        assert msg.startswith("top_k") and str(cap) in msg and str(k) in msg
    assert params.MAX_CONTRASTIVE_TOP_K == cap
    # Sampling's top_k is a filter, not a cost: the vocabulary stays its bound.
    assert resolve({"do_sample": True, "top_k": 1000}, LIMITS, 5).top_k == 1000


# --- 5. the context message when max_new_tokens alone is too large ---------------------------

def test_context_message_when_max_new_tokens_alone_exceeds_it():
    with pytest.raises(RequestError) as exc:
        resolve({"max_new_tokens": 4096}, LIMITS, 10)
    msg = str(exc.value)
    assert "-" not in msg.split("context of")[1], msg  # never "at most -3072 tokens"
    assert "max_new_tokens must be at most 1014" in msg and "shorten the prompt" not in msg
    # Both remedies work when the prompt is the long part.
    with pytest.raises(RequestError) as exc:
        resolve({"max_new_tokens": 8}, LIMITS, 1017)
    assert "shorten the prompt to at most 1016 tokens" in str(exc.value)
    assert "max_new_tokens must be at most 7" in str(exc.value)


# --- 6. ModelInfo advertises what a request can get ---------------------------------------

def test_model_info_limit_fits_the_context(server):
    with Client(server.address, timeout=30) as c:
        info = c.model_info()
    assert info.max_position_embeddings == LONG_CONTEXT
    assert info.max_new_tokens_limit == LONG_CONTEXT - 1  # not the configured 100000


# --- 7. junk and dropped connections do not flood the log ---------------------------------

def test_bad_http_and_dropped_clients_log_no_error(server):
    d = server
    log = d.scheduler.log
    start = len(log.read_bytes())
    port = http_port(d)
    junk = [b"\x00\x01garbage\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
            b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"POST /invocations HTTP/1.1\r\n" + b"X-Long: " + b"a" * 10000 + b"\r\n\r\n",
            b"POST /invocations HTTP/9.9 junk\r\n\r\n"]
    for data in junk:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(data)
            s.settimeout(5)
            assert s.recv(100).startswith(b"HTTP/1."), data[:40]
    # Dropped: mid-body, mid-generation, and a streaming one reset by the client.
    body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 200,
                                                      "ignore_eos": True}}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(raw_request(body)[:-5])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(raw_request(body))
        time.sleep(0.3)
    stream = json.dumps({"inputs": "hi", "stream": True, "parameters": {
        "max_new_tokens": 200, "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(raw_request(stream))
    s.recv(100)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()  # RST
    assert wait_for(lambda: metric(d, RUNNING) == 0, 5)
    time.sleep(0.5)
    new = log.read_bytes()[start:].decode(errors="replace")
    assert " ERROR " not in new and "Traceback" not in new, new[-3000:]
    assert_still_serving(d)


# --- 8. a body trickled slower than the timeout gets 408 ----------------------------------

def test_slow_body_gets_408_and_the_connection_closes():
    async def scenario():
        app, _, port = await _start_app(body_timeout=1.0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"inputs": "' + b"a" * 40 + b'"}'
            writer.write(raw_request(body)[:-len(body)])
            t0 = time.monotonic()

            async def trickle():
                for b in body:
                    writer.write(bytes([b]))
                    await writer.drain()
                    await asyncio.sleep(0.3)

            task = asyncio.create_task(trickle())
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                answer = await asyncio.wait_for(reader.read(), 6)  # to EOF: closed
            finally:
                task.cancel()
                writer.close()
            return head, answer, time.monotonic() - t0
        finally:
            await app.server.stop()

    head, answer, took = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(answer)
    assert err["code"] == 408 and "body" in err["error"], err
    assert took < 6, f"closed after {took:.1f} s"


# --- 9. 413 is a JSON error like every other ----------------------------------------------

def test_body_too_large_is_a_json_error(server):
    status, answer = post(server.http_url + "/invocations",
                          b'{"inputs": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413, (status, answer[:200])
    err = json.loads(answer)
    assert err["code"] == 413 and "4194304" in err["error"], err
    status, answer = post(server.http_url + "/nowhere", b"{}")
    assert status == 404 and json.loads(answer)["code"] == 404
    assert_still_serving(server)


# --- 10. request_id must be a string --------------------------------------------------------

@pytest.mark.parametrize("rid", [5, 1.5, {"a": 1}, [1], True])
def test_request_id_must_be_a_string(server, rid):
    status, answer = post(server.http_url + "/invocations", json.dumps(
        {"inputs": "hi", "request_id": rid, "parameters": {"max_new_tokens": 2}}).encode())
    assert status == 400, (rid, status, answer[:200])
    err = json.loads(answer)
    assert err["code"] == 400 and "request_id" in err["error"], err


def test_string_request_id_is_accepted(server):
    status, answer = post(server.http_url + "/invocations", json.dumps(
        {"inputs": "hi", "request_id": "abc", "parameters": {"max_new_tokens": 2}}).encode())
    assert status == 200, answer[:200]


def test_request_id_length_is_capped(server):
    """The id is echoed in every streamed message: a long one is refused on both APIs,
    one at the cap serves and comes back whole."""
    from scheduler_service.frontend import MAX_REQUEST_ID_CHARS

    def invoke(rid):
        return post(server.http_url + "/invocations", json.dumps(
            {"inputs": "hi", "request_id": rid, "parameters": {"max_new_tokens": 2}}).encode())

    status, answer = invoke("r" * (MAX_REQUEST_ID_CHARS + 1))
    assert status == 400 and "at most 256" in json.loads(answer)["error"], answer[:300]
    with grpc.insecure_channel(server.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(generate_pb2.GenerateRequest(
                inputs="hi", request_id="g" * 100_000,
                parameters=generate_pb2.DecodingParameters(max_new_tokens=2)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id has 100000 characters" in err.value.details()
        rid = "g" * MAX_REQUEST_ID_CHARS
        reply = stub.GenerateUnary(generate_pb2.GenerateRequest(
            inputs="hi", request_id=rid,
            parameters=generate_pb2.DecodingParameters(max_new_tokens=2)), timeout=60)
        assert reply.request_id == rid
    status, answer = invoke("r" * MAX_REQUEST_ID_CHARS)
    assert status == 200, answer[:200]


# --- 11. gRPC top logprobs carry their text ----------------------------------------------

def test_grpc_top_logprobs_have_text(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    req = generate_pb2.GenerateRequest(
        inputs="Once upon a time",
        parameters=generate_pb2.DecodingParameters(max_new_tokens=6, logprobs=2,
                                                   ignore_eos=True))
    with grpc.insecure_channel(server.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        reply = stub.GenerateUnary(req, timeout=60)
        streamed = [t for m in stub.Generate(req, timeout=60) for t in response_tokens(m)]
    for tokens in (list(reply.tokens), streamed):
        assert len(tokens) == 6
        tops = [t for token in tokens for t in token.top_logprobs]
        assert len(tops) == 12
        for t in tops:
            assert t.text == tok.decode([t.id], skip_special_tokens=False), (t.id, t.text)
        assert any(t.text for t in tops)


# --- 12. `#` inside a properties value ------------------------------------------------------

def test_hash_inside_a_properties_value_is_kept():
    props = parse_properties(
        "# a comment\n"
        "  # an indented comment\n"
        "option.model_id=/models/a#b\n"
        "option.max_sparsity=0.2   # trailing comment\n"
        "option.dtype=fp32\t# after a tab\n"
        "option.auth_token=#secret#\n"
        "engine=Python\n")
    assert props == {"option.model_id": "/models/a#b", "option.max_sparsity": "0.2",
                     "option.dtype": "fp32", "option.auth_token": "#secret#",
                     "engine": "Python"}


# --- 13. `make run` for a second instance -------------------------------------------------

def test_make_run_derives_every_port():
    """PORT and WORKER_PORT move all six ports (HTTP and metrics used to stay on 8080,
    8001, 8101, so a second instance died with `Address already in use`). VENV points
    nowhere, so even a recipe that make would execute under -n starts nothing."""
    out = subprocess.run(["make", "-n", "run", "PORT=9000", "WORKER_PORT=9100",
                          "VENV=/nonexistent-seqserve-venv"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    flat = " ".join(out.replace("\\\n", " ").split())
    for flag in ("--port 9000", "--http-port 9080", "--openai-port 9081", "--metrics-port 9001",
                 "--worker-port 9100", "--worker-metrics-port 9101",
                 "--worker-addresses 127.0.0.1:9100"):
        assert flag in flat, (flag, out)
    for default in ("8080", "8081", "8001", "8101", "8000", "8100"):
        assert default not in flat, (default, out)
    # Each derived port can still be set alone; the worker is restarted when it exits.
    out = subprocess.run(["make", "-n", "run", "HTTP_PORT=7777", "MODEL_ID=/m",
                          "VENV=/nonexistent-seqserve-venv"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "--http-port 7777" in out and "--metrics-port 8001" in out
    assert "while :" in out and "seqserve-worker" in out


def test_compose_restarts_the_worker():
    import yaml

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name in ("worker", "worker-gpu"):
        assert compose["services"][name]["restart"] in ("unless-stopped", "on-failure",
                                                         "always")


def test_an_openai_reply_of_n_choices_answers_the_first_error_at_once():
    """A choice that ends in an error answers 503 without waiting for the other choices,
    whose sequences are cancelled (their waits end with the handler's)."""
    from scheduler_service.openai_api import OpenAIApp
    from scheduler_service.openai_schemas import ApiError
    from scheduler_service.sequence import FinishEvent, FinishReason

    class Frontend:
        state = SimpleNamespace(tokenizer=None)
        cancelled: list = []

        async def all_events(self, seq):
            if seq == "failed":
                return [FinishEvent(FinishReason.ERROR, "", 1, 0, 0, "worker lost")]
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(seq)
                raise

    async def scenario():
        app = OpenAIApp(Frontend(), ("m",))
        req = SimpleNamespace(logprobs=None, stream=False, n=2)
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(app._answer(None, req, "id", ["running", "failed"],
                                               chat=False), 5)
        return err.value

    err = asyncio.run(scenario())
    assert (err.status, err.message) == (503, "worker lost")
    assert Frontend.cancelled == ["running"]
