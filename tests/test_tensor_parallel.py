"""Tensor-parallel worker groups over real processes (CPU, gloo, float32): a group of two
ranks answers greedy requests with exactly the tokens of one worker, on every fixture
architecture transformers has a tensor-parallel plan for; one without a plan fails at
start naming it; and kill -9 of rank 1 fails the group visibly, after which the scheduler
re-prefills its requests on the restarted group without changing a token."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal

import pytest
from transformers import AutoTokenizer, LlamaConfig

from client import AsyncClient, Client
from tests import reference
from tests.conftest import needs_onednn_bf16, tiny_model
from tests.test_architectures import odd_model
from worker_service.tensor_parallel import TensorParallelError, shard_kwargs

# Fixture architectures whose transformers config defines a tensor-parallel plan
# (base_model_tp_plan); GPT-2, OPT, GPT-J, Falcon, Bloom and StableLM have none. Llama is
# the test above. The Gemma 3 and StarCoder2 fixtures are multi-query (one key/value
# head), which the plan cannot split over two ranks: they must say so at start.
SHARDABLE = ("qwen2", "mistral", "gpt_neox", "mixtral", "qwen3", "gemma2", "phi", "phi3",
             "llama4")
MULTI_QUERY = ("gemma3", "starcoder2")
FAST = ("gemma2",)  # softcap + alternating windows (experts: test_architectures on one worker)
PROMPT_TOKENS = (2, 9, 23, 41)
NEW_TOKENS = 16
TP2 = {"tensor_parallel_degree": 2, "max_num_batched_tokens": 256}
TIMEOUT = 300


def _generate(address: str, prompts: list[str], **params) -> list[list[int]]:
    async def run():
        async with AsyncClient(address, timeout=TIMEOUT) as c:
            replies = await asyncio.gather(*(c.generate(p, max_new_tokens=NEW_TOKENS, **params)
                                             for p in prompts))
        return [r.token_ids for r in replies]
    return asyncio.run(run())


def _prompts(model_dir, seed: str) -> list[str]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(sum(map(ord, seed)))
    prompts = [reference.prompt_of_tokens(tok, n, rng) for n in PROMPT_TOKENS]
    return prompts + [prompts[-1] + " the king"]  # its first 32 tokens: a prefix-cache hit


def _bytes_per_token(log: str) -> dict[str, int]:
    """Each rank's KV bytes per token, from its load line ('' when it is the only one)."""
    return {m.group(1) or "": int(m.group(2)) for m in re.finditer(
        r"(?:(rank\d) )?worker_service\.model_runner: loaded .*?(\d+) bytes per token", log)}


def _run_batch_then_cache_hit(address: str, prompts: list[str]) -> list[list[int]]:
    # The first four batched together (several groups), then the one that reuses a prefix.
    return _generate(address, prompts[:-1]) + _generate(address, prompts[-1:])


def test_two_ranks_answer_as_one_worker(deploy):
    model = tiny_model("llama")
    prompts = _prompts(model, "llama")
    one = deploy(model, {"max_num_batched_tokens": 256}, max_num_batched_tokens=256)
    expected = _run_batch_then_cache_hit(one.address, prompts)
    one_bytes = _bytes_per_token(one.worker.log.read_text())
    one.stop()
    group = deploy(model, TP2, max_num_batched_tokens=256)
    got = _run_batch_then_cache_hit(group.address, prompts)
    assert got == expected
    assert expected == [reference.greedy(model, p, NEW_TOKENS) for p in prompts]
    # Each rank holds the KV of its own heads: half of one worker's bytes per token.
    log = group.worker.log.read_text()
    assert _bytes_per_token(log) == {"rank0": one_bytes[""] // 2, "rank1": one_bytes[""] // 2}
    assert "tensor-parallel group of 2" in log and "Traceback" not in log
    group.stop()
    assert group.worker.proc.returncode == 0
    assert "rank1 seqserve.worker: rank 1 exits (0)" in group.worker.log.read_text()


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a in FAST else pytest.mark.slow)
                                  for a in SHARDABLE])
def test_architecture_with_a_plan_matches_one_worker(arch, deploy):
    """One worker's greedy tokens equal generate's on these models (test_architectures.py),
    so the group's must too."""
    model = odd_model(arch)
    prompts = _prompts(model, arch)
    group = deploy(model, TP2, max_num_batched_tokens=256)
    got = _run_batch_then_cache_hit(group.address, prompts)
    assert got == [reference.greedy(model, p, NEW_TOKENS) for p in prompts], arch
    assert "Traceback" not in group.worker.log.read_text()


