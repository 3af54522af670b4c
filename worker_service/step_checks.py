"""Whether a Step fits the worker's state: each check raises StepError saying what is
wrong and what the scheduler must do instead; nothing changes the engine."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from worker_service.sequence import SequenceState
from worker_service.step import PrefillSpec, StepError


def new_sequences(prefill: list[PrefillSpec], live: Mapping[int, SequenceState],
                  swapped: Collection[int]) -> set[int]:
    """The ids the Step creates, each new to the worker (`live` holds those swapped in by
    this Step already) and with tokens to prefill."""
    new_ids: set[int] = set()
    for ns in prefill:
        if ns.seq_id in live or ns.seq_id in new_ids:
            raise StepError(f"sequence {ns.seq_id} already exists; release it first")
        if ns.seq_id in swapped:
            raise StepError(f"sequence {ns.seq_id} is swapped out; swap it in or release "
                            "it before prefilling it again")
        if not ns.token_ids:
            raise StepError(f"sequence {ns.seq_id} has no tokens to prefill")
        if not 0 <= ns.prefill_end <= len(ns.token_ids):
            raise StepError(f"sequence {ns.seq_id}: prefill_end {ns.prefill_end} is not "
                            f"in [0, {len(ns.token_ids)}] (its token count)")
        new_ids.add(ns.seq_id)
    return new_ids


def check_plan(plan: list[list[int]], live: Mapping[int, SequenceState],
               new_ids: set[int]) -> None:
    """Every live or new sequence in exactly one group, and no other."""
    seen: set[int] = set()
    for members in plan:
        for sid in members:
            if sid in seen:
                raise StepError(f"sequence {sid} appears in more than one group")
            if sid not in live and sid not in new_ids:
                raise StepError(f"sequence {sid} is unknown to this worker (not running, "
                                "not in prefill); the scheduler must re-admit it")
            seen.add(sid)
    missing = (set(live) | new_ids) - seen
    if missing:
        raise StepError(f"sequences {sorted(missing)[:8]} are in no group; every live "
                        "sequence must be in exactly one group")


def check_chunks(chunks: dict[int, int], live: Mapping[int, SequenceState]) -> None:
    """Each chunk continues a live sequence's prompt past what earlier Steps asked for."""
    for sid, end in chunks.items():
        seq = live.get(sid)
        if seq is None:
            raise StepError(f"prefill chunk for sequence {sid}, which this worker does not "
                            "hold; a new sequence's first chunk is its prefill_end")
        if not seq.chunk_end < end <= seq.prompt_len:
            raise StepError(f"prefill chunk for sequence {sid} ends at {end}; it must be "
                            f"past the {seq.chunk_end} tokens asked for before and at most "
                            f"its {seq.prompt_len} prompt tokens")


def check_urgent(prefill: list[PrefillSpec]) -> None:
    """An urgent Step prefills greedy or sampled sequences only
    (DecodingStrategy.interruptible)."""
    for ns in prefill:
        if not ns.params.strategy.interruptible:
            raise StepError(f"sequence {ns.seq_id}: an urgent Step takes only greedy or "
                            "sampled sequences; send contrastive and beam ones in a "
                            "regular Step")
