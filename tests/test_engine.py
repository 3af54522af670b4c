"""The worker engine in-process: group caches, regrouping and padding keep outputs exact."""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch

from tests import reference
from tests.conftest import ARCHITECTURES, needs_amx, needs_onednn_bf16, tiny_model, without_amx
from worker_service.engine import Engine, StepError
from worker_service.model_runner import ModelRunner
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec


def _reference(model_dir, ids: list[int], n: int) -> list[int]:
    _, model = reference.load(str(model_dir))
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, pad_token_id=1)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_random_plans_match_generate(arch):
    model_dir = tiny_model(arch)
    check_random_plans(model_dir, Engine(ModelRunner(str(model_dir))))


def check_random_plans(model_dir, engine: Engine) -> None:
    """Sequences join two per step and are shuffled into 1-3 random groups every step,
    which forces merges, splits and row moves; every output still equals generate."""
    rng = random.Random(0)
    reqs = [([rng.randint(3, 999) for _ in range(rng.randint(1, 150))], rng.randint(1, 24))
            for _ in range(12)]
    got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    running: set[int] = set()
    pending = list(range(len(reqs)))
    copied = 0
    while pending or running:
        new = []
        for _ in range(2):
            if pending:
                i = pending.pop(0)
                new.append(PrefillSpec(i, reqs[i][0], 0, DecodingParams()))
                running.add(i)
        ids = sorted(running)
        rng.shuffle(ids)
        k = rng.randint(1, 3)
        plan = [p for p in (ids[j::k] for j in range(k)) if p]
        result = engine.step([], new, plan)
        copied += result.regroup_bytes
        assert len(result.tokens) == len(ids)
        for t in result.tokens:
            got[t.seq_id].append(t.token_id)
            if len(got[t.seq_id]) == reqs[t.seq_id][1]:
                running.discard(t.seq_id)
                engine.release(t.seq_id)
    assert copied > 0, "the random plans should have moved rows"
    eos = engine.runner.facts.eos_token_ids[0]
    for i, (ids, n) in enumerate(reqs):
        # The engine has no notion of EOS (the scheduler ends sequences), so it runs on.
        assert reference.same_until_eos(got[i], _reference(model_dir, ids, n), eos), f"request {i}"


def test_unchanged_plan_copies_nothing(llama_dir):
    engine = Engine(ModelRunner(str(llama_dir)))
    seqs = [PrefillSpec(i, list(range(5, 5 + 10 * (i + 1))), 0, DecodingParams()) for i in range(4)]
    plan = [[0, 1], [2, 3]]
    engine.step([], seqs, plan)
    for _ in range(80):  # crosses the 64-slot allocation boundary at least once
        result = engine.step([], [], plan)
        slots, tokens = engine.kv_usage()
        assert result.kv_slots == slots and result.kv_tokens == tokens
    # Growth reallocations copy; steady decoding between them does not.
    quiet = [engine.step([], [], plan).regroup_bytes for _ in range(5)]
    assert quiet == [0] * 5


def test_a_regroup_keeps_the_longest_rows_in_place(llama_dir):
    """Planned groups take over the existing group they share the most KV slots with, not
    the most rows: two short rows move rather than one long one."""
    engine = Engine(ModelRunner(str(llama_dir)))
    lengths = {0: 120, 1: 5, 2: 6, 3: 7}
    engine.step([], [PrefillSpec(i, list(range(5, 5 + n)), 0, DecodingParams())
                     for i, n in lengths.items()], [[0, 1, 2], [3]])
    per_token = engine.runner.kv_shape.bytes_per_token
    result = engine.step([], [], [[0, 3], [1, 2]])
    assert engine.group_of[0] is not engine.group_of[1]
    # rows 1 and 2 leave the long row's group, row 3 joins it and fills a hole: 25 slots;
    # the long row moving instead would copy its 120
    assert result.regroup_bytes < 60 * per_token


def test_step_rejects_inconsistent_plans(llama_dir):
    engine = Engine(ModelRunner(str(llama_dir)))
    engine.step([], [PrefillSpec(1, [5, 6, 7], 0, DecodingParams())], [[1]])
    with pytest.raises(StepError, match="unknown"):
        engine.step([], [], [[1, 2]])
    with pytest.raises(StepError, match="more than one group"):
        engine.step([], [], [[1], [1]])
    with pytest.raises(StepError, match="in no group"):
        engine.step([], [], [])
    with pytest.raises(StepError, match="already exists"):
        engine.step([], [PrefillSpec(1, [5], 0, DecodingParams())], [[1]])


