"""A decoding step's layers in one C call (kernels/decode_layers.py) against the layer
loop's calls from Python, on generated bfloat16 models."""

from __future__ import annotations

import pytest
import torch

from worker_service.kernels import decode_layers, dpbf16_linear

needs_library = pytest.mark.skipif(
    dpbf16_linear.library() is None or decode_layers.library() is None,
    reason="no AVX512-BF16 or no C compiler here: decoding steps call each layer")


def _runner(tmp_path, arch: str, size: str, seed: int = 1):
    from worker_service.fixtures import make_model
    from worker_service.model_runner import ModelRunner

    model = make_model(tmp_path / f"{arch}-{size}", arch=arch, size=size, dtype="bfloat16",
                       seed=seed)
    return ModelRunner(str(model), dtype="bfloat16")


def _steps(runner, prompts: list[list[list[int]]], steps: int, counted: list) -> torch.Tensor:
    """Prefill `prompts` (one list of rows per KV group), then `steps` greedy decoding
    steps over all groups in one batch; the logits of every step, stacked. `counted`
    gets one entry per step that took the C call."""
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    groups = [KVGroup(runner.kv_shape) for _ in prompts]
    last = {}
    with torch.inference_mode():
        for g, (group, rows) in enumerate(zip(groups, prompts)):
            for r, ids in enumerate(rows):
                group.add_empty_row(r, len(ids) + steps + 1)
                batch = PackedBatch(runner.device, runner.layer_attention)
                batch.add_row(group, r, ids, 0)
                last[g, r] = int(runner.logits(runner.forward(batch)[-1:]).argmax())
                group.fill(r, len(ids))
        out = []
        for _ in range(steps):
            batch = PackedBatch(runner.device, runner.layer_attention)
            for g, group in enumerate(groups):
                batch.add_decode(group, 0, group.rows, [last[g, r] for r in range(group.rows)])
            before = len(counted)
            logits = runner.logits(runner.forward(batch))
            assert len(counted) in (before, before + 1)
            out.append(logits)
            i = 0
            for g, group in enumerate(groups):
                for r in range(group.rows):
                    last[g, r] = int(logits[i].argmax())
                    i += 1
                    group.advance(r, r + 1)
    return torch.stack(out)


def _prompts(vocab: int, lengths: list[list[int]]) -> list[list[list[int]]]:
    return [[[(i * 7919 + g * 131 + r * 31 + 11) % (vocab - 3) + 3 for i in range(n)]
             for r, n in enumerate(rows)] for g, rows in enumerate(lengths)]


@needs_library
@pytest.mark.parametrize("arch,size", [("llama", "tiny"), ("qwen2", "odd"), ("mistral", "odd"),
                                       ("llama", "wide")])
def test_decoding_steps_in_one_call_have_the_bits_of_the_per_layer_calls(tmp_path, arch, size,
                                                                        monkeypatch):
    """Rows of two KV groups at different lengths, 12 steps: the logits of every step equal
    bit for bit. Qwen2 brings q/k/v biases and a sliding window above layer 0, Mistral a
    window on every layer, the odd size a head of 12 (the attention's generic loop), the
    wide one an MLP of 2048."""
    runner = _runner(tmp_path, arch, size)
    loop = runner.layer_loop
    assert loop is not None and loop.decode_layers is not None
    counted: list = []
    forward = decode_layers.DecodeLayers.forward

    def counting(self, *args):
        counted.append(1)
        return forward(self, *args)

    monkeypatch.setattr(decode_layers.DecodeLayers, "forward", counting)
    prompts = _prompts(runner.facts.vocab_size, [[37, 5, 21], [12, 30]])
    fast = _steps(runner, prompts, 12, counted)
    assert len(counted) == 12  # every decoding step, no prompt
    call, loop.decode_layers = loop.decode_layers, None
    slow = _steps(runner, prompts, 12, counted)
    loop.decode_layers = call
    assert len(counted) == 12
    assert torch.equal(fast, slow)


@needs_library
def test_greedy_tokens_equal_the_unprepacked_forwards(tmp_path):
    from worker_service.model_runner import ModelRunner

    runner = _runner(tmp_path, "llama", "tiny", seed=2)
    plain = ModelRunner(str(tmp_path / "llama-tiny"), dtype="bfloat16", prepack=False)
    assert runner.layer_loop.decode_layers is not None
    assert plain.layer_loop is None or plain.layer_loop.decode_layers is None
    prompts = _prompts(runner.facts.vocab_size, [[40, 9]])
    got = _steps(runner, prompts, 16, [])
    want = _steps(plain, prompts, 16, [])
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _decode_batch(runner, group):
    from worker_service.packed_batch import PackedBatch

    batch = PackedBatch(runner.device, runner.layer_attention)
    batch.add_decode(group, 0, 1, [5])
    return batch


@needs_library
def test_prompts_and_candidate_trees_keep_the_per_layer_calls(tmp_path):
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    runner = _runner(tmp_path, "llama", "tiny")
    call = runner.layer_loop.decode_layers
    group = KVGroup(runner.kv_shape)
    for r in range(2):
        group.add_empty_row(r, 32)
    group.fill(0, 4)
    hidden = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cos = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    assert not call.takes(_decode_batch(runner, group), hidden, cos)  # autograd on
    with torch.inference_mode():
        decode = _decode_batch(runner, group)
        assert call.takes(decode, hidden, cos)
        mixed = PackedBatch(runner.device, runner.layer_attention)
        mixed.add_decode(group, 0, 1, [5])
        mixed.add_row(group, 1, [5, 6], 0)
        assert not call.takes(mixed, torch.zeros(1, 3, 64, dtype=torch.bfloat16),
                              torch.zeros(1, 3, 16, dtype=torch.bfloat16))
        tree = PackedBatch(runner.device, runner.layer_attention)
        tree.add_row(group, 0, [5, 6], 4, tree=True)
        assert not call.takes(tree, torch.zeros(1, 2, 64, dtype=torch.bfloat16),
                              torch.zeros(1, 2, 16, dtype=torch.bfloat16))
        assert not call.takes(decode, hidden.float(), cos)


@needs_library
def test_layers_without_the_c_pieces_or_with_the_switch_off_keep_the_per_layer_calls(
        tmp_path, monkeypatch):
    from worker_service.model_runner import ModelRunner

    _runner(tmp_path, "llama", "tiny")
    model = str(tmp_path / "llama-tiny")
    monkeypatch.setattr(decode_layers, "library", lambda: None)
    loop = ModelRunner(model, dtype="bfloat16").layer_loop
    assert loop is not None and loop.decode_layers is None
    monkeypatch.undo()
    monkeypatch.setattr(dpbf16_linear, "library", lambda: None)  # products on oneDNN
    loop = ModelRunner(model, dtype="bfloat16").layer_loop
    assert loop is not None and loop.decode_layers is None
    monkeypatch.undo()
    assert ModelRunner(model, dtype="bfloat16").layer_loop.decode_layers is not None
    # float32 models keep the per-layer calls
    loop = ModelRunner(model, dtype="float32").layer_loop
    assert loop is None or loop.decode_layers is None
