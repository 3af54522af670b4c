"""What goes into and comes out of one Step on the worker, free of gRPC.

The servicer turns the Step's messages into `PrefillSpec`s and a `StepResult` into the
answer; the engine and contrastive search share the records of one forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_service.packed_batch import RowSegment
from worker_service.sequence import DecodingParams, SequenceState


class StepError(ValueError):
    """The Step contradicts the worker's state (unknown id, duplicate, missing group)."""


@dataclass
class PrefillSpec:
    """A sequence the Step admits: its tokens so far (prompt, and any generated before a
    re-admission), which the step prefills, and how it decodes."""

    seq_id: int
    token_ids: list[int]
    num_generated: int
    params: DecodingParams
    pin_tokens: int = 0  # leading tokens from a cached_prompt: their blocks are pinned
    # Tokens of token_ids this step prefills (chunked prefill); 0: all. Later steps' chunks
    # (Engine.step's `chunks`) prefill the rest.
    prefill_end: int = 0


@dataclass
class GeneratedToken:
    """A token produced for a sequence in a step, with log-probabilities when asked for."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, log-probability), best first
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Beam search (beam.py): the search advanced a step and goes on (token_id means
    # nothing), or, on its last message, its best finished hypotheses as (generated token
    # ids, score), best first.
    beam_running: bool = False
    beams: list[tuple[list[int], float]] | None = None
    # The length probe's predicted output tokens (length_probe.py), on the first token.
    predicted_tokens: int | None = None


@dataclass
class StepResult:
    """A step's tokens, where its time went, and the engine's state after it."""

    tokens: list[GeneratedToken] = field(default_factory=list)
    forward_seconds: float = 0.0
    sampling_seconds: float = 0.0
    regroup_seconds: float = 0.0  # moving rows between groups, growing buffers
    prefix_cache_seconds: float = 0.0  # look-ups and copies of cached prefixes, inserts
    total_seconds: float = 0.0
    regroup_bytes: int = 0
    kv_slots: int = 0
    kv_tokens: int = 0
    # The engine's state after the step, taken on the compute thread: whoever reports it
    # may run while the next step already changes the engine.
    sequences: int = 0
    kv_allocated_bytes: int = 0
    prefix_cache_bytes: int = 0
    prefix_stats: tuple[int, int, int, int] | None = None  # queries, hits, hit tokens, evictions
    swapped_sequences: int = 0
    swap_bytes: int = 0
    prefetched_sequences: int = 0  # swapped-out sequences with a device copy of their KV
    prefetched_swap_ins: int = 0  # this Step's swap_ins whose KV was prefetched
    arena_stats: tuple[int, int] | None = None  # the KV arena's compactions, misses (so far)
    # An urgent Step (Engine.urgent_step) that ran between two layers of another Step.
    between_layers: bool = False


@dataclass
class Prefill:
    """A sequence whose tokens (after any cached prefix) a forward of this step prefills:
    its whole prompt, or one chunk of it."""

    seq: SequenceState
    segment: RowSegment
    final: bool = True  # the prompt's last chunk: the sequence gets its first token now
