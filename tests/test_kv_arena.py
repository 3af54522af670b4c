"""The KV arena: extents taken first fit and merged when given back; groups whose buffers
live in it keep their KV through growth, trims, row moves and a full arena, and give their
extents back when reallocated or dropped."""

import gc
import random

import pytest
import torch

from tests.conftest import tiny_model
from tests.test_engine import check_random_plans
from tests.test_kv_groups import MIXED, UNIFORM, _holds
from worker_service.engine import Engine
from worker_service.kv_arena import ALIGN, KVArena
from worker_service.kv_groups import KVGroup, KVShape
from worker_service.model_runner import ModelRunner


def test_extents_are_taken_first_fit_and_merged_when_given_back():
    a = KVArena(10 * ALIGN)
    offsets = [a.take(ALIGN) for _ in range(5)]
    assert offsets == [0, ALIGN, 2 * ALIGN, 3 * ALIGN, 4 * ALIGN]
    assert a.take(1) == 5 * ALIGN  # sizes round up to ALIGN
    a.give(ALIGN, ALIGN)
    a.give(3 * ALIGN, ALIGN)
    assert a.holes == [(ALIGN, ALIGN), (3 * ALIGN, ALIGN), (6 * ALIGN, 4 * ALIGN)]
    assert a.take(2 * ALIGN) == 6 * ALIGN  # no earlier hole is long enough
    assert a.take(ALIGN) == ALIGN  # the first hole that fits
    a.give(2 * ALIGN, ALIGN)  # merges with the hole after it
    assert a.holes == [(2 * ALIGN, 2 * ALIGN), (8 * ALIGN, 2 * ALIGN)]
    a.give(4 * ALIGN, ALIGN)
    a.give(ALIGN, ALIGN)  # merges both ways
    assert a.holes == [(ALIGN, 4 * ALIGN), (8 * ALIGN, 2 * ALIGN)]
    assert a.take(5 * ALIGN) is None and a.misses == 1
    assert a.used_bytes == 10 * ALIGN - 6 * ALIGN
    with pytest.raises(ValueError, match="given back twice"):
        a.give(2 * ALIGN, ALIGN)


def test_random_takes_and_gives_never_overlap():
    rng = random.Random(7)
    a = KVArena(4096 * ALIGN)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            a.give(offset, held.pop(offset))
        else:
            n = rng.randint(1, 300 * ALIGN)
            offset = a.take(n)
            if offset is not None:
                held[offset] = n
        spans = sorted((o, o + -(-n // ALIGN) * ALIGN) for o, n in held.items())
        spans += [(o, o + n) for o, n in a.holes]
        spans.sort()
        # Held extents and holes tile the arena exactly: no overlap, nothing lost.
        assert spans[0][0] == 0 and spans[-1][1] == a.capacity_bytes
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        assert all(x[0] + x[1] < y[0] for x, y in zip(a.holes, a.holes[1:]))  # merged
    for offset, n in held.items():
        a.give(offset, n)
    assert a.holes == [(0, a.capacity_bytes)] and a.used_bytes == 0


def _in_arena(g: KVGroup, a: KVArena) -> bool:
    lo, hi = a.buffer.data_ptr(), a.buffer.data_ptr() + a.capacity_bytes
    return all(lo <= t.data_ptr() < hi for t in g.keys + g.values)


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_groups_in_the_arena_keep_their_kv_and_give_it_back(dims):
    a = KVArena(1 << 22)
    shape = KVShape(*dims, dtype=torch.float32, device=torch.device("cpu"))
    g = KVGroup(shape, arena=a)
    truth = []
    for r in range(3):
        g.add_empty_row(r, 12)
        kv = [(torch.randn(shape.key_heads[i], 12, shape.key_dims[i]),
               torch.randn(shape.value_heads[i], 12, shape.value_dims[i]))
              for i in range(shape.num_layers)]
        for i, (k, v) in enumerate(kv):
            g.keys[i][r, :, :12], g.values[i][r, :, :12] = k, v
        g.fill(r, 12)
        truth.append(kv)
    assert _in_arena(g, a) and a.used_bytes >= g.allocated_bytes()
    first = a.used_bytes
    g.ensure_capacity(9, 300)  # grows: new extent, rows copied, old extent given back
    assert _in_arena(g, a) and all(_holds(g, r, truth[r], 12) for r in range(3))
    assert a.used_bytes == -(-g.allocated_bytes() // ALIGN) * ALIGN > first
    # New buffers are zero past the rows (SDPA reads the padding: KVShape.reads_padding).
    assert all(float(t[:, :, 12:].abs().sum()) == 0 for t in g.keys + g.values)
    g.remove_row(0)
    g.trim()  # shrinks: a smaller extent
    assert _in_arena(g, a) and _holds(g, 0, truth[2], 12) and _holds(g, 1, truth[1], 12)
    assert a.used_bytes == -(-g.allocated_bytes() // ALIGN) * ALIGN
    del g
    gc.collect()
    assert a.used_bytes == 0 and a.holes == [(0, a.capacity_bytes)]


def test_a_full_arena_leaves_buffers_to_the_heap_and_takes_them_back_later():
    shape = KVShape(*UNIFORM, dtype=torch.float32, device=torch.device("cpu"))
    a = KVArena(256 << 10)
    small = KVGroup(shape, arena=a)
    small.add_empty_row(0, 10)  # 4 rows x 64 slots: 96 KiB
    big = KVGroup(shape, arena=a)
    for r in range(8):
        big.add_empty_row(r, 500)  # 8 rows x 640 slots: 1.9 MiB, more than the arena
    assert _in_arena(small, a) and not _in_arena(big, a) and a.misses > 0
    big.keys[0][0, 1, 2, 3] = 1.5
    big.fill(0, 3)
    big.ensure_capacity(8, 700)  # from the heap again, the KV with it
    assert not _in_arena(big, a) and float(big.keys[0][0, 1, 2, 3]) == 1.5
    for r in range(7, 0, -1):
        big.remove_row(r)
    big.trim()  # now small enough: back in the arena, the KV with it
    assert _in_arena(big, a) and float(big.keys[0][0, 1, 2, 3]) == 1.5
    assert a.used_bytes == sum(-(-g.allocated_bytes() // ALIGN) * ALIGN for g in (small, big))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_an_engine_on_the_arena_matches_generate(arch):
    model_dir = tiny_model(arch)
    arena = KVArena(32 << 20)
    engine = Engine(ModelRunner(str(model_dir)), arena=arena)
    check_random_plans(model_dir, engine)  # merges, splits and row moves, in the arena
    assert arena.misses == 0 and arena.used_bytes > 0
    assert all(_in_arena(g, arena) for g in engine.groups)
    engine.drop_sequences()
    gc.collect()
    assert arena.used_bytes == 0