def test_architecture_without_a_plan_fails_at_start_naming_it(deploy):
    with pytest.raises(RuntimeError) as err:
        deploy(tiny_model("gpt2"), TP2)
    assert ("GPT2LMHeadModel cannot run with tensor_parallel_degree=2: transformers"
            in str(err.value)), str(err.value)
    assert "defines no tensor-parallel plan" in str(err.value)


@pytest.mark.parametrize("arch", MULTI_QUERY)
def test_one_key_value_head_fails_at_start_naming_it(arch, deploy):
    with pytest.raises(RuntimeError) as err:
        deploy(odd_model(arch), TP2)
    assert re.search(r"\w+ForCausalLM cannot run with tensor_parallel_degree=2: its "
                     r"num_key_value_heads=1 does not divide among 2 ranks", str(err.value))


def test_heads_that_do_not_divide_are_refused():
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                         architectures=["LlamaForCausalLM"])
    with pytest.raises(TensorParallelError, match="num_key_value_heads=3 does not divide"):
        shard_kwargs(config, 2)
    assert shard_kwargs(config, 3)["distributed_config"].tp_size == 3
    assert shard_kwargs(config, 1) == {}


def _prepacked_rank(rank: int, init: str, model: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from worker_service.kernels.sharded_prepack import ShardPrepackedLinear
    from worker_service.model_runner import ModelRunner

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23]])
    logits = []
    for prepack in (True, False):
        runner = ModelRunner(model, dtype="bfloat16", prepack=prepack, tensor_parallel_degree=2)
        with torch.inference_mode():
            hidden = runner.base(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 use_cache=False).last_hidden_state
            logits.append(runner.logits(hidden))
        layer = runner.model.model.layers[0]
        kinds = {type(layer.self_attn.q_proj).__name__, type(layer.mlp.down_proj).__name__,
                 type(runner.lm_head).__name__}
        assert kinds == ({ShardPrepackedLinear.__name__} if prepack else {"Linear"}), kinds
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(torch.equal(*logits)))
    dist.destroy_process_group()


@needs_onednn_bf16
def test_prepacked_shards_compute_what_the_plain_shards_do(tmp_path):
    """bfloat16 under tensor parallelism: each rank's column- and row-wise layers and the
    gathered output layer run prepacked shards, with the very bits of transformers' own."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "equal")
    mp.spawn(_prepacked_rank, args=(f"file://{tmp_path}/rendezvous", str(tiny_model("llama")),
                                    out), nprocs=2)
    assert [open(f"{out}.{r}").read() for r in range(2)] == ["True", "True"]


@pytest.mark.slow  # 15-16 s; make test keeps under its 15 minutes
def test_killing_rank_one_fails_the_group_and_the_scheduler_recovers(deploy):
    model = tiny_model("llama")
    d = deploy(model, TP2, max_num_batched_tokens=256)
    prompts = [("the king " * (i + 1) + "dragon", 48) for i in range(4)]
    sampled = ("the river flows", 40, 11)
    seen = asyncio.Event()

    async def scenario():
        async with AsyncClient(d.address, timeout=TIMEOUT) as c:
            async def stream(p, n, **params):
                out = []
                async for ch in c.stream(p, max_new_tokens=n, ignore_eos=True, **params):
                    if ch.token_id is not None:
                        out.append(ch.token_id)
                        if len(out) == 8:
                            seen.set()
                return out

            async def crash():
                await seen.wait()
                os.kill(d.worker.ports["follower_pids"][0], signal.SIGKILL)
                # Rank 0 must notice and exit: the group's failure is the worker's.
                code = await asyncio.to_thread(d.worker.proc.wait, 60)
                log = d.worker.log.read_text()
                await asyncio.to_thread(d.start_worker, d.worker.ports["grpc"])
                return code, log

            return await asyncio.gather(
                *(stream(p, n) for p, n in prompts),
                stream(sampled[0], sampled[1], decoding_strategy="sample", seed=sampled[2],
                       temperature=0.9, top_k=40), crash())

    *greedy, got_sampled, (code, log) = asyncio.run(scenario())
    # Rank 0 saw it first either way: its watchdog (rank 1 exited), or a collective.
    assert code == 1 and "the tensor-parallel group has failed" in log, log[-3000:]
    eos = reference.load(str(model))[0].eos_token_id
    for (p, n), got in zip(prompts, greedy):
        assert len(got) == n
        assert reference.same_until_eos(got, reference.greedy(model, p, n), eos)
    with Client(d.address, timeout=TIMEOUT) as c:  # the sampled request again, undisturbed
        again = c.generate(sampled[0], max_new_tokens=sampled[1], ignore_eos=True,
                           decoding_strategy="sample", seed=sampled[2], temperature=0.9,
                           top_k=40)
    assert got_sampled == again.token_ids
