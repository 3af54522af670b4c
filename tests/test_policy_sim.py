"""bench/policy_sim.py: the simulation of one worker's loop under the real policies. Pure,
no processes; each case has an answer computable by hand."""

from __future__ import annotations

import pytest

from bench.policy_sim import (KnownLengthAdmission, SimConfig, SimRequest, StepModel, fcfs,
                              length_aware, simulate, true_length)

# Every Step takes 1 s whatever it holds, so a request of n output tokens occupies its slot
# for exactly n Steps (its first token comes with its prefill).
ONE_SECOND = StepModel(base_ms=1000, row_ms=0, prefill_token_ms=0, attention_ms=0)


def reqs(outputs: list[int], prompt: int = 8) -> list[SimRequest]:
    return [SimRequest(i, 0.0, tuple(range(1000 * i, 1000 * i + prompt)), n)
            for i, n in enumerate(outputs)]


def oracle() -> KnownLengthAdmission:
    return KnownLengthAdmission(true_length, aging_steps=1 << 30, bucket_tokens=1)


def test_equal_lengths_make_sjf_and_fcfs_the_same_schedule():
    rs = reqs([7] * 10)
    cfg = SimConfig(batch_limit=3, model=ONE_SECOND)
    a, b = simulate(rs, fcfs(), cfg), simulate(rs, oracle(), cfg)
    assert [r.e2e_s for r in a] == [r.e2e_s for r in b]
    # Batches of 3, 3, 3, 1, each 7 Steps: ends at 7, 14, 21, 28 s.
    assert sorted({r.e2e_s for r in a}) == [7.0, 14.0, 21.0, 28.0]


def test_one_long_job_ahead_of_short_ones():
    rs = reqs([10, 1, 1, 1])
    cfg = SimConfig(batch_limit=1, model=ONE_SECOND)
    f = simulate(rs, fcfs(), cfg)
    s = simulate(rs, oracle(), cfg)
    # FCFS: the long one ends at 10 s, the short ones at 11, 12, 13; SJF: 1, 2, 3, then 13.
    assert [r.e2e_s for r in f] == [10.0, 11.0, 12.0, 13.0]
    assert [r.e2e_s for r in s] == [13.0, 1.0, 2.0, 3.0]
    mean = lambda rs: sum(r.e2e_s for r in rs) / len(rs)  # noqa: E731
    assert mean(f) / mean(s) == pytest.approx(11.5 / 4.75)
    assert [r.ttft_s for r in s] == [4.0, 1.0, 2.0, 3.0]


def test_length_aware_with_a_learned_predictor_runs_short_bins_first():
    # Warm-up: short prompts answered in 2 tokens, long prompts in 40 (length bins).
    warm = [SimRequest(100 + i, 0.0, tuple(range(5000 + 100 * i, 5000 + 100 * i + p)), n)
            for i, (p, n) in enumerate([(8, 2)] * 3 + [(60, 40)] * 3)]
    rs = [SimRequest(0, 0.0, tuple(range(60)), 40), SimRequest(1, 0.0, tuple(range(200, 260)), 40),
          SimRequest(2, 0.0, tuple(range(400, 408)), 2)]
    cfg = SimConfig(batch_limit=1, model=ONE_SECOND)
    out = simulate(rs, length_aware(warm, aging_steps=1 << 30, bucket_tokens=1), cfg)
    assert [r.e2e_s for r in out] == [42.0, 82.0, 2.0]


def test_prefill_chunks_and_the_step_model():
    # One 3000-token prompt under a 2048-token budget: two prefill Steps, 1 token.
    m = StepModel()
    out = simulate([SimRequest(0, 0.0, tuple(range(3000)), 1)], fcfs(),
                   SimConfig(batch_limit=1, model=m))
    expect = m.seconds(0, [(0, 2048)]) + m.seconds(0, [(2048, 3000)])
    assert out[0].e2e_s == pytest.approx(expect)
    # The fit against the figures it was fitted to (docs/benchmarks.md).
    assert m.seconds(1, []) * 1000 == pytest.approx(25.4, rel=0.07)
    assert m.seconds(64, []) * 1000 == pytest.approx(90.5, rel=0.02)
    assert m.seconds(0, [(0, 2000)]) * 1000 == pytest.approx(2146 / 1.10, rel=0.01)
    assert m.seconds(0, [(0, 128)] * 16) * 1000 == pytest.approx(1230 / 1.09, rel=0.01)
