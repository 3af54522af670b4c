"""Proactive swap-in (FastServe): the scheduler names swapped-out sequences about to run
again in StepRequest.prefetch, the worker copies their KV back to the device ahead of
their swap_in, and the swap_in uses that copy. The choice is pure (preemption.py); the
worker's copy is tested on the engine; the two accounts are compared Step by Step with
the real loop driving a real engine."""

from __future__ import annotations

import pytest
import torch

from scheduler_service.params import DecodingConfig
from scheduler_service.preemption import (AUTO_PREFETCH, PREFETCH_LOOKAHEAD_STEPS, SwapFacts,
                                          Swapper, prefetch_limit, slots_soon)
from scheduler_service.sequence import Sequence
from seqserve_common.decoding import DecodingStrategy
from tests.conftest import tiny_model
from tests.test_engine import _reference
from tests.test_kv_swap import DEVICES, _engines, _prompts
from tests.test_swap_account import _run
from worker_service.engine import StepError
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec

FACTS = SwapFacts(kv_bytes_per_token=10, capacity_bytes=1 << 20,
                  copy_bytes_per_second=1e9, prefill_tokens_per_second=1e3)


def _seq(seq_id: int, prompt: int, generated: int = 0, max_new: int = 20) -> Sequence:
    s = Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_ids=[1] * prompt,
                 params=DecodingConfig(max_new_tokens=max_new,
                                       strategy=DecodingStrategy.GREEDY),
                 detokenizer=None, stops=None)
    s.output_ids = [2] * generated
    return s


def _swapped(swapper: Swapper, *seqs: Sequence) -> None:
    for s in seqs:
        assert swapper.stop(s)


def test_the_limit_is_on_where_copies_can_overlap_the_steps():
    assert prefetch_limit(-1, "cpu") == 0
    assert prefetch_limit(-1, "cuda:0") == prefetch_limit(-1, "cuda") == AUTO_PREFETCH
    assert prefetch_limit(3, "cpu") == 3 and prefetch_limit(0, "cuda:1") == 0


def test_slots_soon_counts_free_slots_and_sequences_near_their_limit():
    near = _seq(1, 5, generated=20 - PREFETCH_LOOKAHEAD_STEPS - 1)  # ends within the look
    far = _seq(2, 5, generated=20 - PREFETCH_LOOKAHEAD_STEPS - 2)
    assert slots_soon([], 4) == 4
    assert slots_soon([near, far], 2) == 1
    assert slots_soon([near, far], 3) == 2
    far.in_flight = 1  # its token in flight brings it within the look too
    assert slots_soon([near, far], 2) == 2


def test_the_head_of_the_order_is_prefetched_while_it_fits():
    swapper = Swapper("swap", FACTS, prefetch_limit=2)
    a, b, c = _seq(1, 9, 1), _seq(2, 19, 1), _seq(3, 4, 1)  # 9, 19 and 4 KV tokens
    _swapped(swapper, a, b, c)
    fresh = _seq(4, 30)  # not swapped: nothing to copy back, and it takes no place
    swapper.plan_prefetch([fresh, a, b, c], free_tokens=30)
    assert swapper.take_prefetches() == ([1, 2], [])
    assert swapper.prefetched == {1: 9, 2: 19}
    # The same choice again sends nothing; less room frees b and stops there, as
    # admission stops at the first that does not fit (c would fit, but comes after b).
    swapper.plan_prefetch([a, b, c], free_tokens=30)
    assert swapper.take_prefetches() == ([], [])
    swapper.plan_prefetch([a, b, c], free_tokens=20)
    assert swapper.take_prefetches() == ([], [2])
    # b swapped in (without its copy) and c chosen; a left the head: its copy is freed.
    swapper.back(b)
    swapper.plan_prefetch([c], free_tokens=20)
    assert swapper.take_prefetches() == ([3], [1]) and swapper.prefetched == {3: 4}
    swapper.prefetch_limit = 0
    swapper.plan_prefetch([a, c], free_tokens=100)
    assert swapper.take_prefetches() == ([], [3]) and not swapper.prefetched


