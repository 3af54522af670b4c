"""Over real processes: greedy outputs equal model.generate alone."""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from client import AsyncClient, Client
from tests import reference
from tests.conftest import ARCHITECTURES, tiny_model


async def _run_staggered(address: str, requests: list[tuple[str, int]], seed: int,
                         spread_s: float = 2.0) -> list:
    rng = random.Random(seed)
    delays = [rng.uniform(0, spread_s) for _ in requests]

    async def one(i: int):
        await asyncio.sleep(delays[i])
        async with AsyncClient(address, timeout=300) as c:
            prompt, n = requests[i]
            return await c.generate(prompt, max_new_tokens=n)

    return await asyncio.gather(*(one(i) for i in range(len(requests))))


def make_requests(model_dir, n: int, seed: int, max_prompt: int = 400, max_new: int = 64):
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    return [(reference.prompt_of_tokens(tok, rng.randint(1, max_prompt), rng),
             rng.randint(1, max_new)) for _ in range(n)]


def check_against_reference(model_dir, requests, replies) -> None:
    for (prompt, n), reply in zip(requests, replies):
        expected = reference.greedy(model_dir, prompt, n)
        assert reply.token_ids == expected, f"prompt {prompt[:40]!r}... max_new_tokens={n}"
        assert reply.finish_reason in ("length", "eos")


# All in the slow suite: make test runs the same 48 staggered llama requests through two
# data-parallel workers (test_data_parallel.py), and test_architectures and test_beam
# cover more shapes with fewer requests.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_48_staggered_requests_match_generate(arch, deploy):
    model_dir = tiny_model(arch)
    d = deploy(model_dir)
    requests = make_requests(model_dir, 48, seed=hash(arch) % 1000)
    replies = asyncio.run(_run_staggered(d.address, requests, seed=1))
    check_against_reference(model_dir, requests, replies)


def test_short_request_overtakes_long_one(llama_dir, deploy):
    d = deploy(llama_dir)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(7)
    long_prompt = reference.prompt_of_tokens(tok, 300, rng)
    short_prompt = reference.prompt_of_tokens(tok, 20, rng)
    order: list[str] = []

    async def scenario():
        async with AsyncClient(d.address) as c:
            long_ids: list[int] = []
            got_some = asyncio.Event()

            async def long_req():
                async for chunk in c.stream(long_prompt, max_new_tokens=300, ignore_eos=True):
                    if chunk.token_id is not None:
                        long_ids.append(chunk.token_id)
                        if len(long_ids) == 10:
                            got_some.set()
                order.append("long")

            async def short_req():
                await got_some.wait()
                reply = await c.generate(short_prompt, max_new_tokens=5)
                order.append("short")
                return reply

            _, short = await asyncio.gather(long_req(), short_req())
            return long_ids, short

    long_ids, short = asyncio.run(scenario())
    assert order == ["short", "long"]
    tok_, model = reference.load(str(llama_dir))
    import torch
    ids = torch.tensor([tok_(long_prompt).input_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=300, pad_token_id=tok_.pad_token_id)
    assert len(long_ids) == 300
    assert reference.same_until_eos(long_ids, out[0, ids.shape[1]:].tolist(), tok_.eos_token_id)
    assert short.token_ids == reference.greedy(llama_dir, short_prompt, 5)


def test_streamed_text_equals_decode_with_multibyte(llama_dir, deploy):
    d = deploy(llama_dir)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompts = ["你好，世界。今天", "héllo wörld café", "🙂🚀 emoji ✨ and", "Привет мир", "plain ascii"]
    with Client(d.address, timeout=120) as c:
        for p in prompts:
            chunks = list(c.stream(p, max_new_tokens=40, ignore_eos=True))
            ids = [ch.token_id for ch in chunks if ch.token_id is not None]
            text = "".join(ch.text for ch in chunks)
            assert text == tok.decode(ids, skip_special_tokens=True)
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].generated_tokens == 40
            assert chunks[-1].prompt_tokens == len(tok(p).input_ids)


def test_unary_and_model_info(llama_dir, deploy):
    d = deploy(llama_dir)
    with Client(d.address, timeout=60) as c:
        info = c.model_info()
        assert info.architecture == "LlamaForCausalLM"
        assert info.kv_budget_tokens > 0
        reply = c.stub.GenerateUnary(__import__("client.api", fromlist=["x"]).build_request(
            "Once upon a time", max_new_tokens=12), timeout=60)
        assert len(reply.tokens) == reply.usage.generated_tokens <= 12
        assert [t.id for t in reply.tokens] == reference.greedy(llama_dir, "Once upon a time", 12)
