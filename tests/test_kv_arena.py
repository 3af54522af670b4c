"""The KV arena: extents taken first fit and merged when given back; groups whose buffers
live in it keep their KV through growth, trims, row moves and a full arena, and give their
extents back when reallocated or dropped."""

import gc
import random
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model
from tests.test_engine import check_random_plans
from tests.test_kv_groups import MIXED, UNIFORM, _holds
from worker_service.engine import Engine
from worker_service.kv_arena import ALIGN, KVArena
from worker_service.kv_groups import KVGroup, KVShape
from worker_service.model_runner import ModelRunner


class _Owner:
    def __init__(self):
        self.rebinds = 0

    def rebind(self):
        self.rebinds += 1


def test_extents_are_taken_first_fit_merged_when_given_back_and_compacted():
    A = ALIGN
    a = KVArena(10 * A)
    owners = [_Owner() for _ in range(8)]
    e = [a.take(A, owners[i]) for i in range(5)]
    assert [x.offset for x in e] == [0, A, 2 * A, 3 * A, 4 * A]
    f = a.take(1, owners[5])
    assert f.offset == 5 * A and f.nbytes == A  # sizes round up to ALIGN
    a.give(e[1])
    a.give(e[3])
    assert a.holes == [(A, A), (3 * A, A), (6 * A, 4 * A)]
    g = a.take(2 * A, owners[6])
    assert g.offset == 6 * A  # no earlier hole is long enough
    h = a.take(A, owners[7])
    assert h.offset == A  # the first hole that fits
    a.give(e[2])  # merges with the hole after it
    assert a.holes == [(2 * A, 2 * A), (8 * A, 2 * A)]
    a.give(e[4])
    a.give(h)  # merges both ways
    assert a.holes == [(A, 4 * A), (8 * A, 2 * A)] and a.used_bytes == 4 * A
    for x, value in ((e[0], 1), (f, 2), (g, 3)):
        a.view(x).fill_(value)
    # 6 A free, no hole of 5 A: the held extents move down, their owners rebind.
    big = a.take(5 * A, _Owner())
    assert a.compactions == 1 and big.offset == 4 * A and a.holes == [(9 * A, A)]
    assert (e[0].offset, f.offset, g.offset) == (0, A, 2 * A)
    assert [o.rebinds for o in (owners[0], owners[5], owners[6])] == [0, 1, 1]
    assert all(bool((a.view(x) == value).all())
               for x, value in ((e[0], 1), (f, 2), (g, 3)))
    assert a.take(2 * A) is None and a.misses == 1  # more than the free bytes
    with pytest.raises(ValueError, match="given back twice"):
        a.give(h)


def test_random_takes_and_gives_keep_every_extent_exact():
    rng = random.Random(7)
    a = KVArena(4096 * ALIGN)
    held = {}  # extent -> the byte value it was filled with
    for step in range(2000):
        if held and rng.random() < 0.45:
            extent = rng.choice(list(held))
            del held[extent]
            a.give(extent)
        else:
            extent = a.take(rng.randint(1, 600 * ALIGN), _Owner())
            if extent is not None:
                held[extent] = step % 251
                a.view(extent).fill_(held[extent])
        spans = sorted([(x.offset, x.offset + x.nbytes) for x in held]
                       + [(o, o + n) for o, n in a.holes])
        # Held extents and holes tile the arena exactly: no overlap, nothing lost.
        assert spans[0][0] == 0 and spans[-1][1] == a.capacity_bytes
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        assert all(x[0] + x[1] < y[0] for x, y in zip(a.holes, a.holes[1:]))  # merged
        assert all(bool((a.view(x) == v).all()) for x, v in held.items())
    assert a.compactions > 0 and a.misses > 0
    for extent in list(held):
        a.give(extent)
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


