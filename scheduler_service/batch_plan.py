"""The per-iteration batch plan: who is released, who is prefilled, and the groups to run."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.partition import Partition, plan_partition
from scheduler_service.sequence import Sequence


@dataclass
class StepPlan:
    """What one Step asks of the worker."""

    release: list[int]
    prefill: list[Sequence]
    groups: list[list[int]]  # sequence ids per group
    partition: Partition
    regrouped: bool  # the partition was recomputed (membership changed)


class BatchPlanner:
    """Partitions the running batch by max-sparsity thresholding.

    Every running sequence grows by one token per step, so the optimal partition only
    changes when sequences join or leave: the previous one is reused until then.
    """

    def __init__(self, max_sparsity: float, max_splits: int):
        self.max_sparsity = max_sparsity
        self.max_splits = max_splits
        self._members: frozenset[int] = frozenset()
        self._groups: list[list[int]] = []
        self._partition = Partition(groups=(), padding=0, sparsity=0.0)

    def plan(self, running: list[Sequence], admitted: list[Sequence],
             release: list[int]) -> StepPlan:
        batch = running + admitted
        members = frozenset(s.seq_id for s in batch)
        # A beam search is one row per beam on the worker, all of its length: the
        # partition sees each row, and keeps them together (equal lengths are never split).
        rows = [s for s in batch for _ in range(s.rows)]
        lengths = [s.length for s in rows]
        if members == self._members and not admitted:
            # Same members, all one token longer: padding and optimality are unchanged.
            part = self._partition
            shifted = Partition(groups=part.groups, padding=part.padding,
                                sparsity=_sparsity(part.padding, sum(lengths)))
            return StepPlan(release, [], self._groups, shifted, False)
        part = plan_partition(lengths, self.max_sparsity, self.max_splits)
        groups = [list(dict.fromkeys(rows[i].seq_id for i in g)) for g in part.groups]
        self._members, self._groups, self._partition = members, groups, part
        return StepPlan(release, admitted, groups, part, True)

    def forget(self) -> None:
        """Drop the cached plan (after a worker restart every sequence is new again)."""
        self._members = frozenset()


def _sparsity(padding: int, real: int) -> float:
    total = padding + real
    return padding / total if total else 0.0
