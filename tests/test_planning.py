"""Pure scheduler logic: waiting queue, FCFS admission, batch plans, the token budget of
chunked prefill and the Step message. No gRPC, no model."""

from __future__ import annotations

import pytest

from scheduler_service.admission import Budget, FCFSAdmission, QueueFull, WaitingQueue
from scheduler_service.batch_plan import BatchPlanner
from scheduler_service.chunking import Chunk, StepBudget
from scheduler_service.params import DecodingConfig
from scheduler_service.sequence import Sequence
from scheduler_service.worker_client import encode_step
from seqserve_common.decoding import DecodingStrategy


def fcfs_step_budget(max_num_batched_tokens: int, chunked: bool, running) -> StepBudget:
    """A Step's budget as the loop pays it under FCFS: the decoding rows, then the next
    chunks of the prompts begun, in their order; what is left is for new requests."""
    running = list(running)
    budget = StepBudget.for_decoding(max_num_batched_tokens, chunked, running)
    if chunked:
        budget.take(s for s in running if s.prefilling)
    return budget


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


# --- chunked prefill: the step's token budget (chunking.py) --------------------------------

def admitted(s: Sequence) -> Sequence:
    """As the loop admits it: its prompt and output are to be prefilled."""
    s.start_running(now=0.0)
    return s


def test_decoding_rows_come_first_then_chunks_fill_the_budget():
    decoding = [seq(1, 50, generated=3), seq(2, 40, generated=1)]
    contrastive = seq(3, 30, generated=2)
    contrastive.params = DecodingConfig(max_new_tokens=10, strategy=DecodingStrategy.CONTRASTIVE,
                                        top_k=4, penalty_alpha=0.6)
    long, short = admitted(seq(4, 300)), admitted(seq(5, 20))
    long.prefilled = 10  # begun in an earlier step
    budget = fcfs_step_budget(100, True, decoding + [contrastive, long])
    # The decoding rows leave 100 - 1 - 1 - 4 = 94 tokens: the prompt begun takes its next
    # chunk first, cut to end on a multiple of 32 (10 + 94 = 104 -> 96) ...
    assert budget.chunks == {4: Chunk(10, 96)} and budget.left == 94 - 86
    # ... and what is left goes to a request admitted now.
    assert budget.take([short]) == {5: Chunk(0, 8)}
    assert budget.chunks == {4: Chunk(10, 96), 5: Chunk(0, 8)} and budget.left == 0
    assert long.prefilling and short.prefilling
    assert fcfs_step_budget(100, True, [long, short]).chunks == {4: Chunk(96, 192),
                                                                   5: Chunk(8, 12)}


def test_a_prompt_longer_than_the_budget_is_split_over_steps_in_order():
    long = admitted(seq(1, 1000))
    chunks = []
    while long.prefilling:
        chunks += fcfs_step_budget(256, True, [long]).chunks.values()
    assert chunks == [Chunk(0, 256), Chunk(256, 512), Chunk(512, 768), Chunk(768, 1000)]
    # A budget smaller than an aligned piece still moves the prompt along, and the next
    # piece gets back onto the 32-token grid.
    small = admitted(seq(2, 50))
    assert fcfs_step_budget(20, True, []).take([small]) == {2: Chunk(0, 20)}
    assert fcfs_step_budget(20, True, []).take([small]) == {2: Chunk(20, 32)}
    assert fcfs_step_budget(20, True, []).take([small]) == {2: Chunk(32, 50)}


def test_without_chunking_every_prompt_is_whole_and_the_budget_untouched():
    a, b = admitted(seq(1, 3000)), admitted(seq(2, 10))
    budget = fcfs_step_budget(256, False, [seq(3, 5, generated=1)])
    assert budget.take([a, b]) == {1: Chunk(0, 3000), 2: Chunk(0, 10)}
    assert budget.left == 256 and not budget.chunked


def test_chunked_admission_takes_requests_while_budget_is_left():
    q = WaitingQueue(10)
    for i, n in enumerate([300, 300, 300]):
        q.push(seq(i, n))
    # A 700-token budget: the first two whole, the third gets the last 100 as a chunk.
    budget = Budget(free_slots=10, free_kv_tokens=10**6, prefill_tokens=700, chunked=True)
    assert [s.seq_id for s in FCFSAdmission().admit(q, budget)] == [0, 1, 2]
    q.push(seq(3, 5))
    empty = Budget(free_slots=10, free_kv_tokens=10**6, prefill_tokens=0, chunked=True)
    assert FCFSAdmission().admit(q, empty) == []


def test_plan_expects_no_token_from_a_prompt_in_mid_prefill():
    planner = BatchPlanner(max_sparsity=0.1, max_splits=3)
    running = [admitted(seq(1, 40)), admitted(seq(2, 500))]
    chunks = fcfs_step_budget(128, True, []).take(running)
    plan = planner.plan([], running, [], chunks)
    assert plan.no_token == {2} and plan.token_ids() == [1]
    assert plan.prefill_tokens == 40 + 64 and plan.partial_chunks == 1
    # The prefilling row counts its whole prompt, so its chunks do not move it.
    assert [2] in plan.groups
    running[0].in_flight = 1
    again = planner.plan(running, [], [], fcfs_step_budget(128, True, running).chunks)
    assert not again.regrouped and again.groups == plan.groups and again.no_token == {2}
    message = encode_step(7, again)
    assert [(c.sequence_id, c.end) for c in message.chunks] == [(2, 64 + 127 - 127 % 32)]
    assert list(message.prefill) == []
    first = encode_step(6, plan)
    assert {n.sequence_id: n.prefill_end for n in first.prefill} == {1: 0, 2: 64}
    assert len(first.prefill[1].token_ids) == 500 and list(first.chunks) == []
