"""Contrastive search (Su et al. 2022) inside the worker's packed forwards.

A contrastive sequence keeps the distribution of its next token (`next_logits`) and the
last-layer hidden states of all its tokens. Each step its top-k candidates go into the
step's forward as a tree segment: all at the row's next slot, each seeing the context
and itself, so one forward gives every candidate's hidden state and writes its KV. The
candidate with the best score (probability against the largest cosine similarity to the
context) is kept: its KV moves to the row's next slot and its hidden state and
output-layer logits become the sequence's context and next distribution.

A prompt prefilled in this step has no `next_logits` before the forward; its candidates
go through a second, small forward of the same step (`first_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker_service import sampling
from worker_service.kv_groups import KVGroup
from worker_service.model_runner import ModelRunner
from worker_service.packed_batch import PackedBatch, RowSegment
from worker_service.sequence import SequenceState
from worker_service.step import GeneratedToken, Prefill, StepResult


@dataclass
class CandidateTree:
    """One sequence's top-k candidates, scored in a forward as one tree segment."""

    seq: SequenceState
    token_ids: list[int]  # the candidates, most probable first
    probs: torch.Tensor  # [k] their probabilities under the processed next-token logits
    segment: RowSegment  # the row the candidates extend, and where their hidden states land


def candidates(seq: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidate ids and their probabilities from the sequence's next-token logits."""
    assert seq.next_logits is not None
    probs = torch.softmax(sampling.processed_logits(seq.next_logits.float(), seq), -1)
    k = min(max(seq.params.top_k, 1), probs.shape[-1])
    top_probs, top_ids = torch.topk(probs, k)
    return top_ids, top_probs


def best_candidate(top_probs: torch.Tensor, cand_hidden: torch.Tensor, context: torch.Tensor,
                   alpha: float) -> int:
    """Su et al. 2022: argmax of (1 - alpha) p - alpha * max cosine(candidate, context)."""
    cand = cand_hidden.float()
    ctx = context.float()
    cand = cand / cand.norm(dim=-1, keepdim=True)
    ctx = ctx / ctx.norm(dim=-1, keepdim=True)
    penalty = (cand @ ctx.T).max(dim=-1).values  # [k]
    score = (1.0 - alpha) * top_probs.float() - alpha * penalty
    return int(score.argmax())


def segment_hidden(hidden: torch.Tensor, seg: RowSegment) -> torch.Tensor:
    """The hidden states [num_tokens, hidden] of one segment's tokens."""
    return hidden[seg.token_start : seg.token_start + seg.num_tokens]


class ContrastiveSearch:
    """Adds candidate trees to a step's forwards and keeps one token of each."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def add_candidates(self, batch: PackedBatch, group: KVGroup, row: int, seq: SequenceState,
                       result: StepResult) -> CandidateTree:
        """The sequence's top-k candidates as a tree segment after its row's KV."""
        t = time.perf_counter()
        ids, probs = candidates(seq)
        token_ids = ids.tolist()
        result.sampling_seconds += time.perf_counter() - t
        seg = batch.add_row(group, row, token_ids, group.length(row), tree=True)
        return CandidateTree(seq, token_ids, probs, seg)

    def choose(self, tree: CandidateTree, hidden: torch.Tensor, result: StepResult) -> None:
        """Keep the best candidate of `tree`, given the forward's hidden states."""
        t = time.perf_counter()
        seq, seg = tree.seq, tree.segment
        cand_hidden = segment_hidden(hidden, seg)
        best = best_candidate(tree.probs, cand_hidden, seq.context(), seq.params.penalty_alpha)
        seg.group.keep_candidate(seg.row, seg.group.length(seg.row) + best)
        token = tree.token_ids[best]
        out = GeneratedToken(seq.seq_id, token)
        if seq.params.logprobs >= 0:
            out.logprob, out.top = sampling.logprob_info(seq.next_logits, token,
                                                         seq.params.logprobs)
        seq.append_hidden(cand_hidden[best : best + 1])
        result.sampling_seconds += time.perf_counter() - t
        t = time.perf_counter()
        seq.next_logits = self.runner.logits(cand_hidden[best])
        result.forward_seconds += time.perf_counter() - t
        seq.accept(token)
        result.tokens.append(out)

    def first_tokens(self, chunks: list[Prefill], hidden: torch.Tensor,
                     result: StepResult) -> None:
        """Contrastive prompts (or chunks of them) that the forward just prefilled
        (`hidden` its output): each keeps its tokens' hidden states as context; a prompt
        whose last chunk this was gets its first token, whose next-token logits come from
        that forward and whose candidates need one more."""
        if not chunks:
            return
        t = time.perf_counter()
        prompts = []
        for p in chunks:
            prompt_hidden = segment_hidden(hidden, p.segment)
            p.seq.append_hidden(prompt_hidden)
            if p.final:
                p.seq.next_logits = self.runner.logits(prompt_hidden[-1])
                prompts.append(p)
        result.forward_seconds += time.perf_counter() - t
        if not prompts:
            return
        batch = PackedBatch(self.runner.device, self.runner.layer_attention)
        trees = [self.add_candidates(batch, p.segment.group, p.segment.row, p.seq, result)
                 for p in prompts]
        t = time.perf_counter()
        hidden = self.runner.forward(batch)
        result.forward_seconds += time.perf_counter() - t
        for tree in trees:
            self.choose(tree, hidden, result)
