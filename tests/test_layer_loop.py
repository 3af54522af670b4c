"""The plain layer loop (worker_service/layer_loop.py) against the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from tests.conftest import tiny_model
from worker_service import layer_loop
from worker_service.fixtures import make_model
from worker_service.kv_groups import KVGroup
from worker_service.model_runner import ModelRunner
from worker_service.packed_batch import PackedBatch


def _runner(arch: str, dtype: str, size: str = "tiny") -> ModelRunner:
    path = tiny_model(arch)
    if dtype == "bfloat16" or size != "tiny":
        path = make_model(path.parent / f"{size}-{arch}-{dtype}", arch=arch, size=size,
                          dtype=dtype, seed=0)
    return ModelRunner(str(path), dtype=dtype)


def _mixed_batches(runner: ModelRunner) -> tuple[list[PackedBatch], KVGroup]:
    """Steps of every segment kind, in groups whose rows hold KV of earlier steps:
    decoding rows of two lengths, a whole prompt, a prompt behind a cached prefix,
    and contrastive candidates (a tree)."""
    vocab = runner.facts.vocab_size
    ids = lambda n, s: [(i * 7919 + s) % vocab for i in range(n)]  # noqa: E731
    group = KVGroup(runner.kv_shape)
    for row in range(4):
        group.add_empty_row(row, 64)
    for buffer in (*group.keys, *group.values):
        buffer.zero_()  # compared whole below; the native loops need no zero fill
    first = PackedBatch(runner.device, runner.layer_attention)
    first.add_row(group, 0, ids(20, 1), 0)
    first.add_row(group, 1, ids(9, 2), 0)
    first.add_row(group, 2, ids(12, 3), 0)
    steps = [first]
    second = PackedBatch(runner.device, runner.layer_attention)
    second.add_decode(group, 0, 2, ids(2, 4))  # rows 0 and 1, lengths 20 and 9
    second.add_row(group, 3, ids(15, 5), 0)
    second.add_row(group, 2, ids(6, 6), 12)  # the rest of a prompt after 12 cached slots
    steps.append(second)
    third = PackedBatch(runner.device, runner.layer_attention)
    third.add_row(group, 1, ids(3, 7), 10, tree=True)
    third.add_decode(group, 2, 4, ids(2, 8))
    steps.append(third)
    return steps, group


def _run_all(runner: ModelRunner, loop) -> list[torch.Tensor]:
    batches, group = _mixed_batches(runner)
    fills = [(0, 20), (1, 9), (2, 12)], [(0, 21), (1, 10), (3, 15), (2, 18)]
    out = []
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            out.append(runner._packed(batch, loop))
            for row, length in fills[i] if i < len(fills) else ():
                group.fill(row, length)
            out.extend(b.clone() for b in (*group.keys, *group.values))
    return out


@pytest.mark.parametrize("arch,dtype,size", [
    ("llama", "bfloat16", "tiny"), ("qwen2", "bfloat16", "tiny"), ("llama", "float32", "tiny"),
    ("mistral", "bfloat16", "odd"), ("qwen2", "float32", "odd")])
def test_loop_gives_the_bits_of_the_models_forward(arch, dtype, size):
    """Hidden states and the keys and values written, over steps of every segment kind
    (the "odd" fixtures: head size 12 and a sliding window of 8 slots, which the batch
    applies per layer)."""
    runner = _runner(arch, dtype, size)
    assert runner.layer_loop is not None, "the loop applies to Llama-family code"
    got, want = _run_all(runner, runner.layer_loop), _run_all(runner, None)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3", "gemma2", "phi3"])
def test_other_code_runs_the_models_own_forward(arch):
    runner = _runner(arch, "float32")
    assert runner.layer_loop is None
    assert layer_loop.unsupported(runner.base) is not None


def test_switch_and_changed_code_keep_the_models_forward(monkeypatch):
    runner = _runner("llama", "float32")
    assert layer_loop.unsupported(runner.base) is None
    monkeypatch.setenv(layer_loop.SWITCH, "0")
    assert layer_loop.unsupported(runner.base) == f"{layer_loop.SWITCH}=0"
    monkeypatch.delenv(layer_loop.SWITCH)

    class Scaled(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            return 2 * super().forward(hidden_states, *args, **kwargs)

    layer = runner.base.layers[1]
    layer.__class__ = Scaled
    assert "LlamaDecoderLayer" in layer_loop.unsupported(runner.base)


def test_hooks_or_an_instance_forward_on_replaced_code_keep_the_models_forward():
    runner = _runner("llama", "float32")
    attn = runner.base.layers[0].self_attn
    handle = attn.register_forward_hook(lambda m, i, o: None)
    assert "hooks" in layer_loop.unsupported(runner.base)
    handle.remove()
    runner.base.forward = runner.base.forward  # an instance attribute, as accelerate sets
    assert "own forward" in layer_loop.unsupported(runner.base)


def test_a_loop_that_differs_on_the_probe_is_not_used(monkeypatch):
    forward = layer_loop.LayerLoop.forward
    monkeypatch.setattr(layer_loop.LayerLoop, "forward",
                        lambda self, *a: forward(self, *a) * 1.001)
    assert _runner("llama", "float32").layer_loop is None


def test_a_hooked_module_is_called_through_its_hooks():
    runner = _runner("llama", "float32")
    seen = []
    runner.base.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    loop = layer_loop.LayerLoop(runner.base)
    batches, _ = _mixed_batches(runner)
    with torch.inference_mode():
        runner._packed(batches[0], loop)
    assert seen == [torch.Size([1, 41, runner.model.config.hidden_size])]
