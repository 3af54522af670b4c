"""option.frontend_processes: clients served by front-end processes beside the scheduler
core (core_service.py, remote_core.py), over real processes on loopback.

The oracle is the single-process deployment: the same requests, greedy, sampled with a
seed, with stop strings, logprobs and beams, get the same replies from both; greedy ones
also equal model.generate."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from openai import OpenAI
from seqserve.core.v1 import core_pb2, core_pb2_grpc
from transformers import AutoTokenizer

from bench.deployment import Deployment
from bench.metrics import scrape
from client import AsyncClient, Client
from scheduler_service.admission import QueueFull
from scheduler_service.params import DecodingConfig
from scheduler_service.remote_core import RemoteCore
from scheduler_service.sequence import Sequence
from seqserve_common.decoding import DecodingStrategy
from tests import reference
from tests.conftest import tiny_model

MODEL = tiny_model("llama")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    with Deployment(MODEL, tmp_path_factory.mktemp("single")) as d:
        yield d


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    with Deployment(MODEL, tmp_path_factory.mktemp("split"),
                    {"frontend_processes": 2}) as d:
        yield d


def _prompts(n: int) -> list[str]:
    tok = AutoTokenizer.from_pretrained(MODEL)
    import random
    rng = random.Random(11)
    return [reference.prompt_of_tokens(tok, rng.randint(20, 60), rng) for _ in range(n)]


PROMPTS = _prompts(6)


def _requests(stop: str) -> list[tuple[str, dict]]:
    greedy = [(p, {"max_new_tokens": 8 + 5 * i}) for i, p in enumerate(PROMPTS)]
    return [*greedy,
            (PROMPTS[0], {"max_new_tokens": 40, "stop": [stop]}),
            (PROMPTS[1], {"max_new_tokens": 12, "logprobs": 3}),
            (PROMPTS[2], {"max_new_tokens": 20, "do_sample": True, "seed": 5, "top_k": 20}),
            (PROMPTS[3], {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 2})]


async def _all(address: str, requests: list[tuple[str, dict]]) -> list:
    async def one(prompt, params):
        # A connection each (channels to one address may share a connection unless each
        # has its own subchannel pool): the kernel spreads connections over the front ends.
        async with AsyncClient(address, timeout=120,
                               channel_options=[("grpc.use_local_subchannel_pool", 1)]) as c:
            return await c.generate(prompt, **params)
    return await asyncio.gather(*(one(p, dict(kw)) for p, kw in requests))


def _stop_string(single: Deployment) -> str:
    """Text the first prompt's greedy output reaches after a few tokens."""
    with Client(single.address, timeout=60) as c:
        text = c.generate(PROMPTS[0], max_new_tokens=40).text
    assert len(text) > 12, text
    return text[8:11]


def test_replies_equal_the_single_process_deployment_and_greedy_equals_generate(single, split):
    requests = _requests(_stop_string(single))
    expected = asyncio.run(_all(single.address, requests))
    got = asyncio.run(_all(split.address, requests))
    def unscored(beams):
        return [replace(s, score=0.0) for s in beams]

    for (prompt, params), a, b in zip(requests, expected, got):
        # Prefix-cache hits and the last float bits of a logprob, and so of a beam's
        # score, depend on which requests ran together.
        assert (replace(b, cached_tokens=0, logprobs=[], sequences=unscored(b.sequences))
                == replace(a, cached_tokens=0, logprobs=[], sequences=unscored(a.sequences))
                ), params
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), params
        assert ([s.score for s in b.sequences]
                == pytest.approx([s.score for s in a.sequences], abs=1e-4)), params
    for (prompt, params), reply in zip(requests[:len(PROMPTS)], got):
        assert reply.token_ids == reference.greedy(MODEL, prompt, params["max_new_tokens"])
    assert got[len(PROMPTS)].finish_reason == "stop"
    assert got[len(PROMPTS) + 3].sequences, "beam search returned no hypotheses"
    scored = requests[len(PROMPTS) + 1]
    tops = []
    for d in (single, split):
        with Client(d.address, timeout=60) as c:
            tops.append([[t for t, _ in ch.top_logprobs]
                         for ch in c.stream(scored[0], **scored[1]) if ch.token_id is not None])
    assert tops[1] == tops[0] and len(tops[1][0]) == 3
    served = [v for k, v in scrape(split.metrics_url).items()
              if k.startswith("seqserve_frontend_requests_total{")]
    assert len(served) == 2 and min(served) > 0, f"a front end served nothing: {served}"
    # The stop string ended the sequence in the front end, which cancelled it in the core.
    assert scrape(split.metrics_url).get("seqserve_requests_finished_total{reason=stop}") == 1
    again = [asyncio.run(_all(d.address, requests[:1]))[0] for d in (single, split)]
    assert again[1] == again[0] and again[1].cached_tokens > 0  # its prompt blocks are cached


def test_openai_completions_equal_the_single_process_deployment(single, split):
    def complete(d: Deployment, stream: bool) -> str:
        client = OpenAI(base_url=d.openai_url, api_key="none")
        kw = dict(model=str(MODEL), prompt=PROMPTS[4], max_tokens=16, temperature=0)
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    expected = complete(single, False)
    assert complete(split, False) == expected
    assert complete(split, True) == expected


