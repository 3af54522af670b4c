"""Decoding over real processes: contrastive search, seeded sampling, stop
strings, parameter validation and log-probabilities.

Expected outputs come from plain Hugging Face forwards, one request at a time, with no
KV cache: `contrastive_reference` below recomputes the whole sequence at every step.
One deployment per model is shared by the module (starting one costs ~20 s here).
"""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import grpc
import pytest
import torch

from bench.deployment import Deployment
from client import AsyncClient, Client
from scheduler_service.params import Limits, RequestError, resolve
from tests import reference
from tests.conftest import tiny_model

TIMEOUT = 120


# --- deployments -------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_reference_thread():
    """Reference forwards on one thread: the tiny models gain nothing from more, and on a
    2-core machine shared with the worker, torch's spinning threads made them ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _deployment(arch: str, tmp_path_factory):
    d = Deployment(tiny_model(arch), tmp_path_factory.mktemp(f"decoding-{arch}"))
    try:
        d.start()
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A worker and scheduler serving the tiny llama, shared by the module's tests."""
    yield from _deployment("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2_server(tmp_path_factory):
    yield from _deployment("gpt2", tmp_path_factory)


# --- references --------------------------------------------------------------------------


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _repetition_penalty(logits: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    """Hugging Face's RepetitionPenaltyLogitsProcessor on one row."""
    if penalty == 1.0:
        return logits
    seen = torch.tensor(sorted(set(ids)))
    scores = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


@torch.inference_mode()
def contrastive_reference(model_dir: str | Path, prompt: str, max_new_tokens: int, top_k: int,
                          alpha: float, repetition_penalty: float = 1.0,
                          ignore_eos: bool = False) -> list[int]:
    """Contrastive search (Su et al. 2022) for one prompt, recomputing everything each step.

    No cache and no batching: the full sequence gives the next-token distribution and the
    context hidden states (last layer, all tokens so far, prompt included); each candidate
    is run on its own as full sequence + candidate, its last position's last-layer hidden
    state being the candidate's. score = (1 - alpha) p - alpha max cos(candidate, context).
    """
    tok, model = reference.load(str(model_dir))
    eos = _eos_ids(model)
    ids = list(tok(prompt).input_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        o = model(torch.tensor([ids]), output_hidden_states=True)
        logits = _repetition_penalty(o.logits[0, -1].float(), ids, repetition_penalty)
        context = o.hidden_states[-1][0].float()  # [len(ids), hidden]
        probs = torch.softmax(logits, -1)
        top_probs, cands = torch.topk(probs, top_k)
        scores = []
        for p, c in zip(top_probs.tolist(), cands.tolist()):
            h = model(torch.tensor([ids + [c]]), output_hidden_states=True).hidden_states[-1]
            h = h[0, -1].float()
            cos = torch.nn.functional.cosine_similarity(h[None, :], context, dim=-1)
            scores.append((1.0 - alpha) * p - alpha * float(cos.max()))
        best = cands.tolist()[max(range(len(scores)), key=scores.__getitem__)]
        ids.append(best)
        out.append(best)
        if best in eos and not ignore_eos:
            break
    return out


@torch.inference_mode()
def reference_logprobs(model_dir, prompt: str, generated: list[int]) -> list[torch.Tensor]:
    """log_softmax of the model's next-token logits before each generated token."""
    tok, model = reference.load(str(model_dir))
    ids = list(tok(prompt).input_ids)
    out = []
    for t in generated:
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1))
        ids.append(t)
    return out


@torch.inference_mode()
def greedy_hf(model_dir, prompt: str, max_new_tokens: int, **generate_kwargs) -> list[int]:
    """model.generate(do_sample=False, **generate_kwargs) for this prompt alone."""
    tok, model = reference.load(str(model_dir))
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                         **generate_kwargs)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def assert_greedy_continuation(model_dir, prompt: str, generated: list[int], what=None) -> None:
    """Each generated token is the argmax after the tokens before it (one forward, no
    generate loop: HF generate over a thousand tokens takes half a minute here)."""
    tok, model = reference.load(str(model_dir))
    prompt_ids = tok(prompt).input_ids
    logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    best = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)].argmax(-1).tolist()
    wrong = [i for i, (a, b) in enumerate(zip(generated, best)) if a != b]
    assert not wrong, f"{what}: first non-greedy token at {wrong[0]} of {len(generated)}"


