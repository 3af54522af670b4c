"""What the worker keeps per sequence besides its KV rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from seqserve_common.decoding import DecodingStrategy


@dataclass(frozen=True)
class BeamParams:
    """Beam search parameters of one sequence, as Hugging Face generate takes them."""

    num_beams: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # False, True or "never"
    num_return_sequences: int = 1


@dataclass(frozen=True)
class DecodingParams:
    """Validated decoding parameters of one sequence (the scheduler checked the ranges)."""

    strategy: DecodingStrategy = DecodingStrategy.GREEDY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    penalty_alpha: float = 0.6
    logprobs: int = -1  # -1: none; 0..5: the chosen token's and that many alternatives
    beam: BeamParams | None = None  # set with DecodingStrategy.BEAM only

    @property
    def needs_processing(self) -> bool:
        """Whether logits need more than an argmax (penalties, warpers or sampling)."""
        return self.strategy != DecodingStrategy.GREEDY or self.repetition_penalty != 1.0


@dataclass
class SequenceState:
    """A running sequence on the worker.

    Greedy and sampled sequences keep their last token as `next_input`: it is fed to the
    next forward, which writes its KV. Contrastive sequences already hold the chosen
    token's KV (written while scoring candidates) and keep the distribution for the next
    token and the last-layer hidden states of every token, which the degeneration penalty
    needs.
    """

    seq_id: int
    token_ids: list[int]
    num_generated: int
    params: DecodingParams
    next_input: int | None = None
    next_logits: torch.Tensor | None = None
    context_hidden: torch.Tensor | None = None
    context_len: int = 0
    cached_tokens: int = 0
    pin_tokens: int = 0
    # Chunked prefill: the tokens to prefill (token_ids when created), and how many of them
    # the steps so far asked for. The row decodes once its KV holds all prompt_len.
    prompt_len: int = 0
    chunk_end: int = 0
    _ids_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def contrastive(self) -> bool:
        return self.params.strategy == DecodingStrategy.CONTRASTIVE

    @property
    def beam(self) -> bool:
        """One row of a beam search (beam.py): its logits go to the search, not a sampler."""
        return self.params.strategy == DecodingStrategy.BEAM

    def ids_tensor(self, device: torch.device) -> torch.Tensor:
        """All token ids as a tensor, extended incrementally (for repetition penalty)."""
        t = self._ids_tensor
        if t is None or t.numel() != len(self.token_ids):
            t = torch.tensor(self.token_ids, dtype=torch.long, device=device)
            self._ids_tensor = t
        return t

    def append_hidden(self, hidden: torch.Tensor) -> None:
        """Append last-layer hidden states [n, hidden] to the contrastive context."""
        n = hidden.shape[0]
        buf = self.context_hidden
        if buf is None or self.context_len + n > buf.shape[0]:
            cap = max(64, int((self.context_len + n) * 1.5))
            new = torch.empty(cap, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            if buf is not None:
                new[: self.context_len] = buf[: self.context_len]
            self.context_hidden = buf = new
        buf[self.context_len : self.context_len + n] = hidden
        self.context_len += n

    def context(self) -> torch.Tensor:
        assert self.context_hidden is not None
        return self.context_hidden[: self.context_len]

    def accept(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_generated += 1