def test_no_more_than_the_limit_is_copied_ahead():
    swapper = Swapper("swap", FACTS, prefetch_limit=2)
    a, b, c = _seq(1, 9, 1), _seq(2, 9, 1), _seq(3, 9, 1)
    _swapped(swapper, a, b, c)
    swapper.plan_prefetch([a, b, c], free_tokens=1000)  # room for all three
    assert swapper.take_prefetches() == ([1, 2], [])


def test_a_victim_is_not_copied_back_by_the_step_that_swaps_it_out():
    swapper = Swapper("swap", FACTS, prefetch_limit=2)
    a = _seq(1, 9, 1)
    _swapped(swapper, a)
    swapper.plan_prefetch([a], free_tokens=100, exclude=swapper.take_pending())
    assert swapper.take_prefetches() == ([], [])
    swapper.plan_prefetch([a], free_tokens=100)
    assert swapper.take_prefetches() == ([1], [])


def test_a_sequence_swapped_in_or_dropped_needs_no_unprefetch():
    swapper = Swapper("swap", FACTS, prefetch_limit=3)
    a, b, c = _seq(1, 9, 1), _seq(2, 9, 1), _seq(3, 9, 1)
    _swapped(swapper, a, b, c)
    swapper.plan_prefetch([a, b, c], free_tokens=100)
    swapper.take_prefetches()
    swapper.back(a)  # its swap_in uses the copy
    swapper.plan_prefetch([c], free_tokens=100)  # b no longer chosen
    swapper.drop(b)  # released in the same Step: the worker frees its copy with it
    assert swapper.take_prefetches() == ([], []) and swapper.prefetched == {3: 9}
    swapper.forget()
    assert not swapper.prefetched and swapper.take_prefetches() == ([], [])


def _run_prefetched(engine, steps: int, out_at: int, prefetch_at: int, back_at: int,
                    unprefetch_at: int | None = None):
    """Greedy sequences 0-3; 1 and 3 are swapped out at `out_at`, prefetched at
    `prefetch_at` (3's copy freed again at `unprefetch_at`) and back at `back_at`."""
    prompts = _prompts()
    specs = [PrefillSpec(i, p, 0, DecodingParams()) for i, p in enumerate(prompts)]
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    live, hits = {0, 1, 2, 3}, 0
    for step in range(steps):
        swap_out = [1, 3] if step == out_at else []
        swap_in = [1, 3] if step == back_at else []
        live = (live - set(swap_out)) | set(swap_in)
        ids = sorted(live)
        result = engine.step([], specs if step == 0 else [], [p for p in (ids[::2], ids[1::2]) if p],
                             swap_out=swap_out, swap_in=swap_in,
                             prefetch=[1, 3] if step == prefetch_at else [],
                             unprefetch=[3] if step == unprefetch_at else [])
        if step == prefetch_at:
            assert engine.swap.prefetched == 2
        if step == back_at - 1:
            # From here only a device copy holds the right KV: a swap-in that read the
            # host copy instead would change the outputs.
            for entry in engine.swap._held.values():
                if entry.device_kv is not None:
                    if entry.ready is not None:
                        torch.cuda.synchronize()  # the side stream's copy reads it
                    for t in entry.kv.tensors():
                        t.zero_()
        hits += result.prefetched_swap_ins
        for t in result.tokens:
            got[t.seq_id].append(t.token_id)
    return got, hits


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefetched_sequence_decodes_on_from_its_device_copy(device):
    model_dir = tiny_model("llama")
    _, engine = _engines(model_dir, device)
    got, hits = _run_prefetched(engine, 12, out_at=3, prefetch_at=5, back_at=7)
    assert hits == 2, "both swap-ins used their prefetched copies"
    assert len(engine.swap) == 0 and engine.swap.prefetched == 0
    for i, prompt in enumerate(_prompts()):
        assert got[i] == _reference(model_dir, prompt, len(got[i])), i