def _tokenizer(model_dir):
    return reference.load(str(model_dir))[0]


# --- sending -----------------------------------------------------------------------------


async def _send_all(address: str, jobs: list[tuple[float, str, dict]], timeout: float) -> list:
    """Send (delay_s, prompt, params) jobs concurrently, each after its delay; the replies."""
    async with AsyncClient(address, timeout=timeout) as c:
        async def one(delay: float, prompt: str, params: dict):
            await asyncio.sleep(delay)
            return await c.generate(prompt, **params)

        return await asyncio.gather(*(one(*j) for j in jobs))


def send_all(address: str, jobs: list[tuple[float, str, dict]],
             timeout: float = TIMEOUT) -> list:
    return asyncio.run(_send_all(address, jobs, timeout))


def alone(address: str, prompt: str, **params):
    with Client(address, timeout=TIMEOUT) as c:
        return c.generate(prompt, **params)


# --- 1. the reference itself ---------------------------------------------------------------


def test_contrastive_reference_with_alpha_zero_is_greedy(llama_dir):
    tok = _tokenizer(llama_dir)
    rng = random.Random(3)
    for n_prompt in (5, 40):
        prompt = reference.prompt_of_tokens(tok, n_prompt, rng)
        for k in (1, 4):
            assert contrastive_reference(llama_dir, prompt, 10, top_k=k, alpha=0.0) == \
                reference.greedy(llama_dir, prompt, 10)
        # top_k=1 leaves a single candidate: greedy whatever alpha.
        assert contrastive_reference(llama_dir, prompt, 10, top_k=1, alpha=0.7) == \
            reference.greedy(llama_dir, prompt, 10)


# --- 2. contrastive search under staggered, mixed traffic -------------------------------------


def _contrastive_jobs(model_dir, n_contrastive: int, n_greedy: int, n_sample: int, seed: int,
                      spread_s: float = 2.0):
    tok = _tokenizer(model_dir)
    rng = random.Random(seed)
    jobs, kinds = [], []
    for i in range(n_contrastive):
        params = dict(decoding_strategy="contrastive", penalty_alpha=round(0.1 * (i % 10), 1),
                      top_k=1 + (i * 5) % 8, max_new_tokens=rng.randint(4, 16),
                      ignore_eos=bool(i % 2))
        if i % 6 == 5:
            params["repetition_penalty"] = 1.3
        jobs.append((rng.uniform(0, spread_s),
                     reference.prompt_of_tokens(tok, rng.randint(5, 120), rng), params))
        kinds.append("contrastive")
    for _ in range(n_greedy):
        jobs.append((rng.uniform(0, spread_s),
                     reference.prompt_of_tokens(tok, rng.randint(1, 150), rng),
                     dict(max_new_tokens=rng.randint(1, 24))))
        kinds.append("greedy")
    for i in range(n_sample):
        jobs.append((rng.uniform(0, spread_s),
                     reference.prompt_of_tokens(tok, rng.randint(1, 150), rng),
                     dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.9, seed=100 + i,
                          max_new_tokens=rng.randint(4, 24), ignore_eos=True)))
        kinds.append("sample")
    order = list(range(len(jobs)))
    rng.shuffle(order)
    return [jobs[i] for i in order], [kinds[i] for i in order]