def test_a_stream_left_early_is_cancelled_in_the_core(split):
    before = scrape(split.metrics_url)
    with Client(split.address, timeout=60) as c:
        chunks = c.stream(PROMPTS[5], max_new_tokens=900, ignore_eos=True)
        for _ in range(3):
            next(chunks)
        chunks.close()
    key = "seqserve_requests_finished_total{reason=cancelled}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = scrape(split.metrics_url)
        if now.get(key, 0) > before.get(key, 0) and now["seqserve_num_requests_running"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the core still runs the abandoned sequence: {now}")


def test_a_refused_request_is_counted_by_the_core(split):
    key = "seqserve_requests_failed_total{code=INVALID_ARGUMENT}"
    before = scrape(split.metrics_url).get(key, 0)
    with Client(split.address, timeout=60) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(PROMPTS[0], max_new_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while scrape(split.metrics_url).get(key, 0) != before + 1:
        assert time.monotonic() < deadline, "the refusal was not counted"
        time.sleep(0.1)


def test_the_openai_port_serves_the_cores_metrics(split):
    """An inference gateway's endpoint picker scrapes /metrics on the port it routes to."""
    url = split.openai_url.removesuffix("/v1") + "/metrics"
    body = urllib.request.urlopen(url, timeout=30).read().decode()
    assert "seqserve_num_requests_waiting" in body and "seqserve_requests_failed_total" in body


def test_the_core_port_refuses_calls_without_the_control_token(split):
    address = f"127.0.0.1:{split.scheduler.ports['core']}"
    with grpc.insecure_channel(address) as ch:
        stub = core_pb2_grpc.CoreStub(ch)
        calls = [lambda: stub.Info(core_pb2.InfoRequest(), timeout=10),
                 lambda: stub.Submit(core_pb2.SubmitRequest(frontend="frontend-0"), timeout=10),
                 lambda: stub.Cancel(core_pb2.CancelRequest(sequence_ids=[1]), timeout=10),
                 lambda: stub.Metrics(core_pb2.MetricsRequest(), timeout=10),
                 lambda: next(stub.Outputs(core_pb2.OutputsRequest(frontend="x"), timeout=10))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out += [int(c) for c in children]
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_front_ends_exit_with_the_core(tmp_path):
    with Deployment(MODEL, tmp_path, {"frontend_processes": 2}) as d:
        frontends = _children(d.scheduler.proc.pid)
        assert len(frontends) == 2
        with Client(d.address, timeout=60) as c:
            assert c.generate(PROMPTS[0], max_new_tokens=4).generated_tokens == 4
        os.kill(d.scheduler.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in frontends):
            assert time.monotonic() < deadline, "front ends outlived their core"
            time.sleep(0.1)


@pytest.mark.slow
def test_front_ends_exit_with_a_core_killed_before_they_connected(tmp_path):
    d = Deployment(MODEL, tmp_path, {"frontend_processes": 2})
    try:
        d.start_worker()
        d.start_scheduler(wait_ready=False)  # back once the front ends bound their ports
        frontends = _children(d.scheduler.proc.pid)
        assert len(frontends) == 2
        os.kill(d.scheduler.proc.pid, signal.SIGKILL)  # before they loaded the tokenizer
        deadline = time.monotonic() + 60
        while not all(_gone(p) for p in frontends):
            assert time.monotonic() < deadline, "front ends outlived their core, on its ports"
            time.sleep(0.1)
    finally:
        for p in frontends:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
        d.stop()


# --- RemoteCore on its own (a stub in place of the core) -----------------------------------

def _seq(sid: int) -> Sequence:
    return Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[1, 2, 3],
                    params=DecodingConfig(max_new_tokens=5, strategy=DecodingStrategy.GREEDY),
                    detokenizer=None, stops=None)


class _SlowCore:
    """Answers Submit only when told; records Cancel calls."""

    def __init__(self):
        self.answer = asyncio.Event()
        self.cancelled: list[int] = []

    async def Submit(self, request, metadata=None):
        await self.answer.wait()
        return core_pb2.SubmitResponse()

    async def Cancel(self, request, metadata=None):
        self.cancelled += request.sequence_ids
        return core_pb2.CancelResponse()


def test_a_client_gone_during_submit_is_cancelled_in_the_core_once_it_answers():
    async def go():
        core = RemoteCore("127.0.0.1:1", "", 0, max_queue=8)
        core._stub = stub = _SlowCore()
        seqs = [_seq(core.new_seq_id()), _seq(core.new_seq_id())]
        submit = asyncio.ensure_future(core.submit_all(seqs))
        await asyncio.sleep(0.05)
        submit.cancel()  # the client's deadline passed while the core had not answered
        with pytest.raises(asyncio.CancelledError):
            await submit
        assert core.seqs == {}  # else a draining front end waits for them in vain
        stub.answer.set()  # the core queued them after all
        for _ in range(100):
            await asyncio.sleep(0.01)
            if stub.cancelled:
                break
        assert stub.cancelled == [s.seq_id for s in seqs]
        await core.close()
    asyncio.run(go())


def test_a_front_end_with_no_sequences_does_not_refuse_by_a_stale_queue_length():
    async def go():
        core = RemoteCore("127.0.0.1:1", "", 0, max_queue=2)
        # Its last sequence ended while others' requests filled the queues; no message
        # comes to it after that, however soon they empty.
        core._apply(core_pb2.StepOutputs(waiting=2))
        core.check_room(1)
        core.seqs[1] = _seq(1)  # while it has sequences in the core, messages keep it current
        with pytest.raises(QueueFull):
            core.check_room(1)
        await core.close()
    asyncio.run(go())