def test_an_unprefetched_sequence_comes_back_from_host_memory():
    model_dir = tiny_model("llama")
    _, engine = _engines(model_dir)
    got, hits = _run_prefetched(engine, 10, out_at=2, prefetch_at=3, back_at=6,
                                unprefetch_at=4)
    assert hits == 1  # 1 from its copy, 3 from the swap space
    for i, prompt in enumerate(_prompts()):
        assert got[i] == _reference(model_dir, prompt, len(got[i])), i


def test_prefetches_of_sequences_not_swapped_out_fail_clearly():
    _, engine = _engines(tiny_model("llama"))
    engine.step([], [PrefillSpec(1, [3, 4, 5, 6], 0, DecodingParams())], [[1]])
    with pytest.raises(StepError, match="prefetch of sequence 1, which this worker does not"):
        engine.step([], [], [[1]], prefetch=[1])
    engine.step([], [], [], swap_out=[1], prefetch=[1])
    assert engine.swap.prefetched == 1
    with pytest.raises(StepError, match="unprefetch of sequence 7"):
        engine.step([], [], [], unprefetch=[7])
    engine.step([1], [], [])  # released while prefetched: both copies go
    assert len(engine.swap) == 0 and engine.swap.prefetched == 0


def test_the_loop_prefetches_the_victims_before_they_run_again():
    """The real loop with two slots, priorities and swapping (test_swap_account.py), and
    prefetch on: both victims' KV is copied back while the urgent requests finish, both
    swap-ins use those copies, after every Step the worker holds a device copy of exactly
    the sequences the scheduler counts as prefetched, and every output is generate's."""
    model_dir, seqs, loop, worker = _run(2, swap_tokens=1000, prefetch=2)
    assert worker.most_swapped == 2
    assert worker.servicer.metrics.prefetched_swap_ins._value.get() == 2
    held = worker.prefetch_accounts
    mismatched = [(i, h) for i, h in enumerate(held) if h[0] != h[1]]
    assert not mismatched, f"(Step, (scheduler's, worker's)): {mismatched}"
    # Copied back only once the urgent requests near their end, not through their 24
    # Steps: the look ahead, then the urgent ones' last Step, the 2 Steps in flight
    # before its answer frees their slots, and the Step that admits the victims.
    held_steps = sum(bool(h[0]) for h in held)
    assert 0 < held_steps <= PREFETCH_LOOKAHEAD_STEPS + 4, held_steps
    assert not loop.swapper.prefetched
    for s in seqs:
        assert s.output_ids == _reference(model_dir, s.prompt_ids, len(s.output_ids))


def test_the_loop_prefetches_in_the_policys_order_within_the_budget():
    """One copy ahead: the victim admission takes first (the two low requests tie on
    priority, so the earlier one) is copied, not the other. With a KV budget that the
    running requests' reservations and one Step's reserve fill, none is copied, and the
    victims come back from host memory; outputs are generate's either way, and no Step
    copies back a victim it swaps out."""
    model_dir, seqs, loop, first = _run(2, swap_tokens=1000, prefetch=1)
    chosen = [h[0] for h in first.prefetch_accounts if h[0]]
    assert chosen[0] == {seqs[0].seq_id}, chosen
    assert first.servicer.metrics.prefetched_swap_ins._value.get() == 2  # one at a time
    # Room for the running reservations (2 x (12 + 24) tokens) and the 4096-token reserve
    # for arrivals, none for a victim's 15 or more: nothing is copied ahead.
    model_dir, tight, _, worker = _run(2, swap_tokens=1000, prefetch=2, kv_budget=4096 + 72)
    assert worker.most_swapped == 2 and not any(h[0] for h in worker.prefetch_accounts)
    assert worker.servicer.metrics.prefetched_swap_ins._value.get() == 0
    for s in [*seqs, *tight]:
        assert s.output_ids == _reference(model_dir, s.prompt_ids, len(s.output_ids))
    for request in first.requests:
        assert not set(request.swap_out) & set(request.prefetch)