def _check_mixed(model_dir, address, jobs, kinds, replies) -> None:
    checked = {"contrastive": 0, "greedy": 0, "sample": 0}
    for (_, prompt, params), kind, reply in zip(jobs, kinds, replies):
        n = params["max_new_tokens"]
        if kind == "contrastive":
            expected = contrastive_reference(
                model_dir, prompt, n, params["top_k"], params["penalty_alpha"],
                params.get("repetition_penalty", 1.0), params["ignore_eos"])
            if params["penalty_alpha"] == 0.0 and params.get("repetition_penalty", 1.0) == 1.0:
                assert expected == reference.greedy(model_dir, prompt, n)
        elif kind == "greedy":
            expected = reference.greedy(model_dir, prompt, n)
        else:
            expected = alone(address, prompt, **params).token_ids
            assert len(expected) == n
        assert reply.token_ids == expected, (
            f"{kind}: prompt {prompt[:40]!r}... params {params}\n got      {reply.token_ids}\n"
            f" expected {expected}")
        eos = _eos_ids(reference.load(str(model_dir))[1])
        ended_on_eos = bool(expected) and expected[-1] in eos and not params.get("ignore_eos")
        assert reply.finish_reason == ("eos" if ended_on_eos else "length")
        checked[kind] += 1
    assert checked["contrastive"] and checked["greedy"]


def test_contrastive_matches_reference_in_staggered_mixed_batch(server):
    model_dir = server.model_dir
    jobs, kinds = _contrastive_jobs(model_dir, 24, 8, 6, seed=11)
    alphas = {p["penalty_alpha"] for _, _, p in jobs if "penalty_alpha" in p}
    ks = {p["top_k"] for _, _, p in jobs if "penalty_alpha" in p}
    assert alphas == {round(0.1 * i, 1) for i in range(10)} and ks == set(range(1, 9))
    replies = send_all(server.address, jobs)
    _check_mixed(model_dir, server.address, jobs, kinds, replies)


def test_contrastive_matches_reference_gpt2(gpt2_server):
    """Absolute position embeddings: every candidate must sit at the same position."""
    model_dir = gpt2_server.model_dir
    jobs, kinds = _contrastive_jobs(model_dir, 10, 4, 2, seed=5, spread_s=1.0)
    replies = send_all(gpt2_server.address, jobs)
    _check_mixed(model_dir, gpt2_server.address, jobs, kinds, replies)


# --- 3. seeded sampling is reproducible whatever the batch -------------------------------------

SEEDED = dict(decoding_strategy="sample", temperature=0.8, top_k=50, top_p=0.95, seed=1234,
              max_new_tokens=32, ignore_eos=True)


def _busy_jobs(tok, rng: random.Random, n: int, spread_s: float) -> list[tuple[float, str, dict]]:
    jobs = []
    for i in range(n):
        prompt = reference.prompt_of_tokens(tok, rng.randint(1, 200), rng)
        kind = i % 4
        if kind == 0:
            params = dict(max_new_tokens=rng.randint(4, 48))
        elif kind == 1:
            params = dict(decoding_strategy="contrastive", penalty_alpha=0.5,
                          top_k=rng.randint(2, 6), max_new_tokens=rng.randint(4, 24))
        elif kind == 2:
            params = dict(SEEDED, seed=rng.randint(0, 10**6), max_new_tokens=rng.randint(4, 48))
        else:  # unseeded sampling with other warpers
            params = dict(do_sample=True, temperature=1.2, typical_p=0.9,
                          max_new_tokens=rng.randint(4, 48))
        jobs.append((rng.uniform(0, spread_s), prompt, params))
    return jobs


