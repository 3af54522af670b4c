"""The OpenAI-compatible API (scheduler_service/openai_api.py) over real processes, driven by
the official `openai` client (sync and async, streamed and not) and by raw HTTP for the
bodies no client sends; and `seqserve chat`, run as a subprocess.

Two deployments serve the module: `server`, the tiny random-weight Llama whose tokenizer has
no chat template, and `chat_server`, a copy of it with a small Jinja chat template, a
served_model_name and a bearer token."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from bench.deployment import Deployment
from bench.metrics import scrape
from client import Client
from tests.conftest import LONG_CONTEXT, long_context_model, tiny_model

REPO = Path(__file__).resolve().parents[1]
TOKEN = "openai-test-token"
CHAT_NAME = "tiny-chat"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "Once upon a time"
FINISHED = "seqserve_requests_finished_total{reason=%s}"
RUNNING = "seqserve_num_requests_running"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = Deployment(tiny_model("llama"), tmp_path_factory.mktemp("openai"), {"openai_port": 0})
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("chat-model") / "tiny-llama-chat"
    shutil.copytree(tiny_model("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def chat_server(chat_model, tmp_path_factory):
    d = Deployment(chat_model, tmp_path_factory.mktemp("openai-chat"),
                   {"openai_port": 0, "served_model_name": CHAT_NAME, "auth_token": TOKEN})
    d.start()
    try:
        yield d
    finally:
        d.stop()


def base_url(d: Deployment) -> str:
    return f"http://127.0.0.1:{d.scheduler.ports['openai']}/v1"


def model_name(d: Deployment) -> str:
    return d.options.get("served_model_name") or str(d.model_dir)


def sync_client(d: Deployment, **kw) -> openai.OpenAI:
    kw.setdefault("timeout", 120)
    return openai.OpenAI(base_url=base_url(d), api_key=d.options.get("auth_token", "none"),
                         max_retries=0, **kw)


def async_client(d: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(d), api_key=d.options.get("auth_token", "none"),
                              max_retries=0, timeout=120)


def http(d: Deployment, path: str, body: bytes | dict | None = None, token: str | None = None,
         method: str | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a raw request to the OpenAI port."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    url = f"http://127.0.0.1:{d.scheduler.ports['openai']}{path}"
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_error(answer: dict, param: str | None = None, words: str = "") -> None:
    """OpenAI's error object, naming `param`, its message containing `words`."""
    assert set(answer) == {"error"}, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err


def metric(d: Deployment, name: str) -> float:
    return scrape(d.metrics_url).get(name, 0.0)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_still_serving(d: Deployment) -> None:
    reply = sync_client(d).completions.create(model=model_name(d), prompt=PROMPT, max_tokens=2)
    assert reply.usage.completion_tokens >= 1


# --- models, health ----------------------------------------------------------------------

def test_models_and_health(server, chat_server):
    models = sync_client(server).models.list()
    assert [m.id for m in models.data] == [str(server.model_dir)]
    assert models.data[0].object == "model"
    assert [m.id for m in sync_client(chat_server).models.list().data] == [CHAT_NAME]
    assert sync_client(chat_server).models.retrieve(CHAT_NAME).id == CHAT_NAME
    assert http(server, "/health") == (200, {"status": "ok"})
    status, answer = http(server, "/v1/models/nope")
    assert status == 404
    assert_error(answer, "model", "does not exist")


def test_unknown_model_is_404_and_both_names_are_accepted(chat_server):
    c = sync_client(chat_server)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 404
    assert_error({"error": err.value.body}, "model", "gpt-4")
    for name in (CHAT_NAME, str(chat_server.model_dir)):
        assert c.completions.create(model=name, prompt=PROMPT, max_tokens=2).choices
    status, answer = http(chat_server, "/v1/nothing", {}, token=TOKEN)
    assert status == 404
    assert_error(answer, None, "/v1/nothing")


# --- completions --------------------------------------------------------------------------

