"""Regrouping: a Step's plan of groups made out of the engine's KV groups, moving as few
rows, and as few KV bytes, as possible (the group buffers are padded, so a row that changes
group is copied)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from worker_service.kv_groups import DetachedKV, KVGroup

if TYPE_CHECKING:
    from worker_service.engine import Engine


def regroup(engine: Engine, plan: list[list[int]], new_ids: set[int],
            restored: dict[int, DetachedKV] | None = None
            ) -> tuple[list[KVGroup], list[int], int]:
    """Make one KVGroup per planned group of the engine's, moving as few rows as possible;
    the rows of new sequences are empty, those of `restored` ones (swapped in) hold their
    KV. Returns the groups, their row counts before the new rows, and the bytes copied by
    groups that no plan keeps."""
    restored = restored or {}
    olds = [[sid for sid in members if sid not in new_ids] for members in plan]
    # Give each planned group the existing group it overlaps most, largest overlaps first.
    # Overlap in KV slots, not rows: a long row that stays put saves more copying than
    # several short ones (a row of 5,000 slots is 115 MB on SmolLM2).
    overlaps = []
    for i, members in enumerate(olds):
        held: Counter[int] = Counter()
        for sid in members:
            held[id(engine.group_of[sid])] += _slots(engine, sid) + 1
        overlaps += [(n, i, gid) for gid, n in held.items()]
    by_id = {id(g): g for g in engine.groups}
    target: dict[int, KVGroup] = {}
    taken: set[int] = set()
    for n, i, gid in sorted(overlaps, key=lambda x: (-x[0], x[1])):
        if i not in target and gid not in taken:
            target[i] = by_id[gid]
            taken.add(gid)
    groups = [target.get(i) or KVGroup(engine.runner.kv_shape, arena=engine.arena)
              for i in range(len(plan))]
    incoming = [[sid for sid in members if engine.group_of[sid] is not group]
                for members, group in zip(olds, groups)]
    leaving = Counter(id(engine.group_of[sid]) for rows_in in incoming for sid in rows_in)
    for members, rows_in, group in zip(plan, incoming, groups):
        fresh = [sid for sid in members if sid in new_ids]
        if rows_in or fresh:
            # One reallocation at most, with room for the incoming rows (copied before
            # this group's leaving rows go) and the new ones: row by row, or incoming
            # and new apart, a group could be copied several times in one step.
            during = group.rows + len(rows_in)
            after = during - leaving[id(group)] + len(fresh)
            group.ensure_capacity(max(during, after), max(
                [1 + _slots(engine, sid) for sid in rows_in]
                + [reserve_length(engine, sid) for sid in fresh]))
    moves = []
    for rows_in, group in zip(incoming, groups):
        for sid in rows_in:
            src = engine.group_of[sid]
            group.add_row_from(src, src.row_of(sid))
            moves.append((src, sid, group))
    remove_rows_together([(src, src.row_of(sid)) for src, sid, _ in moves])
    for _, sid, group in moves:
        engine.group_of[sid] = group
    dropped = 0
    for g in engine.groups:
        if not any(g is x for x in groups):
            assert g.rows == 0, "a group left without a plan still holds rows"
            dropped += g.copied_bytes  # its copies this step still count
    old_counts = [g.rows for g in groups]
    for members, group in zip(plan, groups):
        for sid in (sid for sid in members if sid in new_ids):
            if sid in restored:
                group.add_row_with(sid, restored[sid], reserve_length(engine, sid),
                                   non_blocking=engine.swap.pinned)
            else:
                group.add_empty_row(sid, reserve_length(engine, sid))
            engine.group_of[sid] = group
        if moves:
            group.trim()
    engine.groups = groups
    return groups, old_counts, dropped


def _slots(engine: Engine, seq_id: int) -> int:
    """KV slots a running sequence's row holds."""
    group = engine.group_of[seq_id]
    return group.length(group.row_of(seq_id))


def reserve_length(engine: Engine, seq_id: int) -> int:
    """Slots a new row needs this step: its tokens and contrastive candidates."""
    seq = engine.sequences[seq_id]
    return len(seq.token_ids) + max(seq.params.top_k, 1) + 1


def remove_rows_together(rows: Iterable[tuple[KVGroup, int]]) -> None:
    """Drop (group, row) pairs, each group's rows in one `KVGroup.remove_rows` (rows are
    numbered before any of them goes)."""
    by_group: dict[int, tuple[KVGroup, list[int]]] = {}
    for group, row in rows:
        by_group.setdefault(id(group), (group, []))[1].append(row)
    for group, dropped in by_group.values():
        group.remove_rows(dropped)