def test_seeded_sampling_reproducible_alone_and_in_busy_batches(server):
    tok = _tokenizer(server.model_dir)
    rng = random.Random(21)
    prompt = reference.prompt_of_tokens(tok, 30, rng)
    first = alone(server.address, prompt, **SEEDED)
    assert len(first.token_ids) == 32 and first.finish_reason == "length"
    # do_sample=True means the same as decoding_strategy="sample".
    via_do_sample = dict(SEEDED, do_sample=True)
    del via_do_sample["decoding_strategy"]
    assert alone(server.address, prompt, **via_do_sample).token_ids == first.token_ids

    # The seeded request arrives first, in the middle, and last (others still running),
    # with a twin of itself in the same batch.
    for round_, target_delay in enumerate((0.0, 0.6, 1.4)):
        jobs = _busy_jobs(tok, rng, 12, spread_s=1.5)
        jobs.append((target_delay, prompt, dict(SEEDED)))
        jobs.append((rng.uniform(0, 1.5), prompt, dict(SEEDED)))
        replies = send_all(server.address, jobs)
        for reply in replies[-2:]:
            assert reply.token_ids == first.token_ids, f"round {round_}"
        # Other requests were really served alongside.
        assert all(r.token_ids for r in replies)
    assert alone(server.address, prompt, **SEEDED).token_ids == first.token_ids

    others = [alone(server.address, prompt, **dict(SEEDED, seed=s)).token_ids for s in (1, 2)]
    assert not all(o == first.token_ids for o in others), "different seeds gave the same tokens"
    assert others[0] != others[1] or others[0] != first.token_ids
    # Each seed is itself reproducible.
    assert alone(server.address, prompt, **dict(SEEDED, seed=1)).token_ids == others[0]


# --- 4. sampling limits that reduce to greedy -----------------------------------------------


def test_degenerate_sampling_equals_greedy(server):
    tok = _tokenizer(server.model_dir)
    rng = random.Random(4)
    prompts = [reference.prompt_of_tokens(tok, n, rng) for n in (3, 17, 60, 130)]
    variants = [dict(do_sample=True, top_k=1, temperature=1.5),
                dict(decoding_strategy="sample", top_p=1e-6),
                dict(decoding_strategy="sample", temperature=1e-4),
                dict(decoding_strategy="sample", top_k=1, seed=7, typical_p=0.5)]
    jobs = [(0.1 * i, p, dict(v, max_new_tokens=14))
            for i, (p, v) in enumerate((p, v) for p in prompts for v in variants)]
    replies = send_all(server.address, jobs)
    for (_, prompt, params), reply in zip(jobs, replies):
        assert reply.token_ids == reference.greedy(server.model_dir, prompt, 14), params


def _hf_warpers(params: dict):
    from transformers.generation.logits_process import (
        LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

    procs = LogitsProcessorList()
    if params.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    if params.get("temperature", 1.0) != 1.0:
        procs.append(TemperatureLogitsWarper(params["temperature"]))
    if params.get("top_k", 0):
        procs.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(params["top_p"]))
    if params.get("typical_p", 1.0) < 1.0:
        procs.append(TypicalLogitsWarper(params["typical_p"]))
    return procs


@torch.inference_mode()
def test_sampled_tokens_lie_in_hf_warped_support(server):
    """Every sampled token has non-zero probability under Hugging Face's own warpers."""
    model_dir = server.model_dir
    tok, model = reference.load(str(model_dir))
    prompt = reference.prompt_of_tokens(tok, 25, random.Random(12))
    variants = [dict(top_k=3), dict(top_p=0.3, temperature=0.7), dict(typical_p=0.4),
                dict(top_k=20, top_p=0.5, typical_p=0.8, temperature=1.3, repetition_penalty=1.5)]
    jobs = [(0.02 * i, prompt, dict(v, decoding_strategy="sample", seed=i, max_new_tokens=6,
                                     ignore_eos=True))
            for i, v in enumerate(v for v in variants for _ in range(12))]
    replies = send_all(server.address, jobs)
    prompt_ids = tok(prompt).input_ids
    for vi, v in enumerate(variants):
        procs = _hf_warpers(v)
        firsts = set()
        rows = slice(12 * vi, 12 * vi + 12)
        for (_, _, params), reply in zip(jobs[rows], replies[rows]):
            assert len(reply.token_ids) == 6
            ids = list(prompt_ids)
            for t in reply.token_ids:
                x = torch.tensor([ids])
                scores = procs(x, model(x).logits[:, -1].float())[0]
                assert math.isfinite(float(scores[t])), (v, params["seed"], t)
                ids.append(t)
            firsts.add(reply.token_ids[0])
        # top_k=3 over 12 seeds: sampling really draws (P(all the same) is tiny here).
        if vi == 0:
            assert len(firsts) > 1