def _greedy_steps(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    engine = Engine(runner)
    got = [t.token_id for t in engine.step(
        [], [PrefillSpec(0, prompt, 0, DecodingParams())], [[0]]).tokens]
    for _ in range(n - 1):
        got += [t.token_id for t in engine.step([], [], [[0]]).tokens]
    return got


def test_bfloat16_without_a_onednn_path_computes_in_float32(monkeypatch, caplog):
    """Where oneDNN has no bfloat16 path (AVX2-only CPUs) torch's own bfloat16 products run
    4-6x slower than float32's, so the worker computes a bfloat16 checkpoint in float32,
    which holds every weight exactly: greedy tokens are generate's on the float32 copy.
    The weights stay bfloat16 where the C products build (kernels/bf16_weights.py), else
    the model is copied to float32, else (no memory for the copy) it stays bfloat16."""
    from worker_service import cpu_dtype
    from worker_service.fixtures import make_model
    from worker_service.kernels import bf16_weights, linear_prepack

    model_dir = make_model(tiny_model("llama").parent / "tiny-llama-bf16", arch="llama",
                           size="tiny", dtype="bfloat16", seed=0)
    monkeypatch.setattr(linear_prepack, "runs", lambda dtype: dtype == torch.float32)
    prompt = [(i * 37 + 5) % 900 + 3 for i in range(23)]
    expected = _reference(model_dir, prompt, 12)

    def load():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="worker_service.cpu_dtype"):
            return ModelRunner(str(model_dir), dtype="bfloat16")

    if bf16_weights.library() is not None:
        runner = load()
        # 2 layers x (q/k/v, o, gate/up, down) + embeddings + output layer
        assert ("float32, with the weights of its linear layers and embeddings kept in "
                "bfloat16 (kernels/bf16_weights.py: 10 modules; q, k and v stacked into one "
                "product in 2 layers, gate and up in 2)" in caplog.text)
        attn = runner.model.model.layers[0].self_attn
        assert isinstance(attn.k_proj.product.linear, bf16_weights.Bf16WeightLinear)
        assert runner.lm_head.weight.dtype == torch.bfloat16
        assert (runner.dtype, runner.kv_dtype, runner.facts.dtype) == (
            torch.float32, torch.float32, "float32")
        assert _greedy_steps(runner, prompt, 12) == expected
    monkeypatch.setattr(bf16_weights, "library", lambda: None)
    runner = load()
    assert "no native bfloat16" in caplog.text and "(exact conversion" in caplog.text
    assert runner.lm_head.weight.dtype == torch.float32
    assert (runner.dtype, runner.kv_dtype, runner.facts.dtype) == (
        torch.float32, torch.float32, "float32")
    assert _greedy_steps(runner, prompt, 12) == expected
    monkeypatch.setattr(cpu_dtype, "available_memory", lambda: 1024)
    assert load().dtype == torch.bfloat16 and "the model stays in bfloat16" in caplog.text


