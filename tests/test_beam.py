"""Beam search: equal to Hugging Face `model.generate(num_beams=k, do_sample=False)` on the
request alone, through the real processes, in float32, inside batches that also hold
greedy, sampled and contrastive rows, which it must leave unchanged.

The tiny llama is served with a second end-of-sequence id, a token its beams actually
produce, so hypotheses end on EOS (and with two EOS ids, 3k candidates are kept per step).
"""

from __future__ import annotations

import json
import random
import shutil
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from bench.deployment import Deployment
from client import Client
from scheduler_service.batch_plan import BatchPlanner
from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.params import Limits, RequestError, resolve
from scheduler_service.sequence import Sequence
from seqserve_common.decoding import DecodingStrategy
from tests import reference
from tests.conftest import tiny_model
from tests.test_decoding import send_all
from worker_service.beam import BeamSearch, BeamSearches, extra_row_id
from worker_service.engine import Engine
from worker_service.kv_groups import KVGroup, KVShape
from worker_service.model_runner import ModelRunner
from worker_service.sequence import BeamParams, DecodingParams
from worker_service.step import PrefillSpec

TIMEOUT = 180
MAX_NEW = 14
# Each beam variant of generate's parameters, sent with every prompt.
VARIANTS = [
    dict(num_beams=4),
    dict(num_beams=4, length_penalty=0.5, num_return_sequences=3),
    dict(num_beams=4, early_stopping=True, num_return_sequences=2),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5, num_return_sequences=4),
    dict(num_beams=3, repetition_penalty=1.3),
    dict(num_beams=2, length_penalty=-0.5, early_stopping=True, num_return_sequences=2),
]
PROMPT_TOKENS = (3, 21, 57)
EOS_SEED = 1  # the jobs whose second prompt makes the extra EOS id (see _eos_model)


