"""KV swap on the worker (kv_swap.py): a row's KV to host memory and back is exact, over
one buffer for all layers and over a buffer a layer; an engine that swaps a sequence out
for some Steps and back in produces what it would have without the pause (greedy equals
model.generate, seeded sampling equals an uninterrupted run); Steps that break the swap
rules fail with a clear StepError."""

from __future__ import annotations

import random

import pytest
import torch

from seqserve_common.decoding import DecodingStrategy
from tests.conftest import tiny_model
from tests.test_engine import _reference
from tests.test_kv_groups import MIXED, UNIFORM, _group, _holds
from worker_service.engine import Engine, StepError
from worker_service.kv_swap import SwapSpace, measure_copy_rate, swap_capacity, swap_space
from worker_service.model_runner import ModelRunner
from worker_service.prefix_cache import PrefixCache
from worker_service.sequence import DecodingParams, SequenceState
from worker_service.step import PrefillSpec

CPU = torch.device("cpu")
# On a machine with a GPU the engine tests run there too: copies between the device and
# host memory are the accelerator's path.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_a_row_goes_to_host_memory_and_back_exactly(dims):
    g, truth = _group(dims, rows=3, length=10)
    host = g.copy_out(1, 0, g.length(1), CPU)
    assert host.slots == 10 and host.nbytes == 10 * g.shape.bytes_per_token
    other, _ = _group(dims, rows=2, length=7)
    row = other.add_row_with(555, host, reserve_length=12)
    assert row == 2 and other.seq_ids[row] == 555 and other.length(row) == 10
    assert _holds(other, row, truth[1], 10)
    assert other.length_capacity >= 12


def test_swap_space_keeps_account():
    space = SwapSpace(100)
    assert space.fits(100) and not space.fits(101)
    assert swap_capacity(-1, CPU) == 0 and swap_capacity(-1, torch.device("cuda")) == 4 << 30
    assert swap_capacity(123, torch.device("cuda")) == 123
    assert swap_space(0, CPU) is None and swap_space(-1, CPU) is None
    assert swap_space(64, CPU).capacity_bytes == 64 and not swap_space(64, CPU).pinned
    assert measure_copy_rate(CPU, torch.empty(1 << 20, dtype=torch.uint8), repeats=1) > 0


def _state(seq_id: int) -> SequenceState:
    return SequenceState(seq_id=seq_id, token_ids=[1], num_generated=0,
                         params=DecodingParams())


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_the_swap_space_fills_holes_first_then_closes_them(dims):
    """Rows of 10 and 20 slots in a space of 40 slots' bytes: a row goes into the first
    hole long enough; where the free bytes suffice but no hole does, the rows held are
    moved down and every one still comes back exact."""
    short, short_truth = _group(dims, rows=4, length=10)
    long, long_truth = _group(dims, rows=1, length=20)
    per_token = short.shape.bytes_per_token
    space = SwapSpace(40 * per_token)
    for row in range(4):
        space.store(_state(row), short, row)
    assert space.used_bytes == 40 * per_token and not space.fits(1)
    space.take(1)
    space.take(2)  # one hole of 20 slots between rows 0 and 3
    space.store(_state(7), long, 0)
    assert space.compactions == 0 and space._held[7].extent.offset == 10 * per_token
    space.take(0)
    space.take(3)  # 20 slots free: 0-9 and 30-39
    with pytest.raises(ValueError, match="do not fit"):
        space.store(_state(8), _group(dims, rows=1, length=21)[0], 0)
    space.store(_state(9), long, 0)  # row 7 moves down by 10 slots over itself
    assert space.compactions == 1 and space.used_bytes == 40 * per_token
    back, _ = _group(dims, rows=0, length=1)
    for seq_id in (7, 9):
        entry = space.take(seq_id)
        row = back.add_row_with(seq_id, entry.kv, reserve_length=entry.kv.slots + 1)
        assert _holds(back, row, long_truth[0], 20), seq_id
    assert space.used_bytes == 0 and len(space) == 0


def test_the_swap_space_stays_exact_under_random_swaps():
    """Random stores and takes of rows of 1-12 slots in a space of 30: the extents never
    overlap or pass the end, a row that fits by the byte count is always stored, and
    every row taken back holds what it was stored with."""
    rng = random.Random(11)
    groups = {n: _group(UNIFORM, rows=2, length=n) for n in range(1, 13)}
    per_token = groups[1][0].shape.bytes_per_token
    space = SwapSpace(30 * per_token)
    held: dict[int, tuple[int, int]] = {}  # seq id -> (length, row)
    for seq_id in range(400):
        if held and (rng.random() < 0.45 or not space.fits(per_token)):
            sid = rng.choice(sorted(held))
            n, row = held.pop(sid)
            entry = space.take(sid)
            back, _ = _group(UNIFORM, rows=0, length=1)
            r = back.add_row_with(sid, entry.kv, reserve_length=n + 1)
            assert _holds(back, r, groups[n][1][row], n), sid
            continue
        n, row = rng.randint(1, 12), rng.randint(0, 1)
        if not space.fits(n * per_token):
            continue
        space.store(_state(seq_id), groups[n][0], row)
        held[seq_id] = (n, row)
        spans = sorted((e.extent.offset, e.extent.offset + e.extent.nbytes)
                       for e in space._held.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] <= space.capacity_bytes
        assert space.used_bytes == sum(n for n, _ in held.values()) * per_token
    assert space.compactions > 0