def test_greedy_completion_equals_grpc_and_djl(server):
    c = sync_client(server)
    reply = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=12,
                                 temperature=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    with Client(server.address, timeout=60) as g:
        grpc_reply = g.generate(PROMPT, max_new_tokens=12, decoding_strategy="greedy",
                                ignore_eos=True)
    status, djl = 0, None
    req = urllib.request.Request(server.http_url + "/invocations", data=json.dumps(
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "ignore_eos": True,
                                          "decoding_strategy": "greedy"}}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        status, djl = r.status, json.loads(r.read())
    assert status == 200
    assert choice.text == grpc_reply.text == djl["generated_text"]
    assert choice.finish_reason == "length" and choice.index == 0
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.model == model_name(server)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        grpc_reply.prompt_tokens, grpc_reply.generated_tokens) == (grpc_reply.prompt_tokens, 12)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    # Streamed, the chunks add up to the same text and end with the same reason.
    chunks = list(c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    # One chunk per token, also for a token that completes no character yet (the random
    # model's byte tokens often do not): clients time TTFT and TPOT by chunks.
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]) >= 11
    assert all(ch.usage is None for ch in chunks)


def test_prompt_forms(server):
    c = sync_client(server)
    ids = AutoTokenizer.from_pretrained(server.model_dir)(PROMPT).input_ids
    text = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=6,
                                temperature=0).choices[0].text
    by_ids = c.completions.create(model=model_name(server), prompt=ids, max_tokens=6,
                                  temperature=0)
    assert by_ids.choices[0].text == text
    other = c.completions.create(model=model_name(server), prompt="Hello there", max_tokens=6,
                                 temperature=0).choices[0].text
    both = c.completions.create(model=model_name(server), prompt=[PROMPT, "Hello there"],
                                max_tokens=6, temperature=0)
    assert [(ch.index, ch.text) for ch in both.choices] == [(0, text), (1, other)]
    assert both.usage.completion_tokens == 12
    as_lists = c.completions.create(model=model_name(server), prompt=[ids, ids], max_tokens=6,
                                    temperature=0)
    assert [ch.text for ch in as_lists.choices] == [text, text]
    assert as_lists.usage.prompt_tokens == 2 * len(ids)


def test_n_choices_sampling_and_seed_reproduces(server):
    c = sync_client(server)

    def texts(seed: int, **kw) -> list[str]:
        reply = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=10,
                                     temperature=1.0, seed=seed, n=2, **kw)
        assert [ch.index for ch in reply.choices] == [0, 1]
        # n choices of one prompt: its tokens are counted once.
        assert reply.usage.prompt_tokens == len(
            AutoTokenizer.from_pretrained(server.model_dir)(PROMPT).input_ids)
        return [ch.text for ch in reply.choices]

    first = texts(11)
    assert first[0] != first[1], "two choices of a sampled request came out the same"
    assert texts(11) == first, "the same seed did not reproduce the text"
    assert texts(12) != first
    streamed = list(c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=10,
                                         temperature=1.0, seed=11, n=2, stream=True))
    joined = ["".join(ch.choices[0].text for ch in streamed if ch.choices[0].index == i)
              for i in (0, 1)]
    assert joined == first