@pytest.fixture(scope="module", autouse=True)
def _one_reference_thread():
    """Reference forwards on one thread (the worker shares the machine's two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- references ------------------------------------------------------------------------------


@torch.inference_mode()
def beam_reference(model_dir, prompt: str, max_new_tokens: int, **kw
                   ) -> list[tuple[list[int], float]]:
    """(generated token ids, score) of each returned sequence of generate(num_beams=...)
    on this prompt alone, best first."""
    tok, model = reference.load(str(model_dir))
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True, output_scores=True, **kw)
    n = ids.shape[1]
    result = []
    for row, beams, score in zip(out.sequences, out.beam_indices, out.sequences_scores):
        length = int((beams >= 0).sum())  # generated tokens; the rest is padding
        result.append((row[n:n + length].tolist(), float(score)))
    return result


def _eos_model(tmp_path_factory) -> Path:
    """The tiny llama with a second EOS id: a token that the beams of a test prompt produce
    a few tokens in, so that searches end on EOS."""
    src = tiny_model("llama")
    dst = tmp_path_factory.mktemp("beam-eos") / "tiny-llama-eos"
    shutil.copytree(src, dst)
    tok, _ = reference.load(str(src))
    prompt = _prompts(tok, random.Random(EOS_SEED))[1]
    extra = beam_reference(src, prompt, MAX_NEW, num_beams=4)[0][0][4]
    path = dst / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [tok.eos_token_id, extra]
    path.write_text(json.dumps(config))
    return dst


def _serve(model_dir: Path, tmp_path_factory):
    d = Deployment(model_dir, tmp_path_factory.mktemp(f"beam-{model_dir.name}"))
    try:
        d.start()
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def llama_eos(tmp_path_factory):
    yield from _serve(_eos_model(tmp_path_factory), tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    yield from _serve(tiny_model("gpt2"), tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    yield from _serve(tiny_model("qwen2"), tmp_path_factory)


def _prompts(tok, rng: random.Random) -> list[str]:
    return [reference.prompt_of_tokens(tok, n, rng) for n in PROMPT_TOKENS]


def _beam_jobs(model_dir, seed: int) -> list[tuple[float, str, dict]]:
    tok = reference.load(str(model_dir))[0]
    rng = random.Random(seed)
    prompts = _prompts(tok, rng)
    return [(rng.uniform(0, 1.0), p, dict(v, max_new_tokens=MAX_NEW - i))
            for i, p in enumerate(prompts) for v in VARIANTS]


def _check_beams(model_dir, jobs, replies) -> list[str]:
    """Every reply equals generate's sequences (ids, text, order; scores to float32
    rounding); returns the finish reasons of the best hypotheses."""
    tok, model = reference.load(str(model_dir))
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    reasons = []
    for (_, prompt, params), reply in zip(jobs, replies):
        kw = {k: v for k, v in params.items() if k != "max_new_tokens"}
        expected = beam_reference(model_dir, prompt, params["max_new_tokens"], **kw)
        got = [(s.token_ids, s.score) for s in reply.sequences]
        what = f"prompt {prompt[:30]!r} params {params}"
        assert [g for g, _ in got] == [e for e, _ in expected], (
            f"{what}\n got      {got}\n expected {expected}")
        for (_, gs), (_, es) in zip(got, expected):
            assert gs == pytest.approx(es, abs=1e-4), what
        best = expected[0][0]
        assert reply.token_ids == best, what  # the streamed tokens are the best hypothesis
        assert reply.text == reply.sequences[0].text == tok.decode(best, skip_special_tokens=True)
        reason = "eos" if best[-1] in eos else "length"
        assert reply.finish_reason == reply.sequences[0].finish_reason == reason, what
        assert reply.generated_tokens == len(best)
        reasons.append(reason)
    return reasons


# --- through the real processes ----------------------------------------------------------------


def test_beam_search_equals_generate_llama_with_eos(llama_eos):
    jobs = _beam_jobs(llama_eos.model_dir, seed=EOS_SEED)
    reasons = _check_beams(llama_eos.model_dir, jobs, send_all(llama_eos.address, jobs, TIMEOUT))
    assert "eos" in reasons and "length" in reasons  # both endings were exercised


# qwen2 (about 12 s) runs in the slow suite: make test keeps to its 15 minutes.
@pytest.mark.parametrize("fixture", ["gpt2", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_beam_search_equals_generate(fixture, request):
    d = request.getfixturevalue(fixture)
    jobs = _beam_jobs(d.model_dir, seed=2)
    _check_beams(d.model_dir, jobs, send_all(d.address, jobs, TIMEOUT))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "gpt_neox", "opt"])
def test_beam_search_equals_generate_more_architectures(arch, tmp_path_factory):
    for d in _serve(tiny_model(arch), tmp_path_factory):
        jobs = _beam_jobs(d.model_dir, seed=3)
        _check_beams(d.model_dir, jobs, send_all(d.address, jobs, TIMEOUT))


def test_beams_leave_greedy_sampled_and_contrastive_rows_unchanged(llama_eos):
    model_dir = llama_eos.model_dir
    tok = reference.load(str(model_dir))[0]
    rng = random.Random(7)
    others = []
    for i in range(9):
        prompt = reference.prompt_of_tokens(tok, rng.randint(2, 60), rng)
        params = [dict(max_new_tokens=16),
                  dict(do_sample=True, temperature=0.9, top_k=40, seed=10 + i,
                       max_new_tokens=16, ignore_eos=True),
                  dict(decoding_strategy="contrastive", top_k=4, penalty_alpha=0.6,
                       max_new_tokens=12)][i % 3]
        others.append((prompt, params))
    with Client(llama_eos.address, timeout=TIMEOUT) as c:
        alone = [c.generate(p, **params).token_ids for p, params in others]
    for (prompt, params), ids in zip(others, alone):
        if "do_sample" not in params and "decoding_strategy" not in params:
            assert ids == reference.greedy(model_dir, prompt, 16)
    beams = _beam_jobs(model_dir, seed=8)[::2]
    jobs = [(rng.uniform(0, 1.0), p, params) for p, params in others] + beams
    replies = send_all(llama_eos.address, jobs, TIMEOUT)
    for (prompt, params), ids, reply in zip(others, alone, replies):
        assert reply.token_ids == ids, f"{params} changed beside beam searches"
    _check_beams(model_dir, beams, replies[len(others):])


def test_stream_and_invocations_carry_the_hypotheses(llama_eos):
    tok = reference.load(str(llama_eos.model_dir))[0]
    prompt = _prompts(tok, random.Random(EOS_SEED))[1]
    params = dict(num_beams=4, num_return_sequences=3, early_stopping="never",
                  length_penalty=0.7, max_new_tokens=MAX_NEW)
    with Client(llama_eos.address, timeout=TIMEOUT) as c:
        chunks = list(c.stream(prompt, **params))
    final = chunks[-1]
    assert all(ch.sequences == [] for ch in chunks[:-1])
    assert [ch.token_id for ch in chunks[:-1]] == final.sequences[0].token_ids
    assert "".join(ch.text for ch in chunks) == final.sequences[0].text
    body = json.dumps({"inputs": prompt, "parameters": params}).encode()
    req = urllib.request.Request(llama_eos.http_url + "/invocations", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        answer = json.loads(r.read())
    sequences = answer["details"]["sequences"]
    assert [s["token_ids"] for s in sequences] == [s.token_ids for s in final.sequences]
    assert [s["generated_text"] for s in sequences] == [s.text for s in final.sequences]
    assert answer["generated_text"] == sequences[0]["generated_text"]
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_NEW, "num_beams": 4,
                       "early_stopping": "never", "length_penalty": 0.7}).encode()
    req = urllib.request.Request(llama_eos.openai_url + "/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        assert json.loads(r.read())["choices"][0]["text"] == final.sequences[0].text


def test_bad_beam_values_are_refused_by_the_server(llama_eos):
    cases = [("num_beams", dict(num_beams=0)), ("num_beams", dict(num_beams=17)),
             ("num_return_sequences", dict(num_beams=2, num_return_sequences=3)),
             ("do_sample", dict(num_beams=4, do_sample=True)),
             ("early_stopping", dict(num_beams=4, early_stopping="sometimes")),
             ("stop", dict(num_beams=4, stop=["x"])),
             ("eos_after_tokens", dict(num_beams=4, eos_after_tokens=3))]
    with Client(llama_eos.address, timeout=TIMEOUT) as c:
        for field, params in cases:
            with pytest.raises(grpc.RpcError) as err:
                c.generate("the king", **params)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, err.value)
            assert field in err.value.details(), (params, err.value.details())


# --- pure rules ------------------------------------------------------------------------------

LIMITS = Limits(vocab_size=1000, max_position_embeddings=1024, max_new_tokens_limit=512,
                default_max_new_tokens=64)


def test_params_select_beam_search_as_generate_does():
    c = resolve({"num_beams": 4}, LIMITS, 10)
    assert (c.strategy, c.num_beams, c.rows, c.early_stopping) == (DecodingStrategy.BEAM, 4, 4,
                                                                   False)
    assert resolve({"num_beams": 4, "do_sample": False}, LIMITS, 10).strategy == "beam"
    assert resolve({"decoding_strategy": "beam"}, LIMITS, 10).num_beams == 4
    assert resolve({"num_beams": 2, "early_stopping": "never"}, LIMITS, 10).early_stopping == "never"
    assert resolve({"num_beams": 2, "early_stopping": "true"}, LIMITS, 10).early_stopping is True
    one = resolve({"num_beams": 1, "length_penalty": 2.0}, LIMITS, 10)
    assert (one.strategy, one.rows) == (DecodingStrategy.GREEDY, 1)


@pytest.mark.parametrize("params, field", [
    ({"num_beams": 0}, "num_beams"), ({"num_beams": 17}, "num_beams"),
    ({"num_beams": 2.5}, "num_beams"), ({"num_beams": 4, "num_return_sequences": 5},
                                        "num_return_sequences"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"num_beams": 4, "do_sample": True}, "do_sample"),
    ({"num_beams": 4, "decoding_strategy": "sample"}, "decoding_strategy"),
    ({"num_beams": 4, "decoding_strategy": "contrastive"}, "decoding_strategy"),
    ({"decoding_strategy": "beam", "num_beams": 1}, "num_beams"),
    ({"num_beams": 4, "early_stopping": 1}, "early_stopping"),
    ({"num_beams": 4, "length_penalty": float("nan")}, "length_penalty"),
    ({"num_beams": 4, "stop": ["x"]}, "stop"), ({"num_beams": 4, "ignore_eos": True}, "ignore_eos"),
    ({"num_beams": 4, "logprobs": 2}, "logprobs"),
])
def test_bad_beam_values_name_the_field(params, field):
    with pytest.raises(RequestError, match=field):
        resolve(params, LIMITS, 10)


def _seq(seq_id: int, prompt: int, num_beams: int = 1) -> Sequence:
    cfg = resolve({"num_beams": num_beams} if num_beams > 1 else {}, LIMITS, prompt)
    tok = reference.load(str(tiny_model("llama")))[0]
    return Sequence(seq_id, str(seq_id), [1] * prompt, cfg, IncrementalDetokenizer(tok), StopMatcher(()))


def test_scheduler_reserves_and_partitions_every_beam_row():
    beam = _seq(1, 10, num_beams=4)
    assert beam.reserved_tokens == 4 * (10 + 64)
    plan = BatchPlanner(max_sparsity=0.0, max_splits=8).plan([beam, _seq(2, 10), _seq(3, 30)],
                                                             [], [])
    assert sorted(map(sorted, plan.groups)) == [[1, 2], [3]]  # one group per length
    assert plan.partition.padding == 0 and sum(map(len, plan.partition.groups)) == 6
    beam.beam_steps = 20  # the beams' rows are now as long as sequence 3
    plan = BatchPlanner(max_sparsity=0.0, max_splits=8).plan([beam, _seq(2, 10), _seq(3, 30)],
                                                             [], [])
    assert sorted(map(sorted, plan.groups)) == [[1, 3], [2]]


# On a machine with a GPU the search also runs on log-probabilities that live there, as a
# worker on cuda gives them (its state tensors once stayed on the host and it failed).
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_beam_search_rules_on_scripted_log_probs(device):
    """k=2, EOS 3, two steps. Step 1: EOS is the best candidate (finished at -0.5) and
    tokens 0 and 1 run on; step 2 reaches max_new_tokens, so the two best candidates
    finish at length 2 and the length penalty decides the order."""
    first = torch.tensor([[-1.0, -2.0, -3.0, -0.5]] * 2, device=device)
    second = torch.tensor([[-0.1, -3.0, -3.0, -3.0]] * 2, device=device)
    expected = {1.0: [([3], -0.5), ([0, 0], -0.55)], 0.0: [([3], -0.5), ([0, 0], -1.1)],
                2.0: [([0, 0], -0.275), ([3], -0.5)]}
    for penalty, result in expected.items():
        search = BeamSearch(BeamParams(num_beams=2, max_new_tokens=2, length_penalty=penalty,
                                       num_return_sequences=2), eos_ids=(3,), device=device)
        assert search.step(first) == [(0, 0), (0, 1)] and not search.done
        search.step(second)
        assert search.done
        assert [(t, pytest.approx(s)) for t, s in search.results()] == result


def test_plan_expansion_keeps_a_requests_rows_together():
    class _Engine:  # expand_plan and expand_release read no engine state
        pass

    beams = BeamSearches(_Engine())
    beams.requests[5] = type("R", (), {"row_ids": [5, extra_row_id(5, 1), extra_row_id(5, 2)]})()
    beams.ended.add(9)
    assert beams.expand_plan([[1, 5], [9]]) == [[1, 5, -161, -162]]
    assert beams.expand_release([5, 9, 2]) == [5, -161, -162, 9, 2]
    assert not beams.requests and not beams.ended


def test_copy_within_copies_only_past_the_shared_prefix():
    shape = KVShape((1,), (2,), (1,), (2,), torch.float32, torch.device("cpu"))
    g = KVGroup(shape)
    g.add_empty_row(1, 8)
    g.add_empty_row(2, 8)
    g.keys[0][0, 0, :6] = torch.arange(12.0).reshape(6, 2)
    g.keys[0][1, 0, :4] = -1.0
    g.fill(0, 6)
    g.fill(1, 4)
    g.copy_within(0, 1, start=3)
    assert g.length(1) == 6
    assert g.keys[0][1, 0, :3].eq(-1.0).all()  # the shared prefix is not copied
    assert torch.equal(g.keys[0][1, 0, 3:6], g.keys[0][0, 0, 3:6])
    assert g.copied_bytes == 3 * shape.bytes_per_token


def test_forks_never_copy_the_prompt_again(llama_dir):
    """In the engine: the first selection copies the prompt into the k - 1 other rows; later
    forks copy at most the generated part of each row."""
    engine = Engine(ModelRunner(str(llama_dir)))
    tok = reference.load(str(llama_dir))[0]
    prompt = tok(reference.prompt_of_tokens(tok, 60, random.Random(4))).input_ids
    k, n = 4, 12
    params = DecodingParams(strategy=DecodingStrategy.BEAM,
                            beam=BeamParams(num_beams=k, max_new_tokens=n))
    per_token = engine.runner.kv_shape.bytes_per_token
    result = engine.step([], [PrefillSpec(1, list(prompt), 0, params)], [[1]])
    assert result.regroup_bytes == (k - 1) * len(prompt) * per_token
    copied = []
    for step in range(1, n):
        result = engine.step([], [], [[1]])
        copied.append(result.regroup_bytes)
        if result.tokens[0].beams is not None:
            break
        assert result.regroup_bytes <= (k - 1) * step * per_token
    assert any(copied), "no beam forked past the first step: the test shows nothing"
