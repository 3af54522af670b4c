"""Policy `mlfq`: FastServe's skip-join multi-level feedback queue.

Queue i (0 is the most urgent) has a quantum of `base_quantum * 2**i` decoding Steps.
A new job skips the queues whose quantum is shorter than its prefill (FastServe's
skip-join): it joins the first queue whose quantum covers its prompt's prefill cost,
counted in decoding Steps as ceil(prompt tokens / prefill_tokens_per_step). After it has
run its quantum in a queue it is demoted to the next one. Jobs run in queue order, first
come first served within a queue; a waiting job of a higher queue preempts at token
granularity (between two Steps) the running job of the lowest queue when there is no room
(ranked.py), and the preempted job is recomputed later (its KV dropped on CPU).

The level is a pure function of the job's prompt length, the tokens it has produced and
the Steps it has waited, so nothing is stored per job. Starvation: a waiting job is
promoted one queue per `aging_steps` Steps waited (FastServe promotes jobs that wait too
long); a promotion is kept once earned.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.admission import WaitingQueue
from scheduler_service.policies.ranked import RankedAdmission
from scheduler_service.sequence import Sequence


@dataclass(frozen=True)
class MLFQConfig:
    levels: int = 4
    base_quantum: int = 8  # decoding Steps a job runs in queue 0 before demotion
    prefill_tokens_per_step: int = 128  # prompt tokens whose prefill costs one Step
    aging_steps: int = 64

    def __post_init__(self) -> None:
        for name in ("levels", "base_quantum", "prefill_tokens_per_step", "aging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"mlfq {name} must be >= 1, got {getattr(self, name)}")

    def quantum(self, level: int) -> int:
        return self.base_quantum << level


def join_level(prompt_tokens: int, cfg: MLFQConfig) -> int:
    """Skip-join: the first queue whose quantum covers the prompt's prefill cost."""
    cost = -(-prompt_tokens // cfg.prefill_tokens_per_step)
    level = 0
    while level < cfg.levels - 1 and cfg.quantum(level) < cost:
        level += 1
    return level


def demand_level(prompt_tokens: int, served: int, cfg: MLFQConfig) -> int:
    """The queue a job is in after `served` decoding Steps, before promotions: it joins at
    join_level and moves down one queue each time it uses up the quantum of its queue."""
    level = join_level(prompt_tokens, cfg)
    used = cfg.quantum(level)
    while served >= used and level < cfg.levels - 1:
        level += 1
        used += cfg.quantum(level)
    return level


def mlfq_level(seq: Sequence, waiting: WaitingQueue, cfg: MLFQConfig) -> int:
    served = seq.generated + seq.in_flight
    level = demand_level(len(seq.prompt_ids), served, cfg)
    return max(0, level - waiting.waited(seq) // cfg.aging_steps)


class MLFQAdmission(RankedAdmission):
    def __init__(self, cfg: MLFQConfig):
        self.cfg = cfg
        super().__init__(lambda s, w: mlfq_level(s, w, cfg))
