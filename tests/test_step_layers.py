"""A step's layers in one C call (kernels/step_layers.py) against the layer
loop's calls from Python, on generated bfloat16 models: in bfloat16 where the CPU has
AVX512-BF16, in float32 over the bfloat16 weights where it has no native bfloat16 (AVX2)."""

from __future__ import annotations

import pytest
import torch

from worker_service.kernels import bf16_weights, dpbf16_linear, linear_prepack, step_layers

# The product library a bfloat16 model's layers run here, if one the C call takes: the
# C bfloat16 product (AVX512-BF16), or the float32 one over bfloat16 weights where oneDNN
# has no bfloat16 (AVX2); elsewhere (oneDNN's bfloat16 on AVX512 without BF16) none.
PRODUCTS = (dpbf16_linear if dpbf16_linear.library() is not None
            else bf16_weights if (bf16_weights.library() is not None
                                  and not linear_prepack.runs(torch.bfloat16))
            else None)
needs_library = pytest.mark.skipif(
    PRODUCTS is None or step_layers.library() is None,
    reason="no C product the call takes or no C compiler here: steps call each layer")


def _runner(tmp_path, arch: str, size: str, seed: int = 1):
    from worker_service.fixtures import make_model
    from worker_service.model_runner import ModelRunner

    model = make_model(tmp_path / f"{arch}-{size}", arch=arch, size=size, dtype="bfloat16",
                       seed=seed)
    return ModelRunner(str(model), dtype="bfloat16")


def _steps(runner, vocab: int, steps: int, sampled_only: bool = False,
           kept: list | None = None) -> list[torch.Tensor]:
    """A served run in miniature over two KV groups: a prompt's first chunk alone (8 tokens,
    no token sampled); three prompts in one step (one long enough for the tiled prompt
    loop); its second chunk (no token sampled either) beside those rows' decoding; its
    third chunk (40 tokens after its slots 0-19: the tiled loop) and a whole prompt beside
    them; then `steps` decoding steps over all five rows. Every step's hidden states
    [tokens, hidden], or with `sampled_only` only those the steps sample from (a prompt's
    last token, every decoding row), read through `runner.forward(batch, rows)`; `kept`
    gets each step's sampled token indices."""
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    def ids(n, salt):
        return [(i * 7919 + salt * 131 + 11) % (vocab - 3) + 3 for i in range(n)]

    a, b = KVGroup(runner.kv_shape), KVGroup(runner.kv_shape)
    room = 60 + steps + 4
    for r in range(3):
        a.add_empty_row(r, room)
    for r in range(2):
        b.add_empty_row(r, room)
    out, nxt = [], {}

    def run(batch, rows, unsampled=()):
        """rows: (group, row, new length) for each segment in order, whose last token
        yields the row's next token unless its segment's index is in `unsampled`."""
        ends = [seg.token_start + seg.num_tokens for seg in batch.segments]
        sampled = []
        for j, (seg, end) in enumerate(zip(batch.segments, ends)):
            if hasattr(seg, "row_start"):
                sampled += range(seg.token_start, end)
            elif j not in unsampled:
                sampled.append(end - 1)
        if kept is not None:
            kept.append(sampled)
        hidden = runner.forward(batch, sampled if sampled_only else None)
        out.append(hidden)
        at = {t: i if sampled_only else t for i, t in enumerate(sampled)}
        logits = runner.logits(hidden)
        k = 0
        for j, (seg, end) in enumerate(zip(batch.segments, ends)):
            if hasattr(seg, "row_start"):
                for i in range(seg.num_tokens):
                    g, r, n = rows[k]
                    nxt[id(g), r] = int(logits[at[seg.token_start + i]].argmax())
                    g.fill(r, n)
                    k += 1
            else:
                g, r, n = rows[k]
                if j not in unsampled:
                    nxt[id(g), r] = int(logits[at[end - 1]].argmax())
                g.fill(r, n)
                k += 1

    def decode(batch, g):
        batch.add_decode(g, 0, g.rows, [nxt[id(g), r] for r in range(g.rows)])
        return [(g, r, g.length(r) + 1) for r in range(g.rows)]

    with torch.inference_mode():
        long_prompt = ids(60, 7)
        batch = PackedBatch(runner.device, runner.layer_attention)
        batch.add_row(b, 0, long_prompt[:8], 0)
        run(batch, [(b, 0, 8)], unsampled=(0,))
        batch = PackedBatch(runner.device, runner.layer_attention)
        lengths = (37, 5, 21)
        for r, n in enumerate(lengths):
            batch.add_row(a, r, ids(n, r), 0)
        run(batch, [(a, r, n) for r, n in enumerate(lengths)])
        batch = PackedBatch(runner.device, runner.layer_attention)
        rows = decode(batch, a)
        batch.add_row(b, 0, long_prompt[8:20], 8)
        run(batch, rows + [(b, 0, 20)], unsampled=(1,))
        batch = PackedBatch(runner.device, runner.layer_attention)
        rows = decode(batch, a)
        batch.add_row(b, 0, long_prompt[20:], 20)
        batch.add_row(b, 1, ids(12, 9), 0)
        run(batch, rows + [(b, 0, 60), (b, 1, 12)])
        for _ in range(steps):
            batch = PackedBatch(runner.device, runner.layer_attention)
            rows = decode(batch, a) + decode(batch, b)
            run(batch, rows)
    return out