@needs_onednn_bf16
def test_prepacked_linears_change_no_bit(monkeypatch):
    """bfloat16 on CPU runs the linear layers with oneDNN-prepacked weights (where the CPU
    has no AVX512-BF16, or the C product is off); the outputs of a step (prefills and
    decodes of several groups) equal those of plain F.linear exactly: the same tokens with
    the same log-probabilities."""
    from worker_service.fixtures import make_model
    from worker_service.kernels import dpbf16_linear
    from worker_service.kernels.linear_prepack import PrepackedLinear

    monkeypatch.setattr(dpbf16_linear, "library", lambda: None)

    model_dir = make_model(tiny_model("llama").parent / "tiny-llama-bf16", arch="llama",
                           size="tiny", dtype="bfloat16", seed=0)
    packed = ModelRunner(str(model_dir), dtype="bfloat16", prepack=True)
    plain = ModelRunner(str(model_dir), dtype="bfloat16", prepack=False)
    assert any(isinstance(m, PrepackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in plain.model.modules())
    rng = random.Random(1)
    prompts = [[rng.randint(3, 999) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    outs = []
    for runner in (packed, plain):
        engine = Engine(runner)
        tokens = []
        engine.step([], [PrefillSpec(i, p, 0, DecodingParams(logprobs=5)) for i, p in enumerate(prompts[:3])],
                    [[0, 1], [2]])
        for step in range(6):
            new = [PrefillSpec(3 + step, prompts[3 + step], 0, DecodingParams(logprobs=5))] if step < 3 else []
            live = sorted(engine.sequences) + [n.seq_id for n in new]
            result = engine.step([], new, [live[::2], live[1::2]])
            tokens.append(sorted((t.seq_id, t.token_id, t.logprob, t.top) for t in result.tokens))
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_grown_buffers_keep_the_kv_and_zero_every_other_slot():
    """Growing or trimming a group's buffers keeps each row's KV and leaves every other slot
    zero, even when the allocator hands back memory that held NaNs (a masked padding slot
    still meets a zero weight, and 0 * NaN would poison the row)."""
    from worker_service.kv_groups import KVGroup, KVShape

    shape = KVShape((2, 2), (4, 4), (2, 2), (4, 4), torch.float32, torch.device("cpu"))
    group = KVGroup(shape)
    group.ensure_capacity(3, 8)
    for sid, length in ((1, 5), (2, 3), (3, 7)):
        row = group.add_empty_row(sid, length)
        for t in (group.keys + group.values):
            t[row, :, :length] = float(sid)
        group.fill(row, length)
    for size in (8, 16, 32, 64):  # memory full of NaN, freed for the allocator to reuse
        torch.full((size, 2, 64, 4), float("nan"))
    for rows, length in ((3, 40), (6, 40), (6, 100)):
        group.ensure_capacity(rows, length)
        for t in group.keys + group.values:
            assert not t.isnan().any()
            for row, (sid, length_held) in enumerate(zip(group.seq_ids, group.lengths)):
                assert (t[row, :, :length_held] == sid).all()
                assert (t[row, :, length_held:] == 0).all()
            assert (t[group.rows:] == 0).all()


def test_kv_dtype_auto_on_cpu_is_bfloat16_with_the_native_loop_else_float32(monkeypatch):
    from worker_service.kernels import native_attention
    from worker_service.model_runner import resolve_kv_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float16, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.bfloat16, cpu) == torch.float32
    with pytest.raises(ValueError, match="kv dtype 'int8'"):
        resolve_kv_dtype("int8", torch.bfloat16, cpu)
    monkeypatch.setattr(native_attention, "kernel", lambda: None)  # as where no compiler exists
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.float32


# Head sizes: 16 takes the portable loop; 64 and 128 the AVX512-BF16 one where the CPU has
# it, with the size fixed at compile time; 96 the AVX512-BF16 one with a run-time size. In
# float32 (AVX2): 64 and 128 fixed, 16 and 96 at run time, 20 the portable loop.
# Grouped-query decoding takes its query heads in passes of up to 4 (2 at dim 128): 9 over
# 3 is SmolLM2's grouping, 10 over 2 a pass of 4 and one of 1.
NATIVE_SHAPES = [(4, 4, None, 16), (4, 2, None, 16), (6, 2, 5, 16), (4, 2, None, 64),
                 (6, 2, 5, 128), (2, 1, None, 96), (2, 1, 3, 20), (9, 3, None, 64),
                 (10, 2, 4, 64)]


def test_kv_buffers_skip_the_zero_fill_only_where_the_native_loops_read_them(monkeypatch):
    """bfloat16 or float32 on CPU with the native loops: buffers are left unfilled (only
    rows' own slots are read); KV of another dtype than the model's, or no native loops
    (SDPA reads masked padding): zero-filled."""
    from worker_service.fixtures import make_model
    from worker_service.kernels import native_attention
    from worker_service.kv_groups import KVGroup

    bf16_dir = make_model(tiny_model("llama").parent / "tiny-llama-bf16", arch="llama",
                          size="tiny", dtype="bfloat16", seed=0)
    # (Where oneDNN has no bfloat16 path the model computes, and keeps its KV, in float32.)
    assert not ModelRunner(str(bf16_dir), dtype="bfloat16").kv_shape.reads_padding
    # Head sizes past the C loops' limit go to SDPA (zero-filled buffers, by the rule above).
    big = torch.zeros(2, 2, 8, native_attention.MAX_DIM + 64, dtype=torch.bfloat16)
    assert not native_attention.supports(big[:1, :, :1], big, big)
    assert native_attention.supports(big[:1, :, :1, :64], big[..., :64].contiguous(),
                                     big[..., :64].contiguous())
    assert not ModelRunner(str(tiny_model("llama")), dtype="float32").kv_shape.reads_padding
    assert ModelRunner(str(tiny_model("llama")), dtype="float32",
                       kv_dtype="bfloat16").kv_shape.reads_padding
    monkeypatch.setattr(native_attention, "kernel", lambda: None)
    runner = ModelRunner(str(bf16_dir), dtype="bfloat16", kv_dtype="bfloat16")
    assert runner.kv_shape.reads_padding
    group = KVGroup(runner.kv_shape)
    group.ensure_capacity(3, 10)
    assert all((t == 0).all() for t in group.keys + group.values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,window,dim", NATIVE_SHAPES)
def test_native_decode_attention_matches_masked_sdpa(heads, kv_heads, window, dim, dtype):
    """The C loop against float32 SDPA with the row masks the worker builds: padded rows of
    different lengths (blocks of 16 slots and the rest), a segment starting past row 0,
    grouped-query heads, a sliding window; 18-54 (row, head) pairs, enough for it to split
    them over threads. bfloat16 KV, or float32 (a model computing in float32). The same
    call writes each row's new key and value."""
    from worker_service.kernels import native_attention
    from worker_service.attention import build_mask

    assert shutil.which("cc") or shutil.which("gcc"), "the test machine has a C compiler"
    assert native_attention.kernel() is not None
    g = torch.Generator().manual_seed(heads + kv_heads + dim)
    rows, cap, row_start = 9, 40, 2
    keys = torch.randn(rows + row_start + 1, kv_heads, cap, dim, generator=g).to(dtype)
    values = torch.randn(keys.shape, generator=g).to(dtype)
    slots = torch.tensor([0, 7, 19, 33, 12, 3, 38, 1, 25])  # each row's new token's slot
    query = torch.randn(rows, heads, dim, generator=g).to(dtype)
    # Each row's new key and value come with the call (a strided [rows, kv_heads, dim]
    # view, as the step passes them) and land in its slot, which holds stale values.
    lines = torch.arange(row_start, row_start + rows)
    new_k = keys[lines, :, slots].clone().transpose(0, 1).contiguous().transpose(0, 1)
    new_v = values[lines, :, slots].clone().transpose(0, 1).contiguous().transpose(0, 1)
    want_keys, want_values = keys.clone(), values.clone()
    keys[lines, :, slots] = torch.full_like(new_k, float("nan"))
    values[lines, :, slots] = torch.full_like(new_v, 1e4)
    got = native_attention.attend(query, keys, values, row_start, slots + 1,
                                  int(slots.max()) + 1, 0.25, window, new_k, new_v)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    kv_len = int(slots.max()) + 1
    mask = build_mask(slots, 1, kv_len, None, window)  # [rows, 1, 1, kv_len]
    k = keys[row_start:row_start + rows, :, :kv_len].float().repeat_interleave(heads // kv_heads, 1)
    v = values[row_start:row_start + rows, :, :kv_len].float().repeat_interleave(heads // kv_heads, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float()[:, :, None], k, v, attn_mask=mask, scale=0.25)[:, :, 0]
    assert got.dtype == dtype and got.shape == query.shape
    # bfloat16: one rounding of values ~1; float32: only the order of the sums differs
    assert (got.float() - want).abs().max() < (0.02 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("heads,kv_heads,lengths", [
    (9, 3, [700]), (9, 3, [5, 600, 90]), (16, 4, [333]), (12, 12, [400, 3]), (10, 2, [250])])
def test_native_decode_attention_splits_a_few_long_rows_over_threads_with_the_same_bits(
        heads, kv_heads, lengths):
    """One to three decoding rows, too few (row, KV head) units to share evenly, split over
    two threads by query head: a thread's share may start or end inside a KV head's
    group. The outputs are bit for bit those of one thread, and match float32 SDPA."""
    from worker_service.kernels import native_attention

    g = torch.Generator().manual_seed(heads * 7 + sum(lengths))
    rows, dim, cap = len(lengths), 64, max(lengths) + 3
    keys = torch.randn(rows, kv_heads, cap, dim, generator=g).bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    query = torch.randn(rows, heads, dim, generator=g).bfloat16()
    ends = torch.tensor(lengths)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native_attention.attend(query, keys, values, 0, ends, max(lengths), 0.125, None)
        torch.set_num_threads(2)
        shared = native_attention.attend(query, keys, values, 0, ends, max(lengths), 0.125,
                                         None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)
    for r, n in enumerate(lengths):
        k = keys[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        v = values[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[r].float()[:, None], k, v, scale=0.125)[:, 0]
        assert (shared[r].float() - want).abs().max() < 0.02, f"row {r}"


def _causal_sdpa(query, keys, values, row, start, scale, window, dtype=torch.float32):
    """Reference causal attention of `query` [tokens, heads, dim] at slots start.. of
    buffer row `row` of keys/values [rows, kv_heads, slots, dim], in `dtype` through SDPA
    with the mask the worker builds. Returns [tokens, heads, dim]."""
    from worker_service.attention import build_mask

    tokens, heads, _ = query.shape
    kv_len, group = start + tokens, heads // keys.shape[1]
    mask = build_mask(torch.tensor([start]), tokens, kv_len, None, window)  # [1, 1, q, kv]
    k = keys[row:row + 1, :, :kv_len].to(dtype).repeat_interleave(group, 1)
    v = values[row:row + 1, :, :kv_len].to(dtype).repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        query.to(dtype).transpose(0, 1)[None], k, v, attn_mask=mask,
        scale=scale)[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,window,dim", NATIVE_SHAPES)
@pytest.mark.parametrize("start", [0, 21])
def test_native_prompt_attention_matches_causal_sdpa(heads, kv_heads, window, dim, start):
    """The C prompt loop against float32 SDPA with the mask the worker builds: 37 queries
    of one row after `start` slots already held (a prefix-cache hit), over a buffer with
    other rows and spare slots around it."""
    from worker_service.kernels import native_attention

    g = torch.Generator().manual_seed(heads + dim + start)
    tokens, cap, row = 37, 64, 1
    keys = torch.randn(3, kv_heads, cap, dim, generator=g).bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    query = torch.randn(tokens, heads, dim, generator=g).bfloat16()
    got = native_attention.attend_prompt(query, keys, values, row, start, 0.3, window)
    want = _causal_sdpa(query, keys, values, row, start, 0.3, window)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    assert (got.float() - want).abs().max() < 0.02


@pytest.mark.parametrize("heads,kv_heads,window,dim", NATIVE_SHAPES)
def test_tiled_prompt_attention_reads_only_written_slots_and_ignores_chunking(
        heads, kv_heads, window, dim):
    """The tiled prompt loop (prompt_attention.c, prompts of TILED_MIN_TOKENS or more):
    150 queries after 40 held slots (several tiles and 32-slot blocks, a ragged end)
    against float32 SDPA, with every slot past the row's last one NaN, as unfilled buffers
    may hold; and the same queries in two chunks give the same bits (each query's
    numbers depend on its own slots only, so chunked prefill equals a whole one)."""
    from worker_service.kernels import native_attention

    assert native_attention.tiled_kernel() is not None
    g = torch.Generator().manual_seed(heads * dim + 7)
    start, tokens, row = 40, 150, 1
    keys = torch.randn(3, kv_heads, start + tokens + 45, dim, generator=g).bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    keys[:, :, start + tokens:] = values[:, :, start + tokens:] = float("nan")
    query = torch.randn(tokens, heads, dim, generator=g).bfloat16()
    got = native_attention.attend_prompt(query, keys, values, row, start, 0.3, window)
    want = _causal_sdpa(query, keys, values, row, start, 0.3, window)
    assert (got.float() - want).abs().max() < 0.02
    cut = 64 + 5  # a chunk end inside a tile and a block
    first = native_attention.attend_prompt(query[:cut], keys, values, row, start, 0.3, window)
    rest = native_attention.attend_prompt(query[cut:], keys, values, row, start + cut, 0.3,
                                          window)
    assert torch.equal(torch.cat([first, rest]), got)
    # A last piece shorter than a tile (a prefix-cache hit or a chunk leaving a few tokens)
    # takes the same loop and rounding as the whole prompt, or greedy tokens may change.
    cut = tokens - 8
    first = native_attention.attend_prompt(query[:cut], keys, values, row, start, 0.3, window)
    rest = native_attention.attend_prompt(query[cut:], keys, values, row, start + cut, 0.3,
                                          window)
    assert torch.equal(torch.cat([first, rest]), got)


@pytest.mark.parametrize("heads,kv_heads,window,dim", NATIVE_SHAPES)
def test_float32_prompt_attention_reads_only_written_slots_and_gives_whole_prompt_bits(
        heads, kv_heads, window, dim):
    """Prompts over float32 KV (a model computing in float32): 150 queries after 40 held
    slots against float64 SDPA, every slot past the row's last one NaN; and the same
    queries cut anywhere into two pieces give the bits of the whole prompt (chunked
    prefill and prefix-cache hits). Head sizes that are multiples of 16 take the tiles
    (prompt_attention.c), the others the one-query loop."""
    from worker_service.kernels import native_attention

    g = torch.Generator().manual_seed(heads * dim + 9)
    start, tokens, row = 40, 150, 1
    keys = torch.randn(3, kv_heads, start + tokens + 45, dim, generator=g)
    values = torch.randn(keys.shape, generator=g)
    keys[:, :, start + tokens:] = values[:, :, start + tokens:] = float("nan")
    query = torch.randn(tokens, heads, dim, generator=g)
    assert native_attention.supports(query, keys, values)
    got = native_attention.attend_prompt(query, keys, values, row, start, 0.3, window)
    want = _causal_sdpa(query, keys, values, row, start, 0.3, window, torch.float64)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5
    for cut in (1, 5, 64 + 5, tokens - 8, tokens - 1):
        first = native_attention.attend_prompt(query[:cut], keys, values, row, start, 0.3,
                                               window)
        rest = native_attention.attend_prompt(query[cut:], keys, values, row, start + cut,
                                              0.3, window)
        assert torch.equal(torch.cat([first, rest]), got), cut


def test_tiled_prompt_attention_takes_scores_far_above_a_rows_first_slots():
    """The tiles' one-pass softmax scales a row's probabilities by its first 64 slots;
    keys 150 times larger after them put later scores some 200 powers of two higher,
    past float32's range unless the row is rescaled: the outputs stay those of float64
    softmax."""
    from worker_service.kernels import native_attention

    g = torch.Generator().manual_seed(11)
    start, tokens = 10, 190
    keys = torch.randn(2, 3, 256, 64, generator=g)
    keys[:, :, 100:] *= 150
    keys = keys.bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    query = torch.randn(tokens, 9, 64, generator=g).bfloat16()
    got = native_attention.attend_prompt(query, keys, values, 1, start, 0.125, None)
    want = _causal_sdpa(query, keys, values, 1, start, 0.125, None, torch.float64)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 0.02


@pytest.mark.parametrize("window", [None, 40, 100])
def test_tiled_prompt_attention_gives_whole_prompt_bits_at_every_cut(window):
    """A prompt attended in two pieces, cut anywhere, gives the bits of the whole prompt,
    with sliding windows too (whose rows start their slots at different places in each
    piece's tiles): what chunked prefill and prefix-cache hits rely on."""
    from worker_service.kernels import native_attention

    g = torch.Generator().manual_seed(3)
    start, tokens = 27, 230
    keys = torch.randn(2, 3, start + tokens + 5, 64, generator=g).bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    query = torch.randn(tokens, 9, 64, generator=g).bfloat16()
    whole = native_attention.attend_prompt(query, keys, values, 1, start, 0.125, window)
    for cut in range(5, tokens, 11):
        first = native_attention.attend_prompt(query[:cut], keys, values, 1, start, 0.125,
                                               window)
        rest = native_attention.attend_prompt(query[cut:], keys, values, 1, start + cut,
                                              0.125, window)
        assert torch.equal(torch.cat([first, rest]), whole), cut


@needs_amx
def test_tiled_prompt_attention_runs_on_the_amx_tiles_where_the_cpu_has_them(tmp_path):
    """With AMX the tiles' products run on the tile unit and heads of up to 64 dimensions
    take a one-pass softmax whose probabilities are scaled by each row's first 64 slots
    rather than by its maximum, so many outputs differ from the dot loop's (a worker started
    with SEQSERVE_AMX=0) in the last bit, but not in accuracy: against float64 their mean
    error is within 5% of the dot loop's. With one-hot values (slot j adds to dimension
    j mod 64) an output is a few probabilities over their total, so each is within two
    bfloat16 roundings (probability, output: 2^-7 relative) of float64 softmax, and beyond
    one rounding (2^-8) about as often as the dot loop's. An exponential with its slope
    0.4% off breaks both (checked)."""
    from worker_service.kernels import native_attention

    script = ("from worker_service.kernels import native_attention as n\n"
              "q, k, v = args\nresult = n.attend_prompt(q, k, v, 1, 20, 0.125, None)")
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 300, 64, generator=g).bfloat16()
    values = torch.randn(keys.shape, generator=g).bfloat16()
    query = torch.randn(260, 9, 64, generator=g).bfloat16()
    tiles = native_attention.attend_prompt(query, keys, values, 1, 20, 0.125, None)
    dot = without_amx(tmp_path, script, query, keys, values)
    assert int((dot != tiles).sum()) > 0  # the tiles ran, not the dot loop
    want = _causal_sdpa(query, keys, values, 1, 20, 0.125, None, torch.float64)
    tiles_error = (tiles.double() - want).abs().mean()
    dot_error = (dot.double() - want).abs().mean()
    assert tiles_error <= 1.05 * dot_error, (tiles_error, dot_error)

    one_hot = torch.zeros(keys.shape, dtype=torch.bfloat16)
    one_hot[:, :, torch.arange(300), torch.arange(300) % 64] = 1
    keys = (keys.float() * 3).bfloat16()  # a wide spread: maxima past the first 64 slots
    want = _causal_sdpa(query, keys, one_hot, 1, 20, 0.125, None, torch.float64)
    seen = want > 1e-6  # below, the probabilities approach bfloat16's smallest steps
    relative = {}
    for name, got in (("tiles", native_attention.attend_prompt(query, keys, one_hot, 1, 20,
                                                                0.125, None)),
                      ("dot", without_amx(tmp_path, script, query, keys, one_hot))):
        relative[name] = ((got.double() - want).abs() / want)[seen]
        assert relative[name].max() <= 2 ** -7, (name, relative[name].max())
    beyond = {name: float((r > 2 ** -8).float().mean()) for name, r in relative.items()}
    assert beyond["tiles"] <= 1.05 * beyond["dot"], beyond


def test_float32_kv_of_a_bfloat16_model_gives_its_tokens(monkeypatch):
    """A bfloat16 model's keys and values are exact in float32, so the KV dtype and the
    decoding-attention path (batched products over float32 KV, the native loop over
    bfloat16, SDPA over bfloat16 where the loop is not built) change only the rounding
    inside attention: the same greedy tokens, log-probabilities within bf16 noise, over
    prefills and decodes of several groups."""
    from worker_service.kernels import native_attention
    from worker_service.fixtures import make_model

    model_dir = make_model(tiny_model("llama").parent / "tiny-llama-bf16", arch="llama",
                           size="tiny", dtype="bfloat16", seed=0)
    rng = random.Random(2)
    prompts = [[rng.randint(3, 999) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    outs = []
    for kv_dtype, native in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        if not native:
            monkeypatch.setattr(native_attention, "kernel", lambda: None)
        runner = ModelRunner(str(model_dir), dtype="bfloat16", kv_dtype=kv_dtype)
        assert runner.kv_shape.dtype == getattr(torch, kv_dtype)
        engine = Engine(runner)
        steps = []
        engine.step([], [PrefillSpec(i, p, 0, DecodingParams(logprobs=0)) for i, p in
                         enumerate(prompts[:3])], [[0, 1], [2]])
        for step in range(8):
            new = [PrefillSpec(3 + step, prompts[3 + step], 0, DecodingParams(logprobs=0))] if step < 3 else []
            live = sorted(engine.sequences) + [n.seq_id for n in new]
            result = engine.step([], new, [live[::2], live[1::2]])
            steps.append(sorted((t.seq_id, t.token_id, t.logprob) for t in result.tokens))
        outs.append(steps)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert [(s, t) for s, t, _ in a] == [(s, t) for s, t, _ in b]
            assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) < 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_runner_turns_cudnn_attention_off():
    # cuDNN's SDPA plans per shape, and a serving step's shapes change at every step: on
    # an H100 it made each Step several times slower (docs/benchmarks.md, "On a GPU").
    torch.backends.cuda.enable_cudnn_sdp(True)
    ModelRunner(str(tiny_model("llama")), device="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
