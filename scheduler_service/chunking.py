"""Chunked prefill (Dynamic SplitFuse, as vLLM and DeepSpeed-FastGen do it): the token
budget of one step.

Every step computes at most `max_num_batched_tokens` tokens. The decoding rows go first
(one token each, a contrastive row its top-k candidates), since delaying them is what
makes inter-token latency spike when a long prompt arrives; prompt chunks fill what is
left, oldest prompt first, so a long prompt is prefilled over several steps and short ones
are packed together to fill the budget. A sequence gets its first token with its last
chunk. Free of gRPC and of the loop's state, so it is unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from scheduler_service.sequence import Sequence
from seqserve_common.decoding import DecodingStrategy

# A chunk that leaves part of its prompt for later ends on a multiple of this: the matrix
# products run on whole tiles, and a chunk then ends on a prefix-cache block boundary
# (16-token blocks by default). Only the budget's last < 32 tokens may go unused.
CHUNK_ALIGN = 32


def decode_tokens(seq: Sequence) -> int:
    """Tokens a decoding sequence puts into the step's forward: one per row (a beam search
    has one per beam), a contrastive one its top-k candidates."""
    p = seq.params
    return max(p.top_k, 1) if p.strategy == DecodingStrategy.CONTRASTIVE else seq.rows


def chunk_end(start: int, target: int, left: int, chunked: bool) -> int:
    """Where the next chunk of a prompt prefilled up to `start` of `target` tokens ends,
    given `left` tokens of the step's budget (> 0): the rest of the prompt if it fits (or
    without chunking), else what the budget allows, cut down to end on a multiple of
    CHUNK_ALIGN when that still leaves the chunk a token."""
    end = start + (min(target - start, left) if chunked else target - start)
    if end < target and end - end % CHUNK_ALIGN > start:
        end -= end % CHUNK_ALIGN
    return end


class Chunk(NamedTuple):
    """Tokens [start, end) of a sequence's prompt, prefilled in one step."""

    start: int
    end: int


class ChunkLimit(NamedTuple):
    """A cap on some prompts' chunks in one Step (policies/urgent_shield.py): those of
    `seq_ids` take at most `tokens` prompt tokens together (0: none, save a new prompt's
    first token, since the worker prefills a new sequence whole unless a chunk says
    otherwise)."""

    seq_ids: frozenset[int]
    tokens: int


class StepBudget:
    """What is left of one step's prompt-token budget as the loop hands it out, and the
    chunks handed out so far (sequence id -> Chunk)."""

    def __init__(self, left: int, chunked: bool):
        self.left = left
        self.chunked = chunked  # else every prompt is prefilled whole
        self.chunks: dict[int, Chunk] = {}

    @classmethod
    def for_decoding(cls, max_num_batched_tokens: int, chunked: bool,
                     running: Iterable[Sequence]) -> StepBudget:
        """The step's budget for prompts once the decoding rows had theirs: with chunking,
        what they leave of max_num_batched_tokens (may be <= 0). The prompts begun and the
        new ones then `take` their chunks, in the order the admission policy gives
        (`AdmissionPolicy.prefill_order`)."""
        if not chunked:
            return cls(max_num_batched_tokens, False)
        return cls(max_num_batched_tokens - sum(decode_tokens(s) for s in running
                                                if not s.prefilling), True)

    def take(self, seqs: Iterable[Sequence], limit: ChunkLimit | None = None
             ) -> dict[int, Chunk]:
        """The chunk of each sequence of `seqs` that gets one, in their order, paid from
        the budget and recorded on the sequence (`prefilled`); those of `limit.seq_ids`
        also from its tokens (with chunking only). A chunk that does not finish its prompt
        is cut down to end on a multiple of CHUNK_ALIGN when that still leaves it a token.
        Without chunking every prompt is whole and the budget untouched (the admission
        policy spends it)."""
        chunks: dict[int, Chunk] = {}
        capped = self.chunked and limit is not None
        limit_left = limit.tokens if capped else 0
        for s in seqs:
            start, need = s.prefilled, s.prefill_target - s.prefilled
            if need <= 0:
                continue
            if self.chunked and self.left <= 0:
                break
            left, limited = self.left, capped and s.seq_id in limit.seq_ids
            if limited:
                left = min(left, max(limit_left, 1 if start == 0 else 0))
                if left <= 0:
                    continue
            end = chunk_end(start, s.prefill_target, left, self.chunked)
            if limited:
                limit_left -= end - start
            chunks[s.seq_id] = Chunk(start, end)
            s.prefilled = end
            if self.chunked:
                self.left -= end - start
        self.chunks.update(chunks)
        return chunks
