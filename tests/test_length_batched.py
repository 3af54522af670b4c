"""Pure planning of policy length-batched (scheduler_service/policies/length_batched.py):
groups of similar predicted length in order, VBS (batch size from the KV token budget and
the group's limit) and FCR (stopped at the limit, collected, run last with room to
finish). No gRPC, no model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.params import DecodingConfig
from scheduler_service.policies import make_policy
from scheduler_service.policies.length_aware import GROW_MARGIN, grow_margin
from scheduler_service.policies.length_batched import LengthBatchedAdmission, vbs_batch_size
from scheduler_service.policies.length_predictor import LengthPredictor, PredictorConfig
from scheduler_service.preemption import preempt
from scheduler_service.sequence import FinishReason, Sequence, Status
from seqserve_common.config import ServingConfig
from seqserve_common.decoding import DecodingStrategy

BUCKET = 50


def seq(sid: int, hint: int | None, prompt_len: int = 10, max_new: int = 400) -> Sequence:
    return Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[sid] * prompt_len,
                    params=DecodingConfig(max_new_tokens=max_new,
                                          strategy=DecodingStrategy.GREEDY),
                    detokenizer=None, stops=None, arrival_time=float(sid), length_hint=hint)


def policy() -> LengthBatchedAdmission:
    return LengthBatchedAdmission(LengthPredictor(PredictorConfig(bucket_tokens=BUCKET)))


def queue(*seqs: Sequence) -> WaitingQueue:
    q = WaitingQueue(1000)
    for s in seqs:
        q.push(s)
    return q


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def room(slots: int = 100, kv: int = 10**6) -> Budget:
    return Budget(free_slots=slots, free_kv_tokens=kv)


def test_groups_run_shortest_limit_first_arrival_order_within():
    # Predicted 120, 30, 260, 45, 101 tokens: limits 150, 50, 300, 50, 150.
    q = queue(seq(1, 120), seq(2, 30), seq(3, 260), seq(4, 45), seq(5, 101))
    assert ids(policy().admit(q, room())) == [2, 4, 1, 5, 3]


def test_vbs_reserves_the_group_limit_so_short_groups_run_larger_batches():
    # The paper's rule: batch x length about constant under one token budget.
    assert vbs_batch_size(50, 10, 6000, 1000) == 100
    assert vbs_batch_size(290, 10, 6000, 1000) == 20
    assert vbs_batch_size(300, 10, 6000, 1000) == 19
    assert vbs_batch_size(50, 10, 6000, 64) == 64  # within max_rolling_batch_size
    assert vbs_batch_size(5000, 10, 6000, 64) == 1
    shorts = [seq(i, 40) for i in range(1, 200)]
    admitted = policy().admit(queue(*shorts), room(kv=6000))
    # Each reserves its limit and the tokens Steps in flight may add past it.
    assert len(admitted) == vbs_batch_size(50 + GROW_MARGIN, 10, 6000, 1000) == 88
    assert all(s.reserved_tokens == 10 + 50 + GROW_MARGIN for s in admitted)
    longs = [seq(i, 290) for i in range(1, 200)]
    assert len(policy().admit(queue(*longs), room(kv=6000))) == 18  # limit 300


def test_fcr_stops_a_sequence_at_its_limit_and_runs_it_after_every_group():
    p = policy()
    first, later, longer = seq(1, 40), seq(2, 40), seq(3, 140)
    q = queue(first, later, longer)
    assert ids(p.admit(q, room(slots=1))) == [1]
    first.status = Status.RUNNING
    first.output_ids = [7] * (BUCKET - 1)
    first.in_flight = 2  # its last token may yet be EOS: not a failure yet
    running = {1: first}
    victims, budget = preempt(p, q, running, room(slots=0, kv=0))
    assert victims == [] and running == {1: first}  # still short of its limit
    first.output_ids.append(7)
    victims, budget = preempt(p, q, running, room(slots=0, kv=0))
    assert victims == [first] and running == {} and p.failures == 1
    assert first.status is Status.WAITING and first.reserve_new_tokens == 400
    q.push_front(victims)
    # The collected failure waits behind both groups still to run, and then reserves
    # room for max_new_tokens: its grown reservation is taken off the budget it handed back.
    assert ids(p.order(q)) == [2, 3, 1]
    assert budget.free_kv_tokens == 10 + 400
    # Only its old reservation (10 + 58) came back: room for the next of its group only.
    assert ids(p.admit(q, replace(budget, free_slots=10))) == [2]
    assert ids(p.admit(q, room())) == [3, 1]


def test_fcr_failure_is_counted_once_and_never_stopped_again():
    p = policy()
    s = seq(1, 10, max_new=200)
    p.admit(queue(s), room())
    s.status = Status.RUNNING
    s.output_ids = [7] * 49
    assert p.preempt(queue(), [s], room()) == []
    s.output_ids.append(7)
    assert p.preempt(queue(), [s], room()) == [s]
    assert p.preempt(queue(), [s], room()) == []  # once stopped, never again
    s.status = Status.RUNNING
    s.output_ids = [7] * 190
    assert p.preempt(queue(), [s], room()) == []
    assert p.failures == 1 and p._grown == 200 - (50 + GROW_MARGIN)  # once, to max_new


def test_a_failure_moved_to_another_workers_loop_is_not_stopped_or_learned_twice():
    """Data parallel: one policy per worker's loop, one shared predictor. A failure that
    waits when its worker drains or dies moves to another loop (worker_pool.py); that
    loop's policy must still run it last, not stop it again at its limit (a second count
    and a wasted recompute), and the predictor must learn its length once."""
    predictor = LengthPredictor(PredictorConfig(bucket_tokens=BUCKET))
    a, b = LengthBatchedAdmission(predictor), LengthBatchedAdmission(predictor)
    s = seq(1, 10, max_new=200)  # its group's limit: 50
    a.admit(queue(s), room())
    s.status = Status.RUNNING
    s.output_ids = [7] * 50
    assert a.preempt(queue(), [s], room()) == [s] and a.failures == 1
    s.status = Status.WAITING
    fresh = seq(2, 40, max_new=200)
    q = queue(fresh, s)  # moved: the other loop adopts it ahead of its own queue
    q.push_front([q.pop()])
    assert ids(b.order(q)) == [2, 1]  # still collected behind the groups to run
    assert ids(b.admit(q, room())) == [2, 1]
    s.status = Status.RUNNING
    s.output_ids = [7] * 120
    assert b.preempt(queue(), [s], room()) == [] and a.failures + b.failures == 1
    s.status, s.finish_reason = Status.FINISHED, FinishReason.EOS
    learned = predictor.learned
    a._learn()
    b._learn()
    assert predictor.learned == learned + 1


def test_without_a_hint_the_shared_predictor_decides():
    p = policy()
    for _ in range(3):
        p.predictor.learn(10, [], 120)
    s = seq(1, None)
    p.admit(queue(s), room())
    assert s.predicted_tokens == 120 and s.reserve_new_tokens == 150 + GROW_MARGIN


def test_make_policy_by_name():
    p = make_policy(ServingConfig(scheduling_policy="length-batched", length_bucket_tokens=20))
    assert isinstance(p, LengthBatchedAdmission) and p.predictor.cfg.bucket_tokens == 20


@pytest.mark.parametrize("in_flight, margin", [(1, GROW_MARGIN), (2, GROW_MARGIN),
                                               (7, GROW_MARGIN), (8, 9), (20, 21)])
def test_the_reservation_margin_covers_the_configured_steps_in_flight(in_flight, margin):
    """FCR stops a sequence once it has received its group's limit of tokens; the Steps in
    flight by then (up to steps_in_flight, the one planned last included) add tokens past
    the limit, so the KV reservation must hold more than steps_in_flight tokens past it."""
    cfg = ServingConfig(scheduling_policy="length-batched", steps_in_flight=in_flight)
    s = seq(1, 40)
    p = make_policy(cfg)
    p.admit(queue(s), room())
    assert s.reserve_new_tokens == 50 + margin and margin > in_flight
    aware = make_policy(ServingConfig(scheduling_policy="length-aware",
                                      steps_in_flight=in_flight))
    assert aware.margin == margin
    with pytest.raises(ValueError, match="steps_in_flight must be >= 1"):
        grow_margin(0)


def test_prediction_error_and_accuracy_metrics():
    m = SchedulerMetrics()
    for predicted, real in ((100, 30), (40, 90), (10, 300)):  # errors 70, 50, 290
        s = seq(1, None)
        s.predicted_tokens, s.output_ids = predicted, [7] * real
        m.observe_finish(s, FinishReason.EOS, 0.0)
    m.observe_finish(seq(2, None), FinishReason.EOS, 0.0)  # no prediction: not counted
    got = {k: v for k, v in scrape_registry(m).items() if "length_prediction" in k}
    assert got == {"seqserve_length_predictions_total": 3,
                   "seqserve_length_prediction_error_tokens_total": 70 + 50 + 290,
                   "seqserve_length_predictions_within_total{tokens=50}": 1,
                   "seqserve_length_predictions_within_total{tokens=100}": 2}


def scrape_registry(m: SchedulerMetrics) -> dict[str, float]:
    return {(f"{s.name}{{{','.join(f'{k}={v}' for k, v in s.labels.items())}}}"
             if s.labels else s.name): s.value
            for family in m.registry.collect() for s in family.samples
            if not s.name.endswith("_created")}