# --- 5. one batch of all three strategies ---------------------------------------------------


def test_mixed_strategies_in_one_batch_equal_alone(server):
    model_dir = server.model_dir
    tok = _tokenizer(model_dir)
    rng = random.Random(8)
    jobs = []
    for i in range(4):
        jobs.append(("greedy", reference.prompt_of_tokens(tok, rng.randint(2, 100), rng),
                     dict(max_new_tokens=rng.randint(6, 20))))
        jobs.append(("sample", reference.prompt_of_tokens(tok, rng.randint(2, 100), rng),
                     dict(decoding_strategy="sample", seed=1000 + i, temperature=0.7 + 0.2 * i,
                          top_k=(0, 20, 50, 5)[i], top_p=(1.0, 0.9, 0.8, 1.0)[i],
                          typical_p=(1.0, 1.0, 0.95, 0.9)[i],
                          repetition_penalty=(1.0, 1.2, 1.0, 1.1)[i],
                          max_new_tokens=rng.randint(6, 20), ignore_eos=True)))
        jobs.append(("greedy_penalty", reference.prompt_of_tokens(tok, rng.randint(2, 100), rng),
                     dict(max_new_tokens=rng.randint(6, 20), repetition_penalty=1.1 + 0.3 * i)))
        jobs.append(("contrastive", reference.prompt_of_tokens(tok, rng.randint(2, 100), rng),
                     dict(decoding_strategy="contrastive", penalty_alpha=(0.6, 0.3, 0.9, 0.0)[i],
                          top_k=(4, 8, 2, 3)[i], max_new_tokens=rng.randint(6, 20))))
    expected = []
    for kind, prompt, params in jobs:
        if kind == "greedy":
            expected.append(reference.greedy(model_dir, prompt, params["max_new_tokens"]))
        elif kind == "greedy_penalty":
            expected.append(greedy_hf(model_dir, prompt, params["max_new_tokens"],
                                      repetition_penalty=params["repetition_penalty"]))
        elif kind == "contrastive":
            expected.append(contrastive_reference(model_dir, prompt, params["max_new_tokens"],
                                                  params["top_k"], params["penalty_alpha"]))
        else:
            expected.append(alone(server.address, prompt, **params).token_ids)
    for order in (list(range(len(jobs))), list(reversed(range(len(jobs))))):
        replies = send_all(server.address, [(0.0, jobs[i][1], jobs[i][2]) for i in order])
        for i, reply in zip(order, replies):
            kind, prompt, params = jobs[i]
            assert reply.token_ids == expected[i], f"{kind} {params} prompt {prompt[:30]!r}"


# --- 6. stop strings ------------------------------------------------------------------------


def _plain(text: str) -> bool:
    return bool(text) and all(c.isascii() and c.isprintable() for c in text)


def _find_spanning_stop(model_dir, n: int):
    """A prompt, its greedy ids and a stop string that first occurs across tokens i, i+1."""
    tok, model = reference.load(str(model_dir))
    eos = _eos_ids(model)
    rng = random.Random(99)
    for _ in range(50):
        prompt = reference.prompt_of_tokens(tok, rng.randint(5, 60), rng)
        ids = reference.greedy(model_dir, prompt, n)
        if len(ids) != n or eos & set(ids):
            continue
        full = tok.decode(ids, skip_special_tokens=True)
        texts = [tok.decode([t]) for t in ids]
        for i in range(1, n - 2):
            a, b = texts[i], texts[i + 1]
            if not (_plain(a) and _plain(b)):
                continue
            stop = a[-2:] + b[:2]
            if not stop.strip():
                continue
            where = len(tok.decode(ids[: i + 1], skip_special_tokens=True)) - len(a[-2:])
            if full.find(stop) == where:
                return prompt, ids, stop, i
    raise AssertionError("no prompt with a stop string spanning two plain-text tokens")