def _engines(model_dir, device: str = "cpu"):
    """One engine without swap space, one with it and a prefix cache (whose blocks of a
    swapped-in sequence's prompt must not be copied over the KV it brings back)."""
    runner = ModelRunner(str(model_dir), device=device)
    cache = PrefixCache(runner.kv_shape, 64 << 20, 16)
    # Pinned on a GPU, as the worker keeps it: its copies are then non-blocking.
    return Engine(runner), Engine(runner, cache, swap=swap_space(1 << 30, runner.device))


def _prompts() -> list[list[int]]:
    return [[5 + i * 7 + j for j in range(n)] for i, n in enumerate((9, 31, 17, 64))]


SAMPLED = DecodingParams(strategy=DecodingStrategy.SAMPLE, temperature=0.8, top_k=40, seed=7)


def _run(engine: Engine, steps: int, out_at: int | None = None, back_at: int | None = None
         ) -> dict[int, list[int]]:
    """Four greedy sequences and a sampled one; sequence 1 (and, swapped with it, the
    sampled 4) is out from Step `out_at` until Step `back_at`."""
    prompts = _prompts()
    specs = [PrefillSpec(i, p, 0, DecodingParams()) for i, p in enumerate(prompts)]
    specs.append(PrefillSpec(4, prompts[0][:5], 0, SAMPLED))
    got: dict[int, list[int]] = {i: [] for i in range(5)}
    live = set(range(5))
    for step in range(steps):
        swap_out = [1, 4] if step == out_at else []
        swap_in = [1, 4] if step == back_at else []
        live -= set(swap_out)
        live |= set(swap_in)
        ids = sorted(live)
        # Two groups that change with the swaps: the rows come back into either.
        plan = [ids[::2], ids[1::2]]
        result = engine.step([], specs if step == 0 else [], [p for p in plan if p],
                             swap_out=swap_out, swap_in=swap_in)
        for t in result.tokens:
            got[t.seq_id].append(t.token_id)
    return got


@pytest.mark.parametrize("device", DEVICES)
def test_a_swapped_sequence_decodes_on_as_if_never_paused(device):
    model_dir = tiny_model("llama")
    plain, swapping = _engines(model_dir, device)
    uninterrupted = _run(plain, 12)
    paused = _run(swapping, 15, out_at=4, back_at=7)
    assert len(swapping.swap) == 0 and swapping.swap.used_bytes == 0
    prompts = _prompts()
    for i in range(4):
        assert paused[i] == _reference(model_dir, prompts[i], len(paused[i])), i
    assert len(paused[1]) == 12  # 4 before, 8 after: 3 Steps out
    assert paused[4] == uninterrupted[4]  # seeded sampling: token i from (seed, i)


def test_a_sequence_released_while_swapped_out_frees_its_space():
    _, engine = _engines(tiny_model("llama"))
    engine.step([], [PrefillSpec(1, [3, 4, 5, 6], 0, DecodingParams())], [[1]])
    engine.step([], [], [], swap_out=[1])
    assert len(engine.swap) == 1 and engine.swap.used_bytes > 0 and not engine.sequences
    engine.step([1], [], [])
    assert len(engine.swap) == 0 and engine.swap.used_bytes == 0


def test_steps_that_break_the_swap_rules_fail_clearly():
    model_dir = tiny_model("llama")
    plain, engine = _engines(model_dir)
    greedy = PrefillSpec(1, [3, 4, 5, 6], 0, DecodingParams())
    plain.step([], [greedy], [[1]])
    with pytest.raises(StepError, match="no swap space"):
        plain.step([], [], [], swap_out=[1])
    with pytest.raises(StepError, match="does not run"):
        engine.step([], [], [], swap_out=[9])
    with pytest.raises(StepError, match="does not hold"):
        engine.step([], [], [[9]], swap_in=[9])
    contrastive = DecodingParams(strategy=DecodingStrategy.CONTRASTIVE, top_k=4)
    engine.step([], [greedy, PrefillSpec(2, [7, 8, 9], 0, contrastive)], [[1, 2]])
    with pytest.raises(StepError, match="cannot be swapped out"):
        engine.step([], [], [[1]], swap_out=[2])
    engine.step([2], [], [[1]])
    engine.step([], [], [], swap_out=[1])
    with pytest.raises(StepError, match="is swapped out"):
        engine.step([], [greedy], [[1]])
    engine.swap.capacity_bytes = engine.swap.used_bytes  # full
    engine.step([], [], [[1]], swap_in=[1])
    with pytest.raises(StepError, match="needs .* bytes"):
        engine.step([], [], [], swap_out=[1])
