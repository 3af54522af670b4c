"""The worker's length probe (worker_service/length_probe.py) as pure logic: no prediction
before it has enough exact labels, learns a separable problem online, the censoring rule
(a cut sequence is a lower bound, not its length); and the scheduler's use of its
prediction (policy length-aware takes it over the prompt-id one)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from client import Client
from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.policies.length_aware import LengthAwareAdmission
from scheduler_service.policies.length_predictor import LengthPredictor
from scheduler_service.sequence import FinishReason
from tests import reference
from tests.test_length_aware import run_together_with_a_preemption, seq
from worker_service.length_probe import LengthProbe, ProbeConfig

D = 16
LENGTHS = (20, 120, 220, 420)  # one per cluster, each in its own 50-token bucket


@pytest.fixture(autouse=True)
def one_thread():
    """The probe's tensors are tiny: on a busy machine intra-op threads only wait on each
    other (the worker runs it on its compute thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _clusters(seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LENGTHS), D, generator=g) * 3, g


def _sample(centers, g, c: int) -> torch.Tensor:
    return centers[c] + torch.randn(D, generator=g)


def test_no_prediction_before_min_samples_exact_labels():
    probe = LengthProbe(D, ProbeConfig(min_samples=5))
    x = torch.randn(D)
    for i in range(5):
        assert probe.observe(i, x) is None
        probe.finished(i, 30, exact=False)  # censored ones do not count
    for i in range(5, 9):
        assert probe.observe(i, x) is None
        probe.finished(i, 30, exact=True)
    assert probe.observe(9, x) is None
    probe.finished(9, 30, exact=True)
    assert probe.observe(10, x) is not None


def test_minibatches_sample_the_window_uniformly():
    """Every minibatch row is drawn uniformly (seeded) from the samples held: the newest
    labels are no likelier than the rest, and the draw repeats with the seed."""
    def rows_drawn(cfg: ProbeConfig, labels: int, batches: int) -> torch.Tensor:
        probe = LengthProbe(D, cfg)
        drawn = []
        rows = probe._rows
        probe._rows = lambda: drawn.append(rows()) or drawn[-1]
        for i in range(labels):
            probe.learn(torch.randn(D), 30 + i, exact=True)
        assert probe.train(batches) == batches
        return torch.cat(drawn)

    cfg = ProbeConfig(window=64, batch=32, updates=4, seed=3)
    rows = rows_drawn(cfg, 64, 16)  # 512 rows over 64 slots
    assert torch.equal(rows, rows_drawn(cfg, 64, 16))  # seeded
    newest = (rows >= 48).float().mean().item()  # the newest 16 of 64 labels: 1/4
    assert 0.18 < newest < 0.32
    first = rows[:4 * 32]  # the first minibatches after the labels came, too
    assert 0.12 < (first >= 48).float().mean().item() < 0.40
    counts = torch.bincount(rows, minlength=64)
    assert (counts > 0).all() and counts.max() <= 20  # 8 expected a slot
    # The window wrapped: 100 labels in 64 slots, each slot held, each drawn alike.
    assert rows_drawn(cfg, 100, 16).max() == 63


def test_learns_a_separable_problem_online():
    centers, g = _clusters()
    probe = LengthProbe(D, ProbeConfig(min_samples=16))
    hits = total = 0
    for i in range(300):
        c = int(torch.randint(len(LENGTHS), (1,), generator=g))
        predicted = probe.observe(i, _sample(centers, g, c))
        if i >= 150:  # predicted before it learns this one
            total += 1
            hits += predicted is not None and abs(predicted - LENGTHS[c]) <= 25
        probe.finished(i, LENGTHS[c], exact=True)
        probe.train(4)
    assert hits / total > 0.95


def test_censored_label_is_a_lower_bound_not_a_length():
    """Cluster 0 answers 220 tokens, but half of its sequences are cut at 60 (a lower
    bound, consistent with 220): learned as lengths they would pull its prediction to
    about 140. A cut in the first bucket says nothing and is not stored."""
    centers, g = _clusters(1)
    probe = LengthProbe(D, ProbeConfig(min_samples=8))
    for i in range(200):
        c = i % 2
        probe.observe(i, _sample(centers, g, c))
        if c == 0:
            probe.finished(i, 60 if i % 4 == 0 else 220, exact=i % 4 != 0)
        else:
            probe.finished(i, 20, exact=True)
        probe.train(4)
    cut = probe.observe(10_000, _sample(centers, g, 0))
    short = probe.observe(10_001, _sample(centers, g, 1))
    assert short is not None and short <= 30
    assert cut is not None and cut > 190
    stored = probe.censored
    probe.observe(10_002, centers[0])
    probe.finished(10_002, 30, exact=False)
    assert probe.censored == stored
    probe.finished(12_345, 100, exact=True)  # never observed (or forgotten): ignored
    assert probe.exact == 150