def test_stop_string_spanning_two_tokens(server):
    model_dir = server.model_dir
    tok = _tokenizer(model_dir)
    n = 40
    prompt, ids, stop, i = _find_spanning_stop(model_dir, n)
    full = tok.decode(ids, skip_special_tokens=True)
    expected_text = full[: full.find(stop)]

    with Client(server.address, timeout=TIMEOUT) as c:
        chunks = list(c.stream(prompt, max_new_tokens=n, stop=[stop]))
    text = "".join(ch.text for ch in chunks)
    got_ids = [ch.token_id for ch in chunks if ch.token_id is not None]
    assert chunks[-1].finish_reason == "stop"
    assert text == expected_text
    assert stop not in text
    # Generation ended with the token that completed the stop string.
    assert got_ids == ids[: i + 2]
    assert chunks[-1].generated_tokens == i + 2

    # Among other stops that never occur, the same one still ends it at the same place.
    reply = alone(server.address, prompt, max_new_tokens=n, stop=["\x01never", stop, "ZZ@@"])
    assert (reply.finish_reason, reply.text, reply.token_ids) == ("stop", expected_text,
                                                                  ids[: i + 2])

    # A stop that never occurs: the whole generation, finish_reason "length".
    never = "QQ#never#QQ"
    assert never not in full
    reply = alone(server.address, prompt, max_new_tokens=n, stop=[never])
    assert reply.finish_reason == "length"
    assert reply.token_ids == ids
    assert reply.text == full


# --- 7. invalid parameters ---------------------------------------------------------------


