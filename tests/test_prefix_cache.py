"""Prefix reuse of KV on the worker is exact, bounded, and visible in metrics."""

from __future__ import annotations

import random

import pytest

from bench.metrics import scrape
from client import Client
from tests import reference
from worker_service.engine import Engine
from worker_service.model_runner import ModelRunner
from worker_service.prefix_cache import PrefixCache
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec

BLOCK = 16


@pytest.fixture(scope="module")
def runner(llama_dir):
    return ModelRunner(str(llama_dir))


def generate(engine: Engine, prompts: dict[int, list[int]], n: int, arrive_every: int = 0,
             release_at: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Run sequences to n tokens each (arriving one per `arrive_every` steps, all at once
    if 0) in one group; returns their tokens."""
    got = {sid: [] for sid in prompts}
    pending = list(prompts)
    live: list[int] = []
    step = 0
    while pending or live:
        new = []
        if pending and (arrive_every == 0 or step % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for sid in list(batch):
                new.append(PrefillSpec(sid, prompts[sid], 0, DecodingParams()))
                pending.remove(sid)
                live.append(sid)
        result = engine.step([], new, [list(live)])
        for t in result.tokens:
            got[t.seq_id].append(t.token_id)
            limit = (release_at or {}).get(t.seq_id, n)
            if len(got[t.seq_id]) >= limit:
                live.remove(t.seq_id)
                engine.release(t.seq_id)
        step += 1
    return got


def shared_prompts(seed: int) -> dict[int, list[int]]:
    rng = random.Random(seed)
    system = [rng.randint(3, 999) for _ in range(70)]  # 4 blocks + 6 tokens: ends mid-block
    prompts = {0: system + [rng.randint(3, 999) for _ in range(20)]}
    prompts[1] = system + [rng.randint(3, 999) for _ in range(5)]
    prompts[2] = system[:64]  # entirely cached after 0 (exactly four blocks)
    prompts[3] = system[:33]  # a prefix ending mid-block
    prompts[4] = prompts[0] + [7, 8, 9]  # a whole earlier prompt plus a turn
    prompts[5] = [rng.randint(3, 999) for _ in range(40)]  # shares nothing
    return prompts


def test_outputs_identical_with_cache_on_and_off(runner):
    prompts = shared_prompts(1)
    cache = PrefixCache(runner.kv_shape, 64 << 20, BLOCK)
    on = generate(Engine(runner, cache), prompts, 12, arrive_every=2)
    off = generate(Engine(runner, None), prompts, 12, arrive_every=2)
    assert on == off
    # 1: four system blocks; 2 (wholly cached, 64 tokens): all but its last token, whose
    # logits are needed; 3 (33 tokens): two blocks, the mid-block rest is recomputed;
    # 4: the five whole blocks of prompt 0.
    assert cache.stats.queries == len(prompts) and cache.stats.hits == 4
    assert cache.stats.hit_tokens == 64 + 63 + 32 + 80


def test_cached_tokens_are_reported_per_sequence(runner):
    cache = PrefixCache(runner.kv_shape, 64 << 20, BLOCK)
    engine = Engine(runner, cache)
    prompt = list(range(10, 10 + 50))
    first = engine.step([], [PrefillSpec(1, prompt, 0, DecodingParams())], [[1]])
    assert first.tokens[0].cached_tokens == 0
    second = engine.step([], [PrefillSpec(2, prompt + [5, 6], 0, DecodingParams())], [[1, 2]])
    by_id = {t.seq_id: t for t in second.tokens}
    assert by_id[2].cached_tokens == 48  # three whole blocks of the 50 shared tokens


def test_eviction_under_small_budget_recomputes_correctly(runner):
    budget = 6 * BLOCK * runner.kv_shape.bytes_per_token  # six blocks
    cache = PrefixCache(runner.kv_shape, budget, BLOCK)
    engine = Engine(runner, cache)
    rng = random.Random(5)
    prompts = {i: [rng.randint(3, 999) for _ in range(64)] for i in range(4)}  # 4 blocks each
    got = generate(engine, prompts, 6, arrive_every=1)
    assert cache.stats.evictions > 0 and cache.bytes_held <= budget
    # Prompt 0 was evicted by later ones; asking again recomputes it and must be exact.
    again = generate(engine, {10: prompts[0]}, 6)
    assert again[10] == got[0]
    plain = generate(Engine(runner, None), {0: prompts[0]}, 6)
    assert got[0] == plain[0]


def test_release_of_one_sharer_does_not_disturb_the_other(runner):
    cache = PrefixCache(runner.kv_shape, 64 << 20, BLOCK)
    engine = Engine(runner, cache)
    rng = random.Random(9)
    system = [rng.randint(3, 999) for _ in range(48)]
    prompts = {1: system + [11, 12], 2: system + [13, 14, 15]}
    got = generate(engine, {1: prompts[1]}, 1)
    both = generate(engine, {3: prompts[1], 4: prompts[2]}, 20, release_at={3: 5})
    alone = generate(Engine(runner, None), {4: prompts[2]}, 20)
    assert both[4] == alone[4]
    assert got[1] == both[3][:1]


def test_cached_prompt_over_real_processes(llama_dir, deploy):
    d = deploy(llama_dir, prompt_cache_block_tokens=BLOCK)
    cached = ("You are a helpful assistant who answers briefly about dragons, castles and "
              "rivers of the kingdom. ") * 3
    questions = ["Where is the castle?", "Who is the king?", "héllo wörld 你好"]
    with Client(d.address, timeout=120) as c:
        replies = [c.generate(q, cached_prompt=cached, max_new_tokens=10) for q in questions]
    for q, r in zip(questions, replies):
        assert r.token_ids == reference.greedy(llama_dir, cached + q, 10)
    assert replies[0].cached_tokens == 0
    assert all(r.cached_tokens >= BLOCK for r in replies[1:])
    worker = scrape(f"http://127.0.0.1:{d.worker.ports['metrics']}/metrics")
    assert worker["seqserve_worker_prefix_cache_hits_total"] >= 2
    assert worker["seqserve_worker_prefix_cache_hit_tokens_total"] >= 2 * BLOCK
    assert worker["seqserve_worker_prefix_cache_bytes"] > 0
    sched = scrape(d.metrics_url)
    assert sched["seqserve_prefix_cache_hit_tokens_total"] == sum(r.cached_tokens for r in replies)


def test_eviction_keeps_pinned_blocks_and_stops_at_the_first_block_that_does_not_fit():
    """The victims order and the budget, on a bare cache: unpinned blocks go first, least
    recently used first; pinned ones only make room for pinned ones; a row whose blocks do
    not all fit keeps the prefix that does."""
    import torch

    from worker_service.kv_groups import KVGroup, KVShape

    shape = KVShape((1,), (2,), (1,), (2,), torch.float32, torch.device("cpu"))
    group = KVGroup(shape)
    group.add_empty_row(0, 8 * BLOCK)
    cache = PrefixCache(shape, 6 * BLOCK * shape.bytes_per_token, BLOCK)
    rng = random.Random(9)
    a, b, c, d, e = ([rng.randint(3, 999) for _ in range(n * BLOCK)] for n in (4, 4, 4, 8, 4))

    def held(tokens: list[int]) -> int:  # leading blocks cached, without touching them
        n = 0
        for _, key, _, _ in cache._chain(tokens, len(tokens) // BLOCK):
            if key not in cache.blocks:
                break
            n += 1
        return n

    cache.insert(a, group, 0, pin_tokens=2 * BLOCK)  # 2 pinned + 2 plain blocks
    cache.insert(b, group, 0)  # room from a's plain blocks only
    assert (held(a), held(b)) == (2, 4)
    cache.insert(c, group, 0)  # all of b goes, a's pinned blocks stay
    assert (held(a), held(b), held(c)) == (2, 0, 4)
    cache.insert(d, group, 0)  # 8 blocks; 4 fit once c is gone: d keeps its first 4
    assert (held(a), held(c), held(d)) == (2, 0, 4)
    cache.insert(e, group, 0, pin_tokens=4 * BLOCK)  # pinned; d's plain blocks go first
    assert (held(a), held(d), held(e)) == (2, 0, 4)
    assert cache.stats.evictions == 2 + 4 + 4 + 4 and cache.bytes_held == cache.capacity_bytes


@pytest.mark.parametrize("heads,dims", [((2, 2, 2), (4, 4, 4)), ((2, 1, 2), (4, 4, 8))])
def test_inserted_blocks_hold_their_own_copy_of_each_layer(heads, dims):
    """Every layer's keys and values of a row's new blocks, whatever it already held or
    its layers' shapes (alike: one copy a block; differing: layer by layer): equal to the row's slots, and sharing storage with neither the group nor
    another block, so that evicting a block frees it."""
    import torch

    from worker_service.kv_groups import KVGroup, KVShape

    shape = KVShape(heads, dims, heads, dims, torch.float32, torch.device("cpu"))
    group = KVGroup(shape)
    group.add_empty_row(0, 6 * BLOCK)
    group.add_empty_row(1, 6 * BLOCK)
    for t in group.keys + group.values:
        t.copy_(torch.randn(t.shape))
    cache = PrefixCache(shape, 64 * BLOCK * shape.bytes_per_token, BLOCK)
    rng = random.Random(5)
    tokens = [rng.randint(3, 999) for _ in range(5 * BLOCK + 3)]
    cache.insert(tokens[:2 * BLOCK], group, 1)  # blocks 0-1 from row 1
    cache.insert(tokens, group, 0)  # blocks 2-4 are new, from row 0
    blocks, reused = cache.match(tokens)
    assert reused == 5 * BLOCK and len(blocks) == 5
    storages = {t.untyped_storage().data_ptr() for t in group.keys + group.values}
    for b, block in enumerate(blocks):
        row = 1 if b < 2 else 0
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        for layer in range(shape.num_layers):
            keys, values = block.kv.layer(layer)
            assert torch.equal(keys, group.keys[layer][row, :, sl])
            assert torch.equal(values, group.values[layer][row, :, sl])
        own = {t.untyped_storage().data_ptr() for t in block.kv.tensors()}
        assert not own & storages
        storages |= own
    # A hit writes the blocks back into a row: one copy a block where the layers agree.
    row = group.add_empty_row(2, 6 * BLOCK)
    cache.copy_into(blocks, reused - 5, group, row)
    for b in range(5):
        sl = slice(b * BLOCK, min((b + 1) * BLOCK, reused - 5))
        source = 0 if b >= 2 else 1
        for layer in range(shape.num_layers):
            assert torch.equal(group.keys[layer][row, :, sl], group.keys[layer][source, :, sl])
            assert torch.equal(group.values[layer][row, :, sl],
                               group.values[layer][source, :, sl])


class _SortingCache(PrefixCache):
    """The eviction rule as a sort of every block at each pass: the reference for the heap."""

    def _make_room(self, nbytes: int, pinned: bool) -> bool:
        if self.bytes_held + nbytes <= self.capacity_bytes:
            return True
        victims = sorted((b for b in self.blocks.values() if pinned or not b.pinned),
                         key=lambda b: (b.pinned, b.last_used, -b.depth))
        for victim in victims:
            if victim.last_used == self._clock:
                continue
            del self.blocks[victim.key]
            self.bytes_held -= victim.nbytes
            self.stats.evictions += 1
            if self.bytes_held + nbytes <= self.capacity_bytes:
                return True
        return False


@pytest.mark.parametrize("seed", range(4))
def test_heap_eviction_evicts_what_sorting_every_block_would(seed):
    """Random prompts sharing prefixes, some pinned, inserted and matched into a small cache:
    the blocks held and the counts equal those of a sort of every block at each pass."""
    import torch

    from worker_service.kv_groups import KVGroup, KVShape

    shape = KVShape((1,), (1,), (1,), (2,), torch.float32, torch.device("cpu"))
    group = KVGroup(shape)
    group.add_empty_row(0, 12 * BLOCK)
    caches = [cls(shape, 20 * BLOCK * shape.bytes_per_token, BLOCK)
              for cls in (PrefixCache, _SortingCache)]
    rng = random.Random(seed)
    stems = [[rng.randint(3, 50) for _ in range(6 * BLOCK)] for _ in range(5)]
    for _ in range(300):
        stem = rng.choice(stems)[: rng.randint(0, 6) * BLOCK]
        tokens = stem + [rng.randint(3, 50) for _ in range(rng.randint(1, 6 * BLOCK))]
        pin = rng.choice([0, 0, 0, BLOCK, 2 * BLOCK])
        matched = rng.random() < 0.5
        for cache in caches:
            if matched:
                cache.match(tokens)
            cache.insert(tokens, group, 0, pin_tokens=pin)
        ours, ref = caches
        assert ours.blocks.keys() == ref.blocks.keys()
        assert (ours.bytes_held, ours.stats) == (ref.bytes_held, ref.stats)
    assert ref.stats.evictions > 100
