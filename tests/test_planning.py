"""Pure scheduler logic: waiting queue, FCFS admission, batch plans. No gRPC, no model."""

from __future__ import annotations

import pytest

from scheduler_service.admission import Budget, FCFSAdmission, QueueFull, WaitingQueue
from scheduler_service.batch_plan import BatchPlanner
from scheduler_service.params import DecodingConfig
from scheduler_service.sequence import Sequence
from seqserve_common.decoding import DecodingStrategy


def seq(sid: int, prompt_len: int, max_new: int = 10, generated: int = 0) -> Sequence:
    s = Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[1] * prompt_len,
                 params=DecodingConfig(max_new_tokens=max_new, strategy=DecodingStrategy.GREEDY),
                 detokenizer=None, stops=None)
    s.output_ids = [2] * generated
    return s


def test_queue_is_bounded_and_fcfs():
    q = WaitingQueue(2)
    a, b, c = seq(1, 5), seq(2, 5), seq(3, 5)
    q.push(a)
    q.push(b)
    with pytest.raises(QueueFull, match="full"):
        q.push(c)
    assert q.pop() is a
    q.push_front([c])
    assert [s.seq_id for s in q] == [3, 2]
    assert q.remove(b) and not q.remove(b)


def test_fcfs_admits_in_order_within_slots_and_tokens():
    q = WaitingQueue(10)
    for i, n in enumerate([10, 20, 5, 5]):
        q.push(seq(i, n, max_new=10))
    admitted = FCFSAdmission().admit(q, Budget(free_slots=3, free_kv_tokens=50))
    # 20 + 30 = 50 fits; the third (15) does not, and FCFS does not skip it for the fourth.
    assert [s.seq_id for s in admitted] == [0, 1]
    assert [s.seq_id for s in q] == [2, 3]
    admitted = FCFSAdmission().admit(q, Budget(free_slots=1, free_kv_tokens=1000))
    assert [s.seq_id for s in admitted] == [2]


def test_prefill_budget_spreads_a_burst_over_steps():
    q = WaitingQueue(10)
    for i, n in enumerate([300, 300, 300, 5000]):
        q.push(seq(i, n))
    budget = Budget(free_slots=10, free_kv_tokens=10**6, prefill_tokens=700)
    assert [s.seq_id for s in FCFSAdmission().admit(q, budget)] == [0, 1]
    assert [s.seq_id for s in FCFSAdmission().admit(q, budget)] == [2]
    # A prompt longer than the budget still runs, alone, when it reaches the head.
    assert [s.seq_id for s in FCFSAdmission().admit(q, budget)] == [3]


def test_planner_reuses_partition_until_membership_changes():
    planner = BatchPlanner(max_sparsity=0.025, max_splits=4)
    running = [seq(1, 38), seq(2, 33), seq(3, 24), seq(4, 22)]
    plan = planner.plan([], running, [])
    assert plan.regrouped and plan.groups == [[1], [2], [3, 4]]
    assert [s.seq_id for s in plan.prefill] == [1, 2, 3, 4]
    for s in running:
        s.output_ids.append(7)  # everyone one token longer
    again = planner.plan(running, [], [])
    assert not again.regrouped and again.groups == plan.groups and again.prefill == []
    assert again.partition.padding == plan.partition.padding
    joined = planner.plan(running, [seq(5, 300)], [])
    assert joined.regrouped and [5] in joined.groups
    left = planner.plan(running[:3], [], [4])
    assert left.regrouped and left.release == [4]
    assert sorted(sum(left.groups, [])) == [1, 2, 3]
