"""Pure planning logic of the scheduling policies (scheduler_service/policies): the order
of admission, who is preempted, aging, MLFQ levels, and the checks of bad values. No gRPC,
no model."""

from __future__ import annotations

import pytest

from scheduler_service.admission import Budget, WaitingQueue
from scheduler_service.params import DecodingConfig, RequestError
from scheduler_service.policies import make_policy, policy_factory
from scheduler_service.policies.length_aware import LengthAwareAdmission
from scheduler_service.policies.mlfq import (
    MLFQAdmission,
    MLFQConfig,
    demand_level,
    join_level,
)
from scheduler_service.policies.priority import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    PriorityAdmission,
    check_priority,
)
from scheduler_service.preemption import preempt
from scheduler_service.sequence import Sequence, Status
from seqserve_common.config import ConfigError, ServingConfig, load_config
from seqserve_common.decoding import DecodingStrategy


def seq(sid: int, prompt_len: int = 10, max_new: int = 10, priority: int = 0,
        generated: int = 0) -> Sequence:
    s = Sequence(seq_id=sid, request_id=str(sid), prompt_ids=[1] * prompt_len,
                 params=DecodingConfig(max_new_tokens=max_new, strategy=DecodingStrategy.GREEDY),
                 detokenizer=None, stops=None, priority=priority, arrival_time=float(sid))
    s.output_ids = [2] * generated
    return s


def running(*seqs: Sequence) -> list[Sequence]:
    for s in seqs:
        s.status = Status.RUNNING
    return list(seqs)


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


# --- priority ----------------------------------------------------------------------------

def test_priority_spends_a_chunked_prefill_budget_as_fcfs_does():
    # Chunking on: requests join in rank order while any of the step's prompt budget is
    # left (the last one's first chunk takes the rest), and none joins once it is spent.
    q = WaitingQueue(10)
    for sid, prio in [(1, 0), (2, -1), (3, -2)]:
        q.push(seq(sid, prompt_len=300, priority=prio))
    budget = Budget(free_slots=10, free_kv_tokens=10**6, prefill_tokens=700, chunked=True)
    assert ids(PriorityAdmission(aging_steps=100).admit(q, budget)) == [3, 2, 1]
    q.push(seq(4, prompt_len=5))
    spent = Budget(free_slots=10, free_kv_tokens=10**6, prefill_tokens=0, chunked=True)
    assert PriorityAdmission(aging_steps=100).admit(q, spent) == []


def test_priority_admits_most_urgent_first_then_arrival_order():
    q = WaitingQueue(10)
    for sid, prio in [(1, 5), (2, 0), (3, -3), (4, 0)]:
        q.push(seq(sid, priority=prio))
    admitted = PriorityAdmission(aging_steps=100).admit(q, Budget(3, 1000))
    assert ids(admitted) == [3, 2, 4]
    assert ids(q) == [1]


def test_priority_stops_at_the_first_that_does_not_fit():
    """Like FCFS at its head: a large urgent request is not passed by smaller ones."""
    q = WaitingQueue(10)
    q.push(seq(1, prompt_len=10, priority=1))
    q.push(seq(2, prompt_len=500, priority=0))
    assert PriorityAdmission(100).admit(q, Budget(4, 100)) == []
    assert ids(q) == [1, 2]


def test_preempts_least_urgent_latest_running_just_enough():
    q = WaitingQueue(10)
    q.push(seq(9, priority=-1))
    run = running(seq(1, priority=0), seq(2, priority=3), seq(3, priority=3), seq(4, priority=-5))
    policy = PriorityAdmission(100)
    # No slot free: one victim, the least urgent, latest arrived of equal priority.
    assert ids(policy.preempt(q, run, Budget(0, 1000))) == [3]
    # Room enough: nobody is preempted.
    assert policy.preempt(q, run, Budget(1, 1000)) == []
    # The head needs 20 KV tokens and 5 are free: one victim's 20 make room.
    assert ids(policy.preempt(q, run, Budget(1, 5))) == [3]
    # Needs more than all less urgent sequences hold: preempt nobody.
    assert policy.preempt(q, run, Budget(0, -100)) == []


def test_never_preempts_equal_or_more_urgent():
    q = WaitingQueue(10)
    q.push(seq(9, priority=0))
    run = running(seq(1, priority=0), seq(2, priority=-2))
    assert PriorityAdmission(100).preempt(q, run, Budget(0, 1000)) == []


def test_preempt_takes_victims_out_and_returns_their_room():
    q = WaitingQueue(10)
    q.push(seq(9, priority=-1))
    a, b = running(seq(1, priority=0), seq(2, priority=0, generated=3))
    b.in_flight = 2
    table = {1: a, 2: b}
    victims, budget = preempt(PriorityAdmission(100), q, table, Budget(0, 0, 64))
    assert victims == [b] and list(table) == [1]
    assert b.status is Status.WAITING and b.in_flight == 0 and b.preemptions == 1
    assert budget == Budget(1, b.reserved_tokens, 64)