def test_invalid_parameters_are_rejected_and_server_keeps_serving(server):
    with Client(server.address, timeout=TIMEOUT) as c:
        info = c.model_info()
        vocab, max_pos = info.vocab_size, info.max_position_embeddings
        nan, inf = float("nan"), float("inf")
        cases = [
            ("max_new_tokens", dict(max_new_tokens=0)),
            ("max_new_tokens", dict(max_new_tokens=-1)),
            ("max_new_tokens", dict(max_new_tokens=max_pos)),  # prompt + it > context
            ("max_new_tokens", dict(max_new_tokens=max_pos + 1)),
            ("max_new_tokens", dict(max_new_tokens=info.max_new_tokens_limit + 1)),
            ("temperature", dict(temperature=0.0)),
            ("temperature", dict(temperature=-1.0)),
            ("temperature", dict(temperature=nan)),
            ("temperature", dict(temperature=inf)),
            ("top_k", dict(top_k=-1)),
            ("top_k", dict(top_k=vocab + 1)),
            ("top_k", dict(top_k=0, decoding_strategy="contrastive")),
            ("top_p", dict(top_p=0.0)),
            ("top_p", dict(top_p=1.5)),
            ("top_p", dict(top_p=nan)),
            ("typical_p", dict(typical_p=0.0)),
            ("typical_p", dict(typical_p=2.0)),
            ("repetition_penalty", dict(repetition_penalty=0.0)),
            ("repetition_penalty", dict(repetition_penalty=-1.0)),
            ("repetition_penalty", dict(repetition_penalty=inf)),
            ("seed", dict(seed=-5)),
            ("stop", dict(stop=[f"s{i}" for i in range(9)])),
            ("stop", dict(stop=[""])),
            ("stop", dict(stop=["ok", "x" * 257])),
            ("penalty_alpha", dict(penalty_alpha=-0.1)),
            ("penalty_alpha", dict(penalty_alpha=1.5)),
            ("logprobs", dict(logprobs=6)),
            ("logprobs", dict(logprobs=-1)),
            ("decoding_strategy", dict(decoding_strategy="beam_search")),
        ]
        for field, params in cases:
            with pytest.raises(grpc.RpcError) as err:
                c.generate("the king", **params)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, err.value)
            assert field in err.value.details(), (params, err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            c.generate("", max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "inputs" in err.value.details()

        # Still serving, correctly.
        reply = c.generate("the king once upon a time", max_new_tokens=12)
        expected = reference.greedy(server.model_dir, "the king once upon a time", 12)
        assert reply.token_ids == expected


def test_boundary_values_are_served_correctly(server):
    """Values at the edges of the allowed ranges are accepted and decode correctly."""
    model_dir = server.model_dir
    tok = _tokenizer(model_dir)
    one = "the"  # a single-token prompt: the contrastive context starts with one state
    assert len(tok(one).input_ids) == 1
    prompt = "the king once upon a time"
    # prompt + max_new_tokens == the whole context
    fill = reference.load(str(model_dir))[1].config.max_position_embeddings - \
        len(tok(prompt).input_ids)
    contrastive = dict(decoding_strategy="contrastive")
    jobs = [
        (one, dict(contrastive, penalty_alpha=0.6, top_k=4, max_new_tokens=8),
         lambda: contrastive_reference(model_dir, one, 8, 4, 0.6)),
        (prompt, dict(contrastive, penalty_alpha=1.0, top_k=8, max_new_tokens=8),
         lambda: contrastive_reference(model_dir, prompt, 8, 8, 1.0)),
        (prompt, dict(contrastive, penalty_alpha=0.5, top_k=64, max_new_tokens=3),
         lambda: contrastive_reference(model_dir, prompt, 3, 64, 0.5)),
        (prompt, dict(repetition_penalty=1e-3, max_new_tokens=8),
         lambda: greedy_hf(model_dir, prompt, 8, repetition_penalty=1e-3)),
        (prompt, dict(max_new_tokens=fill, ignore_eos=True), None),
        (prompt, dict(decoding_strategy="contrastive", penalty_alpha=0.0, top_k=3,
                      max_new_tokens=fill, ignore_eos=True), None),
        (prompt, dict(decoding_strategy="sample", top_k=1, seed=2**63 - 1, max_new_tokens=8),
         lambda: reference.greedy(model_dir, prompt, 8)),
        (prompt, dict(stop=["x" * 256] * 8, max_new_tokens=8),
         lambda: reference.greedy(model_dir, prompt, 8)),
    ]
    replies = send_all(server.address, [(0.05 * i, p, params) for i, (p, params, _) in
                                        enumerate(jobs)])
    for (p, params, expected), reply in zip(jobs, replies):
        what = {k: v for k, v in params.items() if k != "stop"}
        if expected is None:  # the whole context: check greedy by teacher forcing
            assert len(reply.token_ids) == fill and reply.finish_reason == "length"
            assert_greedy_continuation(model_dir, p, reply.token_ids, what)
        else:
            assert reply.token_ids == expected(), what


LIMITS = Limits(vocab_size=1000, max_position_embeddings=1024, max_new_tokens_limit=4096,
                default_max_new_tokens=64)


@pytest.mark.parametrize("field,params", [
    ("temperature", {"temperature": "hot"}),
    ("max_new_tokens", {"max_new_tokens": 1.5}),
    ("max_new_tokens", {"max_new_tokens": "10"}),
    ("max_new_tokens", {"max_new_tokens": True}),
    ("stop", {"stop": [1, 2]}),
    ("stop", {"stop": 5}),
    ("do_sample", {"do_sample": "yes"}),
    ("top_k", {"top_k": 2.5}),
    ("top_k", {"top_k": float("inf")}),
    ("top_p", {"top_p": "0.9"}),
    ("seed", {"seed": "1"}),
    ("seed", {"seed": 0.5}),
    ("ignore_eos", {"ignore_eos": "no"}),
    ("penalty_alpha", {"penalty_alpha": [0.5]}),
    ("logprobs", {"logprobs": False}),
    ("decoding_strategy", {"decoding_strategy": 2}),
    ("repetition_penalty", {"repetition_penalty": float("nan")}),
    ("bogus", {"bogus": 1}),
])
def test_resolve_rejects_wrong_types(field, params):
    with pytest.raises(RequestError) as err:
        resolve(params, LIMITS, prompt_tokens=10)
    assert field in str(err.value)


def test_resolve_defaults_and_accepted_forms():
    cfg = resolve({}, LIMITS, prompt_tokens=10)
    assert (cfg.strategy, cfg.max_new_tokens, cfg.top_k, cfg.logprobs) == ("greedy", 64, 0, -1)
    cfg = resolve({"decoding_strategy": "contrastive"}, LIMITS, prompt_tokens=10)
    assert (cfg.top_k, cfg.penalty_alpha) == (4, 0.6)
    cfg = resolve({"do_sample": True, "temperature": 2, "max_new_tokens": 8.0, "stop": "x"},
                  LIMITS, prompt_tokens=10)
    assert (cfg.strategy, cfg.temperature, cfg.max_new_tokens, cfg.stop) == \
        ("sample", 2.0, 8, ("x",))
    # decoding_strategy wins over do_sample.
    cfg = resolve({"do_sample": True, "decoding_strategy": "greedy"}, LIMITS, prompt_tokens=10)
    assert cfg.strategy == "greedy"
    assert resolve({"max_new_tokens": 1014}, LIMITS, prompt_tokens=10).max_new_tokens == 1014
    with pytest.raises(RequestError, match="max_new_tokens"):
        resolve({"max_new_tokens": 1015}, LIMITS, prompt_tokens=10)


# --- 8. log-probabilities -----------------------------------------------------------------


def _check_logprobs(chunks, ref_logp: list[torch.Tensor], n_top: int, token_ids: list[int]):
    tokens = [ch for ch in chunks if ch.token_id is not None]
    assert [ch.token_id for ch in tokens] == token_ids
    for step, (ch, logp) in enumerate(zip(tokens, ref_logp)):
        assert ch.logprob is not None and ch.logprob <= 0.0
        assert math.isclose(ch.logprob, float(logp[ch.token_id]), abs_tol=1e-4), step
        assert len(ch.top_logprobs) == n_top
        vals, ids = torch.topk(logp, n_top)
        assert [i for i, _ in ch.top_logprobs] == ids.tolist(), step
        for (_, lp), v in zip(ch.top_logprobs, vals.tolist()):
            assert lp <= 0.0 and math.isclose(lp, v, abs_tol=1e-4), step
        got = [lp for _, lp in ch.top_logprobs]
        assert got == sorted(got, reverse=True)


def test_logprobs_greedy(server):
    model_dir = server.model_dir
    tok = _tokenizer(model_dir)
    rng = random.Random(5)
    with Client(server.address, timeout=TIMEOUT) as c:
        for n_prompt in (4, 50):
            prompt = reference.prompt_of_tokens(tok, n_prompt, rng)
            expected = reference.greedy(model_dir, prompt, 12)
            chunks = list(c.stream(prompt, max_new_tokens=12, logprobs=3))
            ref = reference_logprobs(model_dir, prompt, expected)
            _check_logprobs(chunks, ref, 3, expected)
            tokens = [ch for ch in chunks if ch.token_id is not None]
            assert all(ch.top_logprobs[0][0] == ch.token_id for ch in tokens)
            # logprobs=0: the chosen token's only; unset: none.
            chunks = list(c.stream(prompt, max_new_tokens=12, logprobs=0))
            _check_logprobs(chunks, ref, 0, expected)
            reply = c.generate(prompt, max_new_tokens=12)
            assert reply.token_ids == expected and all(lp is None for lp in reply.logprobs)


def test_logprobs_contrastive(server):
    """The chosen candidate's log-probability under the distribution it was chosen from."""
    model_dir = server.model_dir
    tok = _tokenizer(model_dir)
    prompt = reference.prompt_of_tokens(tok, 20, random.Random(6))
    expected = contrastive_reference(model_dir, prompt, 10, top_k=5, alpha=0.6, ignore_eos=True)
    with Client(server.address, timeout=TIMEOUT) as c:
        chunks = list(c.stream(prompt, max_new_tokens=10, decoding_strategy="contrastive",
                               top_k=5, penalty_alpha=0.6, ignore_eos=True, logprobs=2))
    _check_logprobs(chunks, reference_logprobs(model_dir, prompt, expected), 2, expected)