@needs_library
@pytest.mark.parametrize("arch,size", [("llama", "tiny"), ("qwen2", "odd"), ("mistral", "odd"),
                                       ("llama", "wide")])
def test_steps_in_one_call_have_the_bits_of_the_per_layer_calls(tmp_path, arch, size,
                                                                 monkeypatch):
    """Every step's hidden states, prompts, chunks and decoding rows, equal bit for bit.
    Qwen2 brings q/k/v biases and a sliding window above layer 0, Mistral a window on every
    layer, the odd size a head of 12 (the attention's generic loops), the wide one an MLP of
    2048."""
    runner = _runner(tmp_path, arch, size)
    loop = runner.layer_loop
    assert loop is not None and loop.step_layers is not None
    counted: list = []
    forward = step_layers.StepLayers.forward

    def counting(self, *args):
        counted.append(1)
        return forward(self, *args)

    monkeypatch.setattr(step_layers.StepLayers, "forward", counting)
    vocab = runner.facts.vocab_size
    fast = _steps(runner, vocab, 12)
    assert len(counted) == 16  # every step
    call, loop.step_layers = loop.step_layers, None
    slow = _steps(runner, vocab, 12)
    loop.step_layers = call
    assert len(counted) == 16
    assert len(fast) == len(slow) == 16
    for i, (f, s) in enumerate(zip(fast, slow)):
        assert torch.equal(f, s), f"step {i}"


@needs_library
@pytest.mark.parametrize("arch,size", [("llama", "tiny"), ("qwen2", "odd"), ("mistral", "odd")])
def test_a_step_read_at_its_sampled_rows_gives_them_the_bits_of_the_whole(tmp_path, arch, size):
    """With the rows the engine samples from, the C call leaves the other tokens' last
    layer out but for its keys and values: the sampled rows keep their bits (prompt pieces
    after a cached part, windows, a step that samples nothing), and so does every later
    step, which reads the keys and values the pruned layer wrote."""
    runner = _runner(tmp_path, arch, size)
    vocab = runner.facts.vocab_size
    whole_kept, part_kept = [], []
    whole = _steps(runner, vocab, 6, kept=whole_kept)
    calls: list = []
    forward = step_layers.StepLayers.forward

    def recording(self, batch, hidden, cos, sin, rows=None, between=None):
        out = forward(self, batch, hidden, cos, sin, rows, between)
        calls.append((hidden.shape[1], rows, out.shape[1]))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_layers.StepLayers, "forward", recording)
        part = _steps(runner, vocab, 6, sampled_only=True, kept=part_kept)
    assert whole_kept == part_kept
    assert [c[1] for c in calls] == part_kept  # every step through the C call, with rows
    assert calls[0] == (8, [], 0)  # a lone chunk: nothing sampled
    assert calls[1][0] == 63 and calls[1][2] == 3  # three prompts: their last tokens
    for i, (w, p, rows) in enumerate(zip(whole, part, whole_kept)):
        assert p.shape[0] == len(rows)
        assert torch.equal(w[rows], p), f"step {i}"