def _filled(shape: KVShape, a: KVArena, rows: int, length: int):
    g = KVGroup(shape, arena=a)
    truth = []
    for r in range(rows):
        g.add_empty_row(r, length)
        kv = [(torch.randn(shape.key_heads[i], length, shape.key_dims[i]),
               torch.randn(shape.value_heads[i], length, shape.value_dims[i]))
              for i in range(shape.num_layers)]
        for i, (k, v) in enumerate(kv):
            g.keys[i][r, :, :length], g.values[i][r, :, :length] = k, v
        g.fill(r, length)
        truth.append(kv)
    return g, truth


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_a_group_that_fits_only_after_the_holes_close_moves_its_neighbours(dims):
    shape = KVShape(*dims, dtype=torch.float32, device=torch.device("cpu"))
    per = 4 * 64 * shape.bytes_per_token  # a group of 4 rows and 64 slots
    a = KVArena(16 * per // 3)
    first, _ = _filled(shape, a, 4, 10)
    growing, truth = _filled(shape, a, 4, 10)
    last, last_truth = _filled(shape, a, 4, 10)
    del first  # a hole before both
    gc.collect()
    assert len(a.holes) == 2 and a.compactions == 0
    growing.ensure_capacity(4, 150)  # 192 slots: longer than either hole, not the free bytes
    assert a.compactions == 1 and a.misses == 0
    assert _in_arena(growing, a) and _in_arena(last, a)
    assert all(_holds(growing, r, truth[r], 10) for r in range(4))
    assert all(_holds(last, r, last_truth[r], 10) for r in range(4))
    last.add_row_from(growing, 2)  # the moved views are the buffers the group uses
    assert _holds(last, 4, truth[2], 10)


def test_a_group_collected_on_another_thread_is_given_back_on_the_callers():
    # A collected group's finalizer runs on whichever thread collects it (a gRPC thread's
    # garbage collection, say), while the compute thread may be inside the arena: its
    # extent waits and is given back by the next call, on that call's thread.
    threads = []

    class Recording(KVArena):
        def _give(self, extent):
            threads.append(threading.current_thread().name)
            super()._give(extent)

    shape = KVShape(*UNIFORM, dtype=torch.float32, device=torch.device("cpu"))
    a = Recording(1 << 20)
    holder = [KVGroup(shape, arena=a)]
    holder[0].add_empty_row(0, 10)
    assert a.used_bytes > 0
    dropper = threading.Thread(target=holder.clear, name="collector")
    dropper.start()
    dropper.join()
    assert threads == []
    assert a.used_bytes == 0 and threads == [threading.current_thread().name]


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


# Per model, an arena small enough that buffers must move to close holes while the plans
# regroup, and large enough that none falls back to the heap (found by trying sizes).
@pytest.mark.parametrize("arch,arena_bytes", [("llama", 11 << 18), ("gpt2", 22 << 18)])
def test_an_engine_on_the_arena_matches_generate(arch, arena_bytes):
    model_dir = tiny_model(arch)
    arena = KVArena(arena_bytes)
    engine = Engine(ModelRunner(str(model_dir)), arena=arena)
    check_random_plans(model_dir, engine)  # merges, splits and row moves, in the arena
    assert arena.compactions > 0 and arena.misses == 0 and arena.used_bytes > 0
    assert engine.step([], [], []).arena_stats == (arena.compactions, 0)
    assert all(_in_arena(g, arena) for g in engine.groups)
    engine.drop_sequences()
    gc.collect()
    assert arena.used_bytes == 0


def test_the_worker_exports_what_the_arena_counts():
    from worker_service.metrics import WorkerMetrics
    from worker_service.step import StepResult

    m = WorkerMetrics()
    for stats in ((0, 0), (2, 1), (2, 1), (5, 1)):
        m.observe_step(StepResult(arena_stats=stats), 1)
    value = m.registry.get_sample_value
    assert value("seqserve_worker_kv_arena_compactions_total") == 5
    assert value("seqserve_worker_kv_arena_misses_total") == 1


def test_the_arena_maps_the_kv_budget_times_its_headroom():
    """The scheduler admits kv_cache_bytes of KV tokens; the CPU worker maps that times
    kv_arena_headroom for the padded, growing group buffers (none on a GPU)."""
    from seqserve_common.config import ServingConfig
    from worker_service.kv_arena import kv_arena

    cfg = ServingConfig(kv_cache_bytes=4 << 20, kv_arena_headroom=1.5)
    assert kv_arena(cfg, torch.device("cpu")).capacity_bytes == 6 << 20
    exact = ServingConfig(kv_cache_bytes=4 << 20, kv_arena_headroom=1.0)
    assert kv_arena(exact, torch.device("cpu")).capacity_bytes == 4 << 20
    assert kv_arena(cfg, torch.device("meta")) is None


def _mapping_of(address: int) -> dict[str, str]:
    """The smaps fields (AnonHugePages, VmFlags, ...) of this process's mapping holding
    `address`."""
    fields: dict[str, str] = {}
    current = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if current:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_the_arena_asks_for_huge_pages_where_the_kernel_offers_them():
    """The region starts on a 2 MiB boundary and, where Linux offers transparent huge
    pages on request, is marked for them (madvise, smaps flag `hg`) before it is first
    written, so the prefaulted pages can be 2 MiB ones (fewer TLB misses for a step's rows
    spread over gigabytes). Whether the kernel then finds free 2 MiB pages depends on the
    host's fragmentation, so the pages themselves are not asserted."""
    from worker_service.huge_pages import HUGE_PAGE

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel offers no transparent huge pages")
    a = KVArena(8 * HUGE_PAGE)
    assert a.buffer.data_ptr() % HUGE_PAGE == 0 and a.buffer.numel() == 8 * HUGE_PAGE
    assert a.huge_pages
    mapping = _mapping_of(a.buffer.data_ptr())
    assert "hg" in mapping["VmFlags"].split(), mapping


def test_rows_double_where_the_arena_has_room_and_grow_by_half_where_it_has_not():
    """Each growth copies every row a group holds: doubling copies half as much over a
    burst of joining rows, where the arena's free bytes hold twice the doubled buffer."""
    shape = KVShape(*UNIFORM, dtype=torch.float32, device=torch.device("cpu"))

    def grown(arena_rows: int | None) -> KVGroup:
        probe = KVGroup(shape)
        probe.ensure_capacity(8, 64)
        row_bytes = probe.length_capacity * shape.bytes_per_token
        g = KVGroup(shape, arena=KVArena(arena_rows * row_bytes) if arena_rows else None)
        g.ensure_capacity(8, 64)
        g.ensure_capacity(9, 64)
        return g

    assert grown(8 + 2 * 16).row_capacity == 16  # 8 rows held, 2 x 16 free: doubled
    assert grown(8 + 2 * 16 - 1).row_capacity == 12  # one row short: 1.5x
    assert grown(None).row_capacity == 12  # no arena: a larger buffer is not free room