def test_aging_bounds_the_wait_of_a_low_priority_request():
    """A priority-10 request ties with fresh priority-0 arrivals after 10 * aging_steps
    Steps waited, and wins the tie by arrival; it preempts running priority-0 work once
    strictly more urgent, after 11 * aging_steps."""
    aging = 4
    policy = PriorityAdmission(aging)
    q = WaitingQueue(100)
    low = seq(1, priority=10)
    q.push(low)
    waited_when_admitted = None
    for step in range(200):
        q.push(seq(1000 + step, priority=0))  # a fresh urgent arrival every Step
        if low in policy.admit(q, Budget(1, 1000)):
            waited_when_admitted = step
            break
        q.tick()
    assert waited_when_admitted == 10 * aging
    q2 = WaitingQueue(10)
    q2.push(seq(2, priority=10))
    for _ in range(11 * aging - 1):
        q2.tick()
    assert policy.preempt(q2, running(seq(3, priority=0)), Budget(0, 100)) == []
    q2.tick()
    assert ids(policy.preempt(q2, running(seq(3, priority=0)), Budget(0, 100))) == [3]


def test_aging_counts_all_waits_and_holds_while_running():
    q = WaitingQueue(10)
    s = seq(1)
    q.push(s)
    for _ in range(5):
        q.tick()
    assert q.waited(s) == 5
    assert q.pop() is s
    s.status = Status.RUNNING
    for _ in range(7):
        q.tick()
    assert q.waited(s) == 5  # running: its credit stays, it does not grow
    s.status = Status.WAITING
    q.push_front([s])
    for _ in range(2):
        q.tick()
    assert q.waited(s) == 7


@pytest.mark.parametrize("value", [PRIORITY_MIN - 1, PRIORITY_MAX + 1, "1", 1.5, True, None])
def test_bad_priority_is_refused_with_the_range(value):
    with pytest.raises(RequestError, match=r"priority must be .*\[-100, 100\]"):
        check_priority(value)


def test_good_priority_passes():
    assert check_priority(PRIORITY_MIN) == PRIORITY_MIN
    assert check_priority(3.0) == 3


# --- MLFQ --------------------------------------------------------------------------------

CFG = MLFQConfig(levels=4, base_quantum=2, prefill_tokens_per_step=10, aging_steps=50)


def test_skip_join_places_a_job_by_its_prefill_cost():
    # Quanta 2, 4, 8, 16 Steps; prefill cost ceil(prompt / 10) Steps.
    assert [join_level(n, CFG) for n in (1, 20, 21, 40, 41, 80, 81, 10_000)] == [
        0, 0, 1, 1, 2, 2, 3, 3]


def test_demotion_after_each_quantum():
    # Joins queue 0: quantum 2, then 4 more in queue 1, 8 in queue 2, then the last queue.
    levels = [demand_level(5, served, CFG) for served in range(20)]
    assert levels == [0, 0] + [1] * 4 + [2] * 8 + [3] * 6
    # Joined queue 1 (cost 3): 4 Steps there, then 8 in queue 2.
    assert [demand_level(25, s, CFG) for s in (0, 3, 4, 11, 12)] == [1, 1, 2, 2, 3]


def test_mlfq_new_short_job_preempts_a_demoted_long_one():
    policy = MLFQAdmission(CFG)
    q = WaitingQueue(10)
    long_job = running(seq(1, prompt_len=5, max_new=100, generated=10))[0]  # queue 2
    young = running(seq(2, prompt_len=5, max_new=100, generated=1))[0]  # queue 0
    q.push(seq(3, prompt_len=5))  # queue 0
    assert ids(policy.preempt(q, [long_job, young], Budget(0, 10_000))) == [1]
    # The long job waits in queue 2; a new job in queue 0 is admitted before it.
    q.push_front([long_job])
    long_job.status = Status.WAITING
    assert ids(policy.admit(q, Budget(1, 10_000))) == [3]


def test_mlfq_waiting_job_is_promoted_by_aging():
    policy = MLFQAdmission(CFG)
    q = WaitingQueue(10)
    old = seq(1, prompt_len=5, generated=14)  # queue 3
    q.push(old)
    for _ in range(3 * CFG.aging_steps):
        q.tick()
    q.push(seq(2, prompt_len=5))  # queue 0, arrived later
    assert ids(policy.admit(q, Budget(1, 10_000))) == [1]


# --- configuration -----------------------------------------------------------------------

def test_make_policy_by_name():
    assert type(make_policy(ServingConfig())).__name__ == "FCFSAdmission"
    assert isinstance(make_policy(ServingConfig(scheduling_policy="priority")),
                      PriorityAdmission)
    m = make_policy(ServingConfig(scheduling_policy="mlfq", mlfq_levels=3))
    assert isinstance(m, MLFQAdmission) and m.cfg.levels == 3
    factory = policy_factory(ServingConfig(scheduling_policy="length-aware",
                                           length_bucket_tokens=20))
    a, b = factory(), factory()
    assert isinstance(a, LengthAwareAdmission) and a is not b
    assert a.predictor is b.predictor and a.predictor.cfg.bucket_tokens == 20


def test_unknown_policy_stops_start_up(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.model_id=x\noption.scheduling_policy=sjf\n")
    with pytest.raises(ConfigError,
                       match=r"option.scheduling_policy.*fcfs, priority, mlfq, length-aware, length-batched"):
        load_config(props, env={})
