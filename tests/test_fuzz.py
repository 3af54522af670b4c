"""Fuzzing one running deployment with malformed and valid requests.

Malformed requests (empty input, a prompt past the context, max_new_tokens out of range,
invalid UTF-8 on the wire, NUL characters, unknown protobuf fields, NaN and infinite
numbers, out-of-range parameters, corrupt messages) get INVALID_ARGUMENT with a message
naming the problem, and messages over the 4 MiB limit get RESOURCE_EXHAUSTED. Valid greedy
requests, sent concurrently with the malformed ones, get exactly the tokens of
`model.generate` on the request alone. HTTP /invocations answers malformed bodies with 400
and a JSON error, never 500. At the end both processes are alive and SERVING.

Hypothesis runs derandomized (a fixed sequence of examples) so CI is stable; the test
counts what it sent and prints a summary (also written to fuzz-summary.json in the
pytest base temp directory), which docs/reliability.md quotes.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.deployment import Deployment
from bench.metrics import scrape
from bench.processes import health_status
from client.api import build_request, response_tokens
from seqserve.v1 import generate_pb2
from tests import reference
from tests.conftest import tiny_model

# Examples per property; each example is a batch of several requests (see COUNTS).
MIXED_EXAMPLES = 100  # x (5 valid + 9 malformed, one of each kind) gRPC requests
HTTP_EXAMPLES = 100  # x (4 malformed or random + 2 valid) HTTP requests, sent together
MAX_NEW = 8  # valid requests stay short so ~1,000 of them finish in a few minutes
CALL_TIMEOUT = 60.0  # every call has a deadline: a hang fails the test, it does not stall it
CONTEXT = 1024  # max_position_embeddings of the tiny llama
LIMIT = 4096  # the scheduler's default max_new_tokens_limit
VOCAB = 1000
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
COUNTS: Counter = Counter()  # what was sent, by kind, for the summary


# --- the deployment ----------------------------------------------------------------------

@dataclass
class Server:
    d: Deployment
    channel: grpc.Channel
    stream: object  # raw Generate: bytes in, GenerateResponse messages out
    unary: object  # raw GenerateUnary
    pool: ThreadPoolExecutor
    model_dir: str


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    # The reference model runs in this process next to the server processes; on a
    # 2-core machine two intra-op threads contend and make each generate ~15x slower.
    torch.set_num_threads(1)
    model_dir = tiny_model("llama")
    d = Deployment(model_dir, tmp_path_factory.mktemp("fuzz")).start()
    channel = grpc.insecure_channel(d.address, options=[
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20)])
    raw = dict(request_serializer=lambda b: b)
    s = Server(d, channel,
               channel.unary_stream("/seqserve.v1.Generation/Generate",
                                    response_deserializer=generate_pb2.GenerateResponse.FromString,
                                    **raw),
               channel.unary_unary("/seqserve.v1.Generation/GenerateUnary",
                                   response_deserializer=generate_pb2.GenerateReply.FromString,
                                   **raw),
               ThreadPoolExecutor(max_workers=14), str(model_dir))
    try:
        yield s
    finally:
        s.pool.shutdown(wait=True)
        channel.close()
        d.stop()
        torch.set_num_threads(threads)


@lru_cache(maxsize=None)
def tokenizer(model_dir: str):
    return reference.load(model_dir)[0]


@lru_cache(maxsize=None)
def greedy8(model_dir: str, prompt: str) -> tuple[int, ...]:
    """generate's greedy tokens for MAX_NEW steps; the first n are the n-token answer."""
    return tuple(reference.greedy(model_dir, prompt, MAX_NEW))


# --- protobuf wire format by hand (to send what a well-behaved client cannot) -------------

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def len_field(number: int, payload: bytes) -> bytes:
    return key(number, 2) + varint(len(payload)) + payload


def wire_value(wire_type: int, data: bytes) -> bytes:
    """Any value of a wire type: varint, fixed64, length-delimited, fixed32."""
    if wire_type == 0:
        return varint(int.from_bytes(data[:8].ljust(8, b"\0"), "little"))
    if wire_type == 1:
        return data[:8].ljust(8, b"\0")
    if wire_type == 5:
        return data[:4].ljust(4, b"\0")
    return varint(len(data)) + data


# --- cases -------------------------------------------------------------------------------