def test_the_hidden_prediction_replaces_the_prompt_one_and_resizes_the_reservation():
    policy = LengthAwareAdmission(LengthPredictor(), aging_steps=1000)
    q = WaitingQueue(100)
    a, b = seq(1, [1] * 10, max_new=500), seq(2, [2] * 10, max_new=500)
    q.push(a)
    q.push(b)
    assert policy.admit(q, Budget(2, 10_000)) == [a, b]
    assert a.reserve_new_tokens == b.reserve_new_tokens == 500  # no data: max_new_tokens
    a.hidden_predicted_tokens, b.hidden_predicted_tokens = 30, 700
    assert policy.preempt(q, [a, b], Budget(0, 0)) == []
    assert (a.predicted_tokens, a.reserve_new_tokens) == (30, 50)  # shrunk to its bucket
    assert (b.predicted_tokens, b.reserve_new_tokens) == (500, 500)  # capped by max_new
    assert policy._grown == -450  # admission gets the room back
    # Growing needs room: without it the prediction waits (the outgrow rule still holds).
    c = seq(3, [3] * 10, max_new=500)
    c.reserve_new_tokens, c.predicted_tokens, c.hidden_predicted_tokens = 50, 40, 300
    policy.preempt(q, [c], Budget(0, 100))
    assert c.reserve_new_tokens == 50
    policy.preempt(q, [c], Budget(0, 250))
    assert (c.predicted_tokens, c.reserve_new_tokens) == (300, 300)


def test_prompt_only_ignores_the_worker_and_hidden_only_reserves_max_new_tokens():
    predictor = LengthPredictor()
    for n in range(3):
        predictor.learn(10, [], 20)
    prompt_only = LengthAwareAdmission(predictor, 1000, use_hidden=False)
    hidden_only = LengthAwareAdmission(predictor, 1000, use_prompt=False)
    for policy, reserved in ((prompt_only, 50), (hidden_only, 500)):
        q = WaitingQueue(100)
        s = seq(1, [1] * 10, max_new=500)
        q.push(s)
        policy.admit(q, Budget(1, 10_000))
        assert s.reserve_new_tokens == reserved
        s.hidden_predicted_tokens = 120
        policy.preempt(q, [s], Budget(0, 10_000))
        assert s.reserve_new_tokens == (50 if policy is prompt_only else 150)



def test_hidden_only_counts_no_prediction_until_the_worker_gives_one():
    """length_predictor=hidden reserves max_new_tokens before the worker's prediction; that
    is not a prediction, so the error and Acc metrics must not score it."""
    policy = LengthAwareAdmission(LengthPredictor(), 1000, use_prompt=False)
    q = WaitingQueue(100)
    s = seq(1, [1] * 10, max_new=500)
    q.push(s)
    assert policy.admit(q, Budget(1, 10_000)) == [s]
    assert (s.predicted_tokens, s.reserve_new_tokens) == (None, 500)
    s.output_ids = [7] * 40  # ended by EOS with no worker prediction (probe not ready)
    metrics = SchedulerMetrics()
    metrics.observe_finish(s, FinishReason.EOS, 0.0)
    assert metrics.length_predictions._value.get() == 0


@pytest.mark.slow
def test_the_worker_prediction_arrives_and_shrinks_the_reservation(llama_dir, deploy):
    """With length_predictor=hidden, a request reserves prompt + max_new_tokens (20 + 120 of
    a 240-token budget: one at a time) until the worker's prediction comes with its first
    token. The probe learns (min_samples 1) from one request ended by a stop string after
    a few tokens, so it predicts a few tokens: the reservations shrink to a bucket and two
    120-token requests run together until they outgrow it (a preemption shows it). Greedy
    outputs equal model.generate."""
    small = {"max_num_batched_tokens": 128}
    # Both processes read the policy, as from one serving.properties: the worker keeps a
    # probe only where the scheduler reads it (ServingConfig.length_probe_used).
    policy = {"scheduling_policy": "length-aware", "length_predictor": "hidden"}
    d = deploy(llama_dir, {**small, **policy, "kv_cache_bytes": 240 * 512,
                           "length_probe_min_samples": 1},
               **small, **policy, max_rolling_batch_size=4)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(7)
    first = reference.prompt_of_tokens(tok, 20, rng)
    stop = tok.decode(reference.greedy(llama_dir, first, 4))
    with Client(d.address) as c:
        assert c.generate(first, max_new_tokens=60, stop=[stop]).finish_reason == "stop"
    prompts = [reference.prompt_of_tokens(tok, 20, rng) for _ in range(2)]
    run_together_with_a_preemption(d, llama_dir, tok, prompts, 120)


def test_only_length_aware_with_a_hidden_predictor_keeps_a_probe():
    """Other policies never read the probe, so its worker cost and the scheduler's labels
    are paid only where it is read."""
    from seqserve_common.config import ServingConfig

    used = {(p, u): ServingConfig(scheduling_policy=p, length_predictor=u).length_probe_used
            for p in ("fcfs", "priority", "mlfq", "length-aware", "length-batched")
            for u in ("both", "prompt", "hidden")}
    assert {k for k, v in used.items() if v} == {("length-aware", "both"),
                                                  ("length-aware", "hidden")}
