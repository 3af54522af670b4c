"""The per-iteration batch plan: who is released, who is prefilled (how far), and the
groups to run."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.chunking import Chunk
from scheduler_service.partition import Partition, plan_partition
from scheduler_service.sequence import Sequence


@dataclass
class StepPlan:
    """What one Step asks of the worker."""

    release: list[int]
    prefill: list[Sequence]  # new on the worker this step
    groups: list[list[int]]  # sequence ids per group
    partition: Partition
    regrouped: bool  # the partition was recomputed (membership changed)
    # The prompt tokens each sequence prefilling in this step prefills (new ones too).
    chunks: dict[int, Chunk] = field(default_factory=dict)
    # Sequences in the groups that get no token from this step: their prompt is not
    # wholly prefilled after it.
    no_token: frozenset[int] = frozenset()
    partial_chunks: int = 0  # chunks that leave part of their prompt for later steps
    # (id, tokens generated, exact) of sequences that ended since the last Step: the
    # labels of the worker's length probe (exact: by EOS or stop; else a lower bound).
    finished: list[tuple[int, int, bool]] = field(default_factory=list)
    # Preempted sequences whose KV the worker moves to host memory, and those among
    # `prefill` whose KV comes back from there instead of a prefill (preemption.py).
    swap_out: list[int] = field(default_factory=list)
    swap_in: list[int] = field(default_factory=list)
    # Swapped-out sequences whose KV the worker copies back to the device ahead of their
    # swap_in, and those whose device copy it frees again (Swapper.plan_prefetch).
    prefetch: list[int] = field(default_factory=list)
    unprefetch: list[int] = field(default_factory=list)
    # An urgent Step (BatchPlanner.urgent): new sequences' prefills alone, run by the
    # worker ahead of the Steps in flight; nothing else is in it.
    urgent: bool = False

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens this step prefills (before any prefix-cache hit)."""
        return sum(c.end - c.start for c in self.chunks.values())

    def token_ids(self) -> list[int]:
        """The sequences this step gives a token."""
        return [sid for g in self.groups for sid in g if sid not in self.no_token]


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

    def plan(self, running: list[Sequence], admitted: list[Sequence], release: list[int],
             chunks: dict[int, Chunk] | None = None) -> StepPlan:
        """`running`: the sequences the worker holds that stay (decoding or prefilling);
        `chunks`: the step's prompt chunks (chunking.StepBudget, which recorded them on the
        sequences); those of sequences not in the batch (preempted) are left out."""
        batch = running + admitted
        members = frozenset(s.seq_id for s in batch)
        if members == self._members and not admitted:
            # Same members, all one token longer (or, prefilling, counted whole already):
            # padding and optimality are unchanged.
            part = self._partition
            real = sum(s.length * s.rows for s in batch)
            shifted = Partition(groups=part.groups, padding=part.padding,
                                sparsity=_sparsity(part.padding, real))
            return _step_plan(batch, [], release, chunks, self._groups, shifted, False)
        groups, part = self._partitioned(batch)
        self._members, self._groups, self._partition = members, groups, part
        return _step_plan(batch, admitted, release, chunks, groups, part, True)

    def urgent(self, admitted: list[Sequence], chunks: dict[int, Chunk]) -> StepPlan:
        """The plan of an urgent Step: `admitted` alone, partitioned among themselves.
        The running batch's cached partition is kept: the next plan, which `admitted`
        join, recomputes it."""
        groups, part = self._partitioned(admitted)
        plan = _step_plan(admitted, admitted, [], chunks, groups, part, True)
        plan.urgent = True
        return plan

    def _partitioned(self, batch: list[Sequence]) -> tuple[list[list[int]], Partition]:
        """`batch`'s groups (sequence ids) by max-sparsity thresholding, and the partition.
        A beam search is one row per beam on the worker, all of its length: the partition
        sees each row, and keeps them together (equal lengths are never split)."""
        rows = [s for s in batch for _ in range(s.rows)]
        part = plan_partition([s.length for s in rows], self.max_sparsity, self.max_splits)
        return [list(dict.fromkeys(rows[i].seq_id for i in g)) for g in part.groups], part

    def forget(self) -> None:
        """Drop the cached plan (after a worker restart every sequence is new again)."""
        self._members = frozenset()


def _step_plan(batch: list[Sequence], admitted: list[Sequence], release: list[int],
               chunks: dict[int, Chunk] | None, groups: list[list[int]], part: Partition,
               regrouped: bool) -> StepPlan:
    """The StepPlan of `batch` in `groups`; chunks of sequences not in it (preempted) are
    left out."""
    chunks = {s.seq_id: chunks[s.seq_id] for s in batch if s.seq_id in (chunks or {})}
    no_token = frozenset(s.seq_id for s in batch if s.prefilling)
    partial = sum(1 for sid in chunks if sid in no_token)
    return StepPlan(release, admitted, groups, part, regrouped, chunks, no_token, partial)


def _sparsity(padding: int, real: int) -> float:
    total = padding + real
    return padding / total if total else 0.0