@dataclass
class Case:
    kind: str
    payload: bytes
    method: str  # "stream" or "unary"
    codes: tuple = ()  # expected status codes of a malformed request
    says: tuple = ()  # one of these must be in the error message
    # Valid requests: what the model sees and how the answer must look.
    prompt: str = ""
    n: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: tuple = ()
    request_id: str = ""

    @property
    def valid(self) -> bool:
        return not self.codes


INVALID = (grpc.StatusCode.INVALID_ARGUMENT,)
# Bytes that do not parse: the servicer parses in its handler (servicer.add_to_server), so
# they get INVALID_ARGUMENT naming the problem, not grpc's UNKNOWN.
UNPARSABLE = INVALID

TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
            min_size=1, max_size=24),
    st.lists(st.sampled_from(reference.WORDS), min_size=1, max_size=8).map(" ".join))
# Longer than a 16-token prefix-cache block, so repeated cached prompts hit the cache.
CACHED = ("", "", "",
          ("once upon a time the king of the castle by the river said héllo "
           "wörld to the dragon, "),
          "你好 世界 こんにちは Привет 🙂 🚀 € ≠ 42 2024 the batch split cache token model ")
STOPS = st.lists(st.one_of(st.sampled_from(["e", " the", "\n", "zqzq", "🙂", "a"]), TEXT),
                 max_size=3)
FLOAT_PARAMS = ("temperature", "top_p", "typical_p", "repetition_penalty", "penalty_alpha")


@st.composite
def valid_case(draw) -> Case:
    """A valid greedy request: random text, random parameters that greedy ignores."""
    inputs, cached = draw(TEXT), draw(st.sampled_from(CACHED))
    n = draw(st.integers(1, MAX_NEW))
    params = {"max_new_tokens": n}
    how = draw(st.sampled_from(["default", "greedy", "do_sample"]))
    if how == "greedy":
        params["decoding_strategy"] = "greedy"
    elif how == "do_sample":
        params["do_sample"] = False
    optional = {
        "temperature": st.floats(1e-3, 100), "top_k": st.integers(0, VOCAB),
        "top_p": st.floats(1e-3, 1), "typical_p": st.floats(1e-3, 1),
        "penalty_alpha": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1),
        "logprobs": st.integers(0, 5), "ignore_eos": st.booleans(),
        "repetition_penalty": st.just(1.0), "stop": STOPS}
    for name, values in optional.items():
        if draw(st.booleans()):
            params[name] = draw(values)
    rid = draw(st.one_of(st.just(""), st.text(max_size=16).filter(
        lambda s: "\x00" not in s and all(not 0xD800 <= ord(c) <= 0xDFFF for c in s))))
    payload = build_request(inputs, cached_prompt=cached, request_id=rid,
                            **params).SerializeToString()
    return Case("valid", payload, draw(st.sampled_from(["stream", "unary"])),
                prompt=cached + inputs, n=n, ignore_eos=params.get("ignore_eos", False),
                logprobs=params.get("logprobs"), stop=tuple(params.get("stop") or ()),
                request_id=rid)


def _malformed(kind, request_bytes, says, codes=INVALID):
    return st.sampled_from(["stream", "unary"]).map(
        lambda m: Case(kind, request_bytes, m, codes=codes, says=says))


@st.composite
def empty_input(draw):
    req = build_request("", cached_prompt=draw(st.sampled_from(CACHED)), max_new_tokens=2)
    return draw(_malformed("empty input", req.SerializeToString(), ("inputs is empty",)))


@lru_cache(maxsize=None)
def exact_prompt(model_dir: str, n_tokens: int) -> str:
    import random
    return reference.prompt_of_tokens(tokenizer(model_dir), n_tokens, random.Random(n_tokens))