def test_stop_strings(server):
    c = sync_client(server)
    full = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=20,
                                temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    start = next(k for k in range(3, len(full) - 3)
                 if "\ufffd" not in full[k:k + 3] and full[k:k + 3].strip())
    stop = full[start:start + 3]
    expected = full[:full.find(stop)]
    for stops in (stop, [stop, "never-generated-zzz"]):
        reply = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=20,
                                     temperature=0, stop=stops)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "stop")
    chunks = list(c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=20,
                                       temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_match_grpc(server):
    c = sync_client(server)
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    reply = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=6,
                                 temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    with Client(server.address, timeout=60) as g:
        ref = g.generate(PROMPT, max_new_tokens=6, ignore_eos=True, logprobs=2)
    assert lp.tokens == [tok.decode([i]) for i in ref.token_ids]
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert len(lp.top_logprobs) == 6
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Streamed: each chunk carries its token's logprobs.
    chunks = list(c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=6,
                                       temperature=0, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    none = c.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_async_stream_with_usage_last(server):
    async def run():
        async with async_client(server) as c:
            stream = await c.completions.create(
                model=model_name(server), prompt=[PROMPT, "Hello"], max_tokens=5, n=2,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            chunks = [ch async for ch in stream]
            plain = await c.completions.create(model=model_name(server), prompt=PROMPT,
                                               max_tokens=5, temperature=0)
            return chunks, plain

    chunks, plain = asyncio.run(run())
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 4 * 5
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens + len(
        AutoTokenizer.from_pretrained(server.model_dir)("Hello").input_ids)
    assert all(ch.usage is None for ch in chunks[:-1])
    finishes = {ch.choices[0].index: ch.choices[0].finish_reason
                for ch in chunks[:-1] if ch.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert "".join(ch.choices[0].text for ch in chunks[:-1] if ch.choices[0].index == 0) == \
        plain.choices[0].text


# --- chat ---------------------------------------------------------------------------------

def test_chat_needs_a_chat_template(server):
    with pytest.raises(openai.BadRequestError) as err:
        sync_client(server).chat.completions.create(
            model=model_name(server), messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400
    assert_error({"error": err.value.body}, "messages", "no chat template")
    assert_still_serving(server)


def test_chat_renders_the_template(chat_server, chat_model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me a story."}]
    ids = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    c = sync_client(chat_server)
    reference = c.completions.create(model=CHAT_NAME, prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    reply = c.chat.completions.create(model=CHAT_NAME, messages=messages, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.choices[0].text
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 8
    # Content as a list of text parts; max_completion_tokens over max_tokens.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                                         {"type": "text", "text": "a story."}]}]
    joined = [messages[0], {"role": "user", "content": "Tell me \na story."}]
    a = c.chat.completions.create(model=CHAT_NAME, messages=parts, max_completion_tokens=5,
                                  max_tokens=50, temperature=0)
    b = c.chat.completions.create(model=CHAT_NAME, messages=joined, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 5


def test_chat_async_stream_n_and_logprobs(chat_server):
    messages = [{"role": "user", "content": "Hello"}]

    async def run():
        async with async_client(chat_server) as c:
            stream = await c.chat.completions.create(
                model=CHAT_NAME, messages=messages, max_tokens=6, n=2, temperature=0.8,
                seed=5, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            chunks = [ch async for ch in stream]
            whole = await c.chat.completions.create(
                model=CHAT_NAME, messages=messages, max_tokens=6, n=2, temperature=0.8, seed=5,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
            return chunks, whole

    chunks, whole = asyncio.run(run())
    assert chunks[0].object == "chat.completion.chunk"
    roles = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role}
    assert roles == {0, 1}
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks
                     if ch.choices and ch.choices[0].index == i) for i in (0, 1)]
    assert texts == [ch.message.content for ch in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    for choice in whole.choices:
        content = choice.logprobs.content
        assert len(content) == whole.usage.completion_tokens // 2
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.bytes == list(entry.token.encode())


# --- errors -------------------------------------------------------------------------------

def _ids(n: int) -> list[int]:
    return [5] * n


BAD_COMPLETIONS = [
    (b'{"prompt": "x", ', None, "not valid JSON"),
    (b'["prompt"]', None, "JSON object"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"prompt": 5}, "prompt", "prompt must be"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({}, "prompt", "required"),
    ({"prompt": "x", "n": 100}, "n", "16"),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than"),
    ({"prompt": "x", "top_p": 2}, "top_p", "top_p"),
    ({"prompt": "x", "logprobs": 6}, "logprobs", "5"),
    ({"prompt": "x", "stop": [1]}, "stop[0]", "stop must be"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"prompt": "x", "presence_penalty": -1}, "presence_penalty", "not supported"),
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"prompt": "x", "foo": 1}, "foo", "unknown field"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "x", "decoding_strategy": "beams"}, "decoding_strategy", "decoding_strategy"),
    ({"prompt": _ids(1100), "max_tokens": 1}, "prompt", "context"),
    ({"prompt": "x", "max_tokens": 2000}, "max_tokens", "max_tokens"),
    ({"prompt": [10 ** 6]}, "prompt", "vocabulary"),
    ({"prompt": "a\u0000b"}, "prompt", "NUL"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be in"),
    ({"prompt": "x", "temperature": 0, "decoding_strategy": "sample"}, "temperature", "greedy"),
]


@pytest.mark.parametrize("body,param,words", BAD_COMPLETIONS,
                         ids=[str(b)[:40] for b, _, _ in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(server, body, param, words):
    status, answer = http(server, "/v1/completions", body)
    assert status == 400, answer
    assert_error(answer, param, words)
    assert answer["error"]["type"] == "invalid_request_error"


def test_http_errors_have_the_openai_shape(server):
    status, answer = http(server, "/v1/completions",
                          b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413
    assert_error(answer, None, "exceeds the limit")
    status, answer = http(server, "/v1/completions", method="GET")
    assert status == 405
    assert_error(answer, None, "GET /v1/completions")
    assert answer["error"]["type"] == "invalid_request_error"


def test_bad_requests_leave_the_server_serving(server):
    for body, _, _ in BAD_COMPLETIONS:
        http(server, "/v1/completions", body)
    assert_still_serving(server)


def test_defaults_and_extras_are_accepted(server):
    ok = {"prompt": "x", "max_tokens": 3, "frequency_penalty": 0, "presence_penalty": 0.0,
          "echo": False, "best_of": 1, "logit_bias": {}, "user": "u", "top_k": 5,
          "penalty_alpha": 0.5, "decoding_strategy": "sample", "repetition_penalty": 1.1,
          "ignore_eos": True, "typical_p": 0.9, "cached_prompt": "Some cached text. ",
          "seed": 1, "top_p": 0.9, "model": model_name(server)}
    status, answer = http(server, "/v1/completions", ok)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 3


BAD_CHATS = [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "tool"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages[0].content[0].type", "image_url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0].type", "input_audio"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice",
     "tool calling"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions", "tool calling"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "not supported"),
    ({"messages": [{"role": "user", "content": "x " * 1100}]}, "messages", "context"),
]


@pytest.mark.parametrize("body,param,words", BAD_CHATS, ids=[str(b)[:50] for b, _, _ in BAD_CHATS])
def test_bad_chat_requests_are_400(chat_server, body, param, words):
    status, answer = http(chat_server, "/v1/chat/completions", body, token=TOKEN)
    assert status == 400, answer
    assert_error(answer, param, words)


def test_queue_full_is_429(server):
    status, answer = http(server, "/v1/completions",
                          {"prompt": ["a"] * 100, "n": 16, "max_tokens": 1})
    assert status == 429, answer
    assert_error(answer, None, "queue")
    with pytest.raises(openai.RateLimitError):
        sync_client(server).completions.create(model=model_name(server), prompt=["a"] * 2000,
                                               max_tokens=1)
    assert_still_serving(server)


def test_bearer_token(chat_server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for token, words in ((None, "missing"), ("wrong", "invalid")):
        status, answer = http(chat_server, "/v1/chat/completions", body, token=token)
        assert status == 401
        assert_error(answer, None, words)
        assert answer["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url(chat_server), api_key="wrong",
                      max_retries=0).models.list()
    assert http(chat_server, "/health")[0] == 200  # probes need no token
    assert http(chat_server, "/v1/chat/completions", body, token=TOKEN)[0] == 200


def test_no_worker_is_503(llama_dir, tmp_path):
    d = Deployment(llama_dir, tmp_path, {"openai_port": 0})
    try:
        # A worker port nothing listens on: the scheduler starts but never becomes ready.
        d.start_scheduler(worker_port=1, wait_ready=False)
        assert http(d, "/health") == (503, {"status": "unavailable"})
        status, answer = http(d, "/v1/completions", {"prompt": "x"})
        assert status == 503
        assert_error(answer, None, "not ready")
        assert answer["error"]["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError) as err:
            sync_client(d).completions.create(model=str(llama_dir), prompt="x")
        assert err.value.status_code == 503
    finally:
        d.stop()


# --- cancellation -------------------------------------------------------------------------

def test_disconnect_mid_stream_cancels_every_choice(server):
    before = metric(server, FINISHED % "cancelled")
    stream = sync_client(server).completions.create(
        model=model_name(server), prompt=PROMPT, max_tokens=1000, n=2, stream=True,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert wait_for(lambda: metric(server, RUNNING) == 2, 5)
    stream.close()
    assert wait_for(lambda: metric(server, RUNNING) == 0, 5), \
        "the sequences kept running after their client went away"
    assert metric(server, FINISHED % "cancelled") == before + 2


def test_client_timeout_cancels_a_non_streamed_request(chat_model, tmp_path):
    # A context longer than any machine decodes in the 1 s timeout below.
    model = tmp_path / "long-chat-model"
    shutil.copytree(chat_model, model)
    shutil.copy(long_context_model() / "config.json", model / "config.json")
    d = Deployment(model, tmp_path / "run", {"openai_port": 0,
                                             "served_model_name": CHAT_NAME,
                                             "max_new_tokens_limit": LONG_CONTEXT})
    d.start()
    try:
        before = metric(d, FINISHED % "cancelled")
        with pytest.raises(openai.APITimeoutError):
            sync_client(d, timeout=1.0).chat.completions.create(
                model=CHAT_NAME, messages=[{"role": "user", "content": "go on"}],
                max_tokens=LONG_CONTEXT - 64, extra_body={"ignore_eos": True})
        assert wait_for(lambda: metric(d, RUNNING) == 0, 5)
        assert metric(d, FINISHED % "cancelled") == before + 1
    finally:
        d.stop()


# --- seqserve chat ------------------------------------------------------------------------

def run_chat(d: Deployment, lines: str, *flags: str, token: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "SEQSERVE_TOKEN"}
    if token:
        env["SEQSERVE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "chat", "--openai-url", base_url(d), *flags],
        input=lines, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


def test_seqserve_chat_keeps_the_conversation(chat_server):
    out = run_chat(chat_server, "Hello\nTell me more\n/exit\nnever sent\n", "--max-tokens", "6",
                   "--temperature", "0", "-v", token=TOKEN)
    assert out.returncode == 0, out.stderr
    replies = out.stdout.splitlines()
    assert len(replies) == 2, out.stdout
    counts = [dict(kv.split("=") for kv in line.strip("[]").split())
              for line in out.stderr.splitlines() if line.startswith("[finish_reason")]
    assert len(counts) == 2, out.stderr
    first, second = ({k: int(v) for k, v in c.items() if k != "finish_reason"} for c in counts)
    # The second turn's prompt holds the first exchange.
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    c = sync_client(chat_server)
    expect = c.chat.completions.create(model=CHAT_NAME, max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert replies[0] == expect.choices[0].message.content
    history = [{"role": "user", "content": "Hello"},
               {"role": "assistant", "content": replies[0]},
               {"role": "user", "content": "Tell me more"}]
    expect = c.chat.completions.create(model=CHAT_NAME, max_tokens=6, temperature=0,
                                       messages=history)
    assert replies[1] == expect.choices[0].message.content


def test_seqserve_chat_reports_errors(chat_server, server):
    out = run_chat(chat_server, "Hello\n", token="wrong")
    assert out.returncode == 1 and "401" in out.stderr, out.stderr
    out = run_chat(server, "Hello\n")  # no chat template: the error, then EOF ends it
    assert out.returncode == 0, out.stderr
    assert "400" in out.stderr and "chat template" in out.stderr


def test_metrics_on_the_openai_port_for_gateways(server):
    """An inference gateway's endpoint picker scrapes /metrics on the port it routes to."""
    import urllib.request

    url = server.openai_url.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for gauge in ("seqserve_num_requests_waiting", "seqserve_num_requests_running",
                  "seqserve_kv_budget_used_ratio"):
        assert f"\n{gauge} " in text, gauge