@needs_library
def test_greedy_tokens_equal_the_unprepacked_forwards(tmp_path, monkeypatch):
    """Against the model's plain forwards: torch's products (and, over bfloat16 weights
    computed in float32, a float32 copy of the model with torch's SiLU)."""
    from worker_service.model_runner import ModelRunner

    runner = _runner(tmp_path, "llama", "tiny", seed=2)
    monkeypatch.setattr(bf16_weights, "library", lambda: None)
    plain = ModelRunner(str(tmp_path / "llama-tiny"), dtype="bfloat16", prepack=False)
    monkeypatch.undo()
    assert runner.layer_loop.step_layers is not None
    assert plain.layer_loop is None or plain.layer_loop.step_layers is None
    got = _steps(runner, runner.facts.vocab_size, 16)
    want = _steps(plain, runner.facts.vocab_size, 16)
    assert [runner.logits(h).argmax(-1).tolist() for h in got] == \
        [plain.logits(h).argmax(-1).tolist() for h in want]


def _decode_batch(runner, group):
    from worker_service.packed_batch import PackedBatch

    batch = PackedBatch(runner.device, runner.layer_attention)
    batch.add_decode(group, 0, 1, [5])
    return batch


@needs_library
def test_candidate_trees_and_autograd_keep_the_per_layer_calls(tmp_path):
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    runner = _runner(tmp_path, "llama", "tiny")
    call = runner.layer_loop.step_layers
    dtype = call.dtype  # bfloat16, or float32 over bfloat16 weights
    group = KVGroup(runner.kv_shape)
    for r in range(2):
        group.add_empty_row(r, 32)
    group.fill(0, 4)
    hidden = torch.zeros(1, 1, 64, dtype=dtype)
    cos = torch.zeros(1, 1, 16, dtype=dtype)
    assert not call.takes(_decode_batch(runner, group), hidden, cos)  # autograd on
    with torch.inference_mode():
        decode = _decode_batch(runner, group)
        assert call.takes(decode, hidden, cos)
        mixed = PackedBatch(runner.device, runner.layer_attention)
        mixed.add_decode(group, 0, 1, [5])
        mixed.add_row(group, 1, [5, 6], 0)
        assert call.takes(mixed, torch.zeros(1, 3, 64, dtype=dtype),
                          torch.zeros(1, 3, 16, dtype=dtype))
        tree = PackedBatch(runner.device, runner.layer_attention)
        tree.add_row(group, 0, [5, 6], 4, tree=True)
        assert not call.takes(tree, torch.zeros(1, 2, 64, dtype=dtype),
                              torch.zeros(1, 2, 16, dtype=dtype))
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        assert not call.takes(decode, hidden.to(other), cos)


@needs_library
def test_layers_without_the_c_pieces_or_with_the_switch_off_keep_the_per_layer_calls(
        tmp_path, monkeypatch):
    from worker_service.model_runner import ModelRunner

    _runner(tmp_path, "llama", "tiny")
    model = str(tmp_path / "llama-tiny")
    monkeypatch.setattr(step_layers, "library", lambda: None)
    loop = ModelRunner(model, dtype="bfloat16").layer_loop
    assert loop is not None and loop.step_layers is None
    monkeypatch.undo()
    monkeypatch.setattr(PRODUCTS, "library", lambda: None)  # products on oneDNN
    loop = ModelRunner(model, dtype="bfloat16").layer_loop
    assert loop is not None and loop.step_layers is None
    monkeypatch.undo()
    assert ModelRunner(model, dtype="bfloat16").layer_loop.step_layers is not None
    # float32 models keep the per-layer calls
    loop = ModelRunner(model, dtype="float32").layer_loop
    assert loop is None or loop.step_layers is None