@st.composite
def too_long(draw, model_dir):
    n = draw(st.integers(1, MAX_NEW))
    if draw(st.booleans()):  # exactly one token past the context
        prompt = exact_prompt(model_dir, CONTEXT - MAX_NEW + 1)
        n = MAX_NEW
        assert len(tokenizer(model_dir)(prompt).input_ids) + n == CONTEXT + 1
    else:
        prompt = "the king " * draw(st.integers(520, 2000))
    cached, inputs = ((prompt[:len(prompt) // 2], prompt[len(prompt) // 2:])
                      if draw(st.booleans()) else ("", prompt))
    req = build_request(inputs, cached_prompt=cached, max_new_tokens=n)
    return draw(_malformed("prompt past the context", req.SerializeToString(),
                           ("exceeds the model's context",)))


@st.composite
def bad_max_new_tokens(draw):
    n = draw(st.one_of(st.integers(-2**31, 0), st.integers(LIMIT + 1, 2**31 - 1)))
    req = build_request(draw(TEXT), max_new_tokens=n)
    return draw(_malformed("max_new_tokens out of range", req.SerializeToString(),
                           ("max_new_tokens must be in",)))


BAD_UTF8 = [b"\xff", b"\xfe\xfe", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82",
            b"\xf8\x88\x80\x80\x80", b"\xf4\x90\x80\x80", b"\x80"]


@st.composite
def invalid_utf8(draw):
    """A request built byte by byte with invalid UTF-8 in one of its string fields."""
    text = draw(TEXT).encode()
    pos = draw(st.integers(0, len(text)))
    bad = text[:pos] + draw(st.sampled_from(BAD_UTF8)) + text[pos:]
    where = draw(st.sampled_from(["inputs", "cached_prompt", "request_id",
                                  "decoding_strategy", "stop"]))
    fields = {1: b"hello", 2: b"", 4: b""}
    params = key(1, 0) + varint(2)  # max_new_tokens = 2
    if where == "inputs":
        fields[1] = bad
    elif where == "cached_prompt":
        fields[2] = bad
    elif where == "request_id":
        fields[4] = bad
    elif where == "decoding_strategy":
        params += len_field(2, bad)
    else:
        params += len_field(10, b"ok") + len_field(10, bad)
    payload = (len_field(1, fields[1]) + len_field(2, fields[2]) + len_field(3, params)
               + len_field(4, fields[4]))
    return draw(_malformed(f"invalid UTF-8 in {where}", payload, ("UTF-8",), UNPARSABLE))


@st.composite
def corrupt(draw):
    """Wire format that cannot parse: a length past the end, field number 0, a bad tag."""
    good = build_request(draw(TEXT) + "xyz", max_new_tokens=2).SerializeToString()
    how = draw(st.sampled_from(["truncated", "field zero", "end group", "varint overrun"]))
    if how == "truncated":  # cut inside the inputs field (tag, 1-byte length, text)
        payload = good[:draw(st.integers(2, 1 + good[1]))]
    elif how == "field zero":
        payload = good + key(0, 0) + varint(1)
    elif how == "end group":
        payload = good + key(7, 4)
    else:
        payload = good + key(9, 0) + b"\xff" * 11
    return draw(_malformed(f"corrupt message ({how})", payload,
                           ("GenerateRequest", "parsing", "corrupt"), UNPARSABLE))


@st.composite
def nul_bytes(draw):
    text = draw(TEXT)
    pos = draw(st.integers(0, len(text)))
    bad = text[:pos] + "\x00" + text[pos:]
    if draw(st.booleans()):
        req = build_request(bad, max_new_tokens=2)
    else:
        req = build_request("hello", cached_prompt=bad, max_new_tokens=2)
    return draw(_malformed("NUL character", req.SerializeToString(), ("NUL character",)))


@st.composite
def unknown_field(draw):
    """A valid request plus a field this server's proto does not have."""
    inputs = draw(TEXT)
    params = generate_pb2.DecodingParameters(max_new_tokens=2).SerializeToString()
    base = len_field(1, inputs.encode())
    wire_type = draw(st.sampled_from([0, 1, 2, 5]))
    value = wire_value(wire_type, draw(st.binary(max_size=12)))
    where = draw(st.sampled_from(["request", "parameters", "wrong wire type"]))
    if where == "request":
        number = draw(st.one_of(st.integers(5, 18999), st.integers(20000, 2**29 - 1)))
        payload = base + len_field(3, params) + key(number, wire_type) + value
    elif where == "parameters":
        number = draw(st.one_of(st.integers(14, 18999), st.integers(20000, 2**29 - 1)))
        payload = base + len_field(3, params + key(number, wire_type) + value)
    else:  # a known field with the wrong wire type parses as an unknown field
        number = draw(st.sampled_from([2, 4]))
        payload = base + len_field(3, params) + key(number, 0) + varint(7)
    return draw(_malformed(f"unknown field ({where})", payload,
                           ("fields this server does not know",)))


@st.composite
def non_finite(draw):
    name = draw(st.sampled_from(FLOAT_PARAMS))
    value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    strategy = draw(st.sampled_from(["greedy", "sample", "contrastive"]))
    req = build_request(draw(TEXT), max_new_tokens=2, decoding_strategy=strategy,
                        **{name: value})
    return draw(_malformed(f"non-finite {name}", req.SerializeToString(),
                           (f"{name} must be finite",)))


@st.composite
def out_of_range(draw):
    """One parameter out of its documented range, the rest valid or unset."""
    name, value = draw(st.one_of(
        st.tuples(st.just("temperature"), st.floats(max_value=0, allow_nan=False,
                                                    allow_infinity=False)),
        st.tuples(st.just("top_p"), st.floats(allow_nan=False, allow_infinity=False).filter(
            lambda v: not 0 < v <= 1)),
        st.tuples(st.just("typical_p"), st.floats(allow_nan=False, allow_infinity=False).filter(
            lambda v: not 0 < v <= 1)),
        st.tuples(st.just("repetition_penalty"), st.floats(max_value=0, allow_nan=False,
                                                           allow_infinity=False)),
        st.tuples(st.just("penalty_alpha"), st.floats(allow_nan=False, allow_infinity=False)
                  .filter(lambda v: not 0 <= v <= 1)),
        st.tuples(st.just("top_k"), st.one_of(st.integers(-2**31, -1),
                                               st.integers(VOCAB + 1, 2**31 - 1))),
        st.tuples(st.just("logprobs"), st.one_of(st.integers(-2**31, -1),
                                                  st.integers(6, 2**31 - 1))),
        st.tuples(st.just("seed"), st.integers(-2**63, -1)),
        st.tuples(st.just("decoding_strategy"), st.text(max_size=12).filter(
            lambda s: s not in ("greedy", "sample", "contrastive") and "\x00" not in s
            and all(not 0xD800 <= ord(c) <= 0xDFFF for c in s))),
        st.tuples(st.just("stop"), st.one_of(
            st.lists(st.just("x"), min_size=9, max_size=20),
            st.just([""]), st.integers(257, 600).map(lambda k: ["s" * k]))),
    ))
    params = {name: value, "max_new_tokens": 2}
    if name == "top_k" and draw(st.booleans()):
        params["decoding_strategy"] = "contrastive"
    req = build_request(draw(TEXT), **params)
    return draw(_malformed(f"{name} out of range", req.SerializeToString(),
                           ("stop",) if name == "stop" else (name,)))


def malformed_cases(model_dir):
    """One malformed request of every kind (hypothesis' one_of favours its first branch)."""
    return st.tuples(empty_input(), too_long(model_dir), bad_max_new_tokens(), invalid_utf8(),
                     corrupt(), nul_bytes(), unknown_field(), non_finite(),
                     out_of_range()).map(list)


# --- running and checking ----------------------------------------------------------------

@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (logprob or None, number of top)
    text: str = ""
    finish: int = 0
    usage: object = None
    request_ids: set = field(default_factory=set)


def run_case(s: Server, case: Case) -> Outcome:
    try:
        if case.method == "stream":
            msgs = list(s.stream(case.payload, timeout=CALL_TIMEOUT))
            toks = [t for m in msgs for t in response_tokens(m)]
            last = msgs[-1]
            out = Outcome(grpc.StatusCode.OK, text="".join(m.text for m in msgs),
                          finish=last.finish_reason, usage=last.usage,
                          request_ids={m.request_id for m in msgs})
        else:
            reply = s.unary(case.payload, timeout=CALL_TIMEOUT)
            toks = list(reply.tokens)
            out = Outcome(grpc.StatusCode.OK, text=reply.generated_text,
                          finish=reply.finish_reason, usage=reply.usage,
                          request_ids={reply.request_id})
        out.token_ids = [t.id for t in toks]
        out.logprobs = [(t.logprob if t.HasField("logprob") else None, len(t.top_logprobs))
                        for t in toks]
        return out
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")


def check(s: Server, case: Case, got: Outcome) -> None:
    COUNTS["grpc valid" if case.valid else "grpc malformed"] += 1
    if not case.valid:
        COUNTS[f"grpc {case.kind}"] += 1
    if not case.valid:
        assert got.code in case.codes, (case.kind, got.code, got.details)
        assert any(w in got.details for w in case.says), (case.kind, got.details)
        return
    assert got.code == grpc.StatusCode.OK, (case.prompt, got.code, got.details)
    eos = tokenizer(s.model_dir).eos_token_id
    ref = list(greedy8(s.model_dir, case.prompt))[: case.n]
    ids = got.token_ids
    finish = generate_pb2.FinishReason.Name(got.finish)
    if finish == "FINISH_REASON_STOP":
        assert case.stop
        assert ids[: len(ref)] == ref[: len(ids)], (case.prompt, ids, ref)
    elif case.ignore_eos:
        assert finish == "FINISH_REASON_LENGTH" and len(ids) == case.n
        assert reference.same_until_eos(ids, ref, eos), (case.prompt, ids, ref)
    else:
        assert ids == ref, (case.prompt, ids, ref)
        assert finish == ("FINISH_REASON_EOS" if len(ids) < case.n else "FINISH_REASON_LENGTH")
    assert got.usage.generated_tokens == len(ids)
    assert got.usage.prompt_tokens == len(tokenizer(s.model_dir)(case.prompt).input_ids)
    if case.logprobs is None:
        assert all(lp is None for lp, _ in got.logprobs)
    else:
        assert all(lp is not None and lp <= 0 and k == case.logprobs for lp, k in got.logprobs)
    assert not any(stop in got.text for stop in case.stop)
    if case.request_id:
        assert got.request_ids == {case.request_id}
    else:
        assert len(got.request_ids) == 1 and "" not in got.request_ids


def interleaved(first, second):
    """Two lists of cases, concatenated and shuffled (hypothesis draws the order)."""
    return st.tuples(first, second).flatmap(lambda t: st.permutations(t[0] + t[1]))


def test_grpc_mixed_malformed_and_valid_requests(server):
    """Batches of 14 requests, 5 valid (greedy, checked against generate) and one
    malformed request of each of 9 kinds, sent concurrently so malformed requests arrive
    while valid ones are running."""
    sent = COUNTS["grpc valid"] + COUNTS["grpc malformed"]

    @settings(FUZZ, max_examples=MIXED_EXAMPLES)
    @given(interleaved(st.lists(valid_case(), min_size=5, max_size=5),
                       malformed_cases(server.model_dir)))
    def batch(cases):
        outcomes = list(server.pool.map(lambda c: run_case(server, c), cases))
        for case, got in zip(cases, outcomes):
            check(server, case, got)

    batch()
    assert COUNTS["grpc valid"] + COUNTS["grpc malformed"] - sent >= 14 * MIXED_EXAMPLES, COUNTS


def test_messages_over_the_size_limit(server):
    """5 MiB requests are refused by grpc (max receive 4 MiB); the server keeps serving.
    A prompt just under the limit is read, tokenized and refused as past the context."""
    big = "a" * (5 << 20)
    for method, req in (("stream", build_request(big, max_new_tokens=2)),
                        ("unary", build_request(big, max_new_tokens=2)),
                        ("unary", build_request("hi", cached_prompt=big, max_new_tokens=2)),
                        ("stream", build_request("hi", stop=[big[:200]] * 8, request_id=big))):
        got = run_case(server, Case("oversize", req.SerializeToString(), method,
                                    codes=(grpc.StatusCode.RESOURCE_EXHAUSTED,)))
        assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (got.code, got.details)
        assert "larger than max" in got.details
        COUNTS["grpc oversize (5 MiB)"] += 1
    # Just under 4 MiB: refused as past the context (before tokenizing); a small request
    # sent at the same time is still answered.
    near = build_request("the king " * ((4 << 20) // 9 - 100), max_new_tokens=2)
    small = Case("valid", build_request("hello", max_new_tokens=4).SerializeToString(),
                 "unary", prompt="hello", n=4)
    slow = server.pool.submit(run_case, server, Case("near", near.SerializeToString(), "unary"))
    time.sleep(0.2)
    t0 = time.monotonic()
    answer = run_case(server, small)
    small_s = time.monotonic() - t0
    check(server, small, answer)
    got = slow.result()
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT and "context" in got.details
    assert small_s < 10, f"a small request waited {small_s:.1f} s behind a 4 MiB prompt"
    COUNTS["grpc malformed"] += 1
    COUNTS["grpc prompt just under 4 MiB"] += 1


def test_poison_parameters_fail_alone(server):
    """Sampling parameters that pass validation but give the worker NaN probabilities
    (temperature 1e-300 is 0 in float32) must not stall or fail other requests."""
    poison = [build_request("the king", max_new_tokens=4, decoding_strategy="sample",
                            seed=1, temperature=1e-300),
              build_request("dragon", max_new_tokens=4, decoding_strategy="sample",
                            seed=2, repetition_penalty=1e-300)]
    innocent = [Case("valid", build_request(p, max_new_tokens=6).SerializeToString(), m,
                     prompt=p, n=6)
                for p, m in (("once upon", "stream"), ("a castle", "unary"),
                             ("the river", "stream"), ("héllo wörld", "unary"))]
    t0 = time.monotonic()
    futures = [server.pool.submit(run_case, server, Case("poison", r.SerializeToString(),
                                                        "stream")) for r in poison]
    time.sleep(0.05)
    for case, got in zip(innocent, server.pool.map(lambda c: run_case(server, c), innocent)):
        check(server, case, got)
    for f in futures:
        got = f.result()
        # A worker that guards its sampler answers tokens; one that raises gets the
        # request failed after a few attempts, never retried forever.
        assert got.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), got
        if got.code != grpc.StatusCode.OK:
            assert "generation failed" in got.details
        COUNTS["grpc poison parameters"] += 1
    assert time.monotonic() - t0 < 30


# --- HTTP /invocations ------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(),
                      st.integers(10**18, 10**400), st.floats(), st.text(max_size=16))
JSON = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
PARAM_NAMES = ("max_new_tokens", "decoding_strategy", "do_sample", "temperature", "top_k",
               "top_p", "typical_p", "repetition_penalty", "seed", "stop", "ignore_eos",
               "penalty_alpha", "logprobs")


def _not_long(v) -> bool:
    """Junk must not ask for a long generation (it is junk, not a benchmark)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return True
    return (isinstance(v, float) and not math.isfinite(v)) or not MAX_NEW < v <= LIMIT


@st.composite
def junk_object(draw) -> bytes:
    body = draw(st.dictionaries(st.sampled_from(["inputs", "parameters", "cached_prompt",
                                                 "stream", "request_id", "input", "params"]),
                                JSON, max_size=5))
    if draw(st.booleans()):
        body["inputs"] = draw(st.one_of(TEXT, st.lists(TEXT, max_size=3), JSON))
    params = draw(st.dictionaries(st.one_of(st.sampled_from(PARAM_NAMES), st.text(max_size=8)),
                                  JSON, max_size=4))
    params["max_new_tokens"] = draw(st.one_of(st.integers(-5, MAX_NEW), JSON.filter(_not_long)))
    body["parameters"] = draw(st.one_of(st.just(params), JSON.filter(
        lambda v: not isinstance(v, dict))))
    return json.dumps(body).encode()


RAW_JUNK = st.one_of(
    st.binary(max_size=64),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 200000).map(lambda k: b"[" * k + b"]" * (k // 2)),
    st.integers(1, 200000).map(lambda k: b'{"inputs": ' + b"[" * k),
    st.integers(300, 5000).map(lambda k: b'{"inputs": "hi", "parameters": {"seed": 1'
                               + b"0" * k + b"}}"),
    st.sampled_from([b"", b"NaN", b"null", b'{"inputs": NaN}', b'{"inputs": "hi"',
                     b'{"inputs": "hi", "parameters": {"temperature": NaN, "do_sample": true}}',
                     b'{"inputs": "hi", "parameters": {"max_new_tokens": 1e400}}',
                     b'{"inputs": "hi", "parameters": {"max_new_tokens": -Infinity}}',
                     b'{"inputs": "\xff\xfe"}', b'\xef\xbb\xbf{"inputs": "hi"}',
                     b'{"inputs": "\\ud800", "parameters": {"max_new_tokens": 2}}',
                     b'{"inputs": "a\\u0000b", "parameters": {"max_new_tokens": 2}}',
                     b'{"inputs": ["a", 1], "parameters": {"max_new_tokens": 2}}',
                     b'{"inputs": [], "parameters": {"max_new_tokens": 2}}',
                     b'{"inputs": "hi", "stream": "yes"}']))


@st.composite
def http_valid(draw) -> tuple[bytes, list[str], int, bool]:
    single = draw(st.booleans())
    inputs = draw(TEXT) if single else draw(st.lists(TEXT, min_size=1, max_size=3))
    n = draw(st.integers(1, MAX_NEW))
    params = {"max_new_tokens": n}
    if draw(st.booleans()):
        params["decoding_strategy"] = "greedy"
    if draw(st.booleans()):
        params["logprobs"] = draw(st.integers(0, 5))
    stream = single and draw(st.booleans())
    body = {"inputs": inputs, "parameters": params, "stream": stream}
    if draw(st.booleans()):
        body["request_id"] = draw(st.text(max_size=8))
    return json.dumps(body).encode(), [inputs] if single else inputs, n, stream


def post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def check_http_junk(body: bytes, status: int, answer: bytes) -> None:
    COUNTS["http malformed or random"] += 1
    assert status in (200, 400), (status, body[:200], answer[:300])
    if status == 400:
        err = json.loads(answer)
        assert err["code"] == 400 and isinstance(err["error"], str) and err["error"]
        COUNTS["http 400"] += 1
    else:
        COUNTS["http random body accepted"] += 1


def check_http_valid(s: Server, case, status: int, answer: bytes) -> None:
    body, prompts, n, stream = case
    COUNTS["http valid"] += 1
    assert status == 200, (body, status, answer[:300])
    refs = [list(greedy8(s.model_dir, p))[:n] for p in prompts]
    if stream:
        lines = [json.loads(x) for x in answer.decode().splitlines()]
        ids = [x["token"]["id"] for x in lines if "token" in x]
        assert ids == refs[0], (prompts, ids, refs)
        assert lines[-1]["details"]["generated_tokens"] == len(ids)
        return
    got = json.loads(answer)
    items = [got] if isinstance(json.loads(body)["inputs"], str) else got
    assert len(items) == len(prompts)
    for item, ref in zip(items, refs):
        assert isinstance(item["generated_text"], str)
        assert item["details"]["generated_tokens"] == len(ref)
        assert item["details"]["finish_reason"] == ("eos" if len(ref) < n else "length")


def test_http_invocations_fuzz(server):
    """Malformed and random bodies get 400 with a JSON error (never 500); valid get 200."""
    url = server.d.http_url + "/invocations"
    junk = st.one_of(junk_object(), RAW_JUNK).map(lambda b: ("junk", b))
    valid = http_valid().map(lambda c: ("valid", c))

    @settings(FUZZ, max_examples=HTTP_EXAMPLES)
    @given(interleaved(st.lists(valid, min_size=2, max_size=2),
                       st.lists(junk, min_size=4, max_size=4)))
    def batch(cases):
        bodies = [c if kind == "junk" else c[0] for kind, c in cases]
        answers = list(server.pool.map(lambda b: post(url, b), bodies))
        for (kind, c), (status, answer) in zip(cases, answers):
            if kind == "junk":
                check_http_junk(c, status, answer)
            else:
                check_http_valid(server, c, status, answer)

    batch()
    status, answer = post(url, b'{"inputs": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413, (status, answer[:200])  # aiohttp's client_max_size (4 MiB)
    COUNTS["http oversize (5 MiB)"] += 1
    assert COUNTS["http valid"] >= 2 * HTTP_EXAMPLES and COUNTS["http 400"] >= HTTP_EXAMPLES


# --- the loop's recovery, with a worker that fails every Step naming one sequence ----------

def test_recovery_isolates_a_request_the_worker_cannot_run():
    """A Step that fails because of one sequence fails that sequence after a few tries;
    the sequences batched with it are re-prefilled apart from it and finish normally."""
    from scheduler_service.loop import IterationLoop
    from scheduler_service.metrics import SchedulerMetrics
    from scheduler_service.sequence import FinishReason
    from scheduler_service.worker_client import StepAnswer, StepFailed, StepToken, WorkerInfo
    from tests.loop_driver import greedy_sequence, run_to_the_end

    tok = tokenizer(str(tiny_model("llama")))
    info = WorkerInfo("fake", "FakeForCausalLM", vocab_size=VOCAB, eos_token_ids=frozenset([0]),
                      max_position_embeddings=CONTEXT, dtype="float32", device="cpu",
                      kv_capacity_tokens=10000)

    class FailingStream:
        """The Steps stream of a worker that fails any Step holding the poisoned sequence;
        like the real one, a failure ends the stream and voids the Steps sent after it."""

        def __init__(self, worker):
            self.worker, self.sent, self.broken = worker, [], False

        async def send(self, step_id, plan):
            if self.broken:
                raise StepFailed("CANCELLED", "the stream ended")
            self.sent.append((step_id, plan))

        async def receive(self):
            await asyncio.sleep(0)
            step_id, plan = self.sent.pop(0)
            self.worker.steps += 1
            live = {i for g in plan.groups for i in g}
            if self.worker.poison in live:
                self.worker.failed += 1
                self.broken = True
                raise StepFailed("UNKNOWN", "probability tensor has nan")
            return StepAnswer(step_id, [StepToken(i, 5, cached_tokens=0) for i in sorted(live)],
                              worker_seconds=0.0)

        def close(self):
            self.broken = True

    class FailingWorker:
        address = "fake-worker"

        def __init__(self, poison: int):
            self.info, self.poison, self.steps, self.failed = info, poison, 0, 0

        def open_steps(self):
            return FailingStream(self)

        async def wait_ready(self, timeout):
            return self.info

    async def scenario():
        worker = FailingWorker(poison=3)
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16, max_sparsity=0.5,
                             max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=4096, steps_in_flight=2)
        seqs = [greedy_sequence(loop, tok, f"request number {i}", 5) for i in range(6)]
        task, ends = await run_to_the_end(loop, seqs)
        loop.stop()
        await task
        return worker, seqs, ends

    worker, seqs, ends = asyncio.run(scenario())
    for s, ev in zip(seqs, ends):
        if s.seq_id == 3:
            assert ev.reason == FinishReason.ERROR and "generation failed" in ev.error
        else:
            assert ev.reason == FinishReason.LENGTH and s.output_ids == [5] * 5
    assert worker.failed == 3 and worker.steps < 40


def test_grpc_api_parses_requests_itself():
    """grpc_api.add_to_server registers the Generation service with the request parsed in
    the handler: bytes that do not parse get INVALID_ARGUMENT naming the problem (grpc's
    own parsing answers UNKNOWN), and parsable ones go on to the usual checks."""
    from scheduler_service.frontend import Frontend
    from scheduler_service.grpc_api import GenerationServicer, add_to_server

    async def scenario():
        server = grpc.aio.server()
        # No serving state: "starting" after parsing.
        add_to_server(GenerationServicer(Frontend(lambda code: None)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = ch.unary_stream("/seqserve.v1.Generation/Generate",
                                     request_serializer=lambda b: b)
            unary = ch.unary_unary("/seqserve.v1.Generation/GenerateUnary",
                                   request_serializer=lambda b: b)
            info = ch.unary_unary("/seqserve.v1.Generation/ModelInfo",
                                  request_serializer=lambda b: b)
            for call, payload in ((stream, len_field(1, b"\xff\xfe")),
                                  (unary, len_field(1, b"ok") + len_field(4, b"\xc3")),
                                  (unary, b"\x0a\x05ab"),
                                  (stream, build_request("hello").SerializeToString()),
                                  (info, b"")):
                try:
                    resp = call(payload, timeout=10)
                    if call is stream:
                        async for _ in resp:
                            pass
                    else:
                        await resp
                    out.append(("OK", ""))
                except grpc.aio.AioRpcError as err:
                    out.append((err.code(), err.details()))
        await server.stop(0)
        return out

    bad_utf8, bad_utf8_id, truncated, good, info = asyncio.run(scenario())
    for code, details in (bad_utf8, bad_utf8_id, truncated):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "not a valid seqserve.v1.GenerateRequest" in details
    assert "UTF-8" in bad_utf8[1] and "UTF-8" in bad_utf8_id[1]
    assert good[0] == grpc.StatusCode.UNAVAILABLE and "starting" in good[1]
    assert info[0] == grpc.StatusCode.UNAVAILABLE


# --- at the end: nothing broke -----------------------------------------------------------

def test_server_survived(server, tmp_path_factory):
    d = server.d
    assert d.scheduler.proc.poll() is None and d.worker.proc.poll() is None
    assert health_status(d.address) == "SERVING"
    assert health_status(f"127.0.0.1:{d.worker.ports['grpc']}") == "SERVING"
    case = Case("valid", build_request("the dragon", max_new_tokens=8).SerializeToString(),
                "stream", prompt="the dragon", n=8)
    check(server, case, run_case(server, case))
    m = scrape(d.metrics_url)
    assert m["seqserve_num_requests_running"] == 0
    assert m["seqserve_num_requests_waiting"] == 0
    log = d.scheduler.log.read_text()
    assert "Error handling request" not in log  # aiohttp's line for an HTTP 500
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert not errors, errors[:3]
    total = sum(v for k, v in COUNTS.items()
                if k in ("grpc valid", "grpc malformed", "http valid",
                         "http malformed or random", "grpc oversize (5 MiB)",
                         "http oversize (5 MiB)", "grpc poison parameters"))
    summary = {"requests": total, **dict(sorted(COUNTS.items()))}
    (tmp_path_factory.getbasetemp() / "fuzz-summary.json").write_text(
        json.dumps(summary, indent=1))
    print("\nfuzz summary:", json.dumps(summary, indent=1))
    if COUNTS["grpc valid"] and COUNTS["http valid"]:  # the whole module ran
        assert total >= 1000, summary
