"""Token selection per sequence inside a batched step: greedy and sampling, and the
logits processing and log-probabilities that contrastive search (contrastive.py) shares.

Every function takes the logits of the rows that ran and the rows' own parameters, so
greedy, sampled and contrastive sequences share one forward and never see each other's
values. Sampling draws token i of a sequence from a generator seeded by (seed, i): the
result does not depend on the batch, the group or when the request arrived.
"""

from __future__ import annotations

import torch

from seqserve_common.decoding import DecodingStrategy
from worker_service.kernels import greedy
from worker_service.sequence import DecodingParams, SequenceState
from worker_service.step import GeneratedToken

_MASK = float("-inf")
# Below this, temperature only sharpens further toward the argmax; dividing float32
# logits by 1e-300 would instead give inf - inf = NaN probabilities.
MIN_TEMPERATURE = 1e-6


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Hugging Face's rule: divide positive logits of seen tokens, multiply negative ones."""
    if penalty == 1.0:
        return logits
    scores = logits.gather(-1, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(-1, seen, scores)


def warp(logits: torch.Tensor, p: DecodingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p, in Hugging Face's order, on one row [V]."""
    if p.temperature != 1.0:
        logits = logits / max(p.temperature, MIN_TEMPERATURE)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, _MASK)
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - p.top_p)
        drop[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(0, order, drop), _MASK)
    if p.typical_p < 1.0:
        logp = torch.log_softmax(logits, -1)
        probs = logp.exp()
        entropy = -(torch.nan_to_num(logp) * probs).sum()
        shifted = (-logp - entropy).abs()
        sorted_shift, order = torch.sort(shifted)
        cum = probs.gather(-1, order).cumsum(-1)
        last = int((cum < p.typical_p).sum().clamp(max=logits.shape[-1] - 1))
        drop = sorted_shift > sorted_shift[last]
        logits = logits.masked_fill(drop.scatter(0, order, drop), _MASK)
    return logits


def token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """A generator for token `index` of a sequence seeded with `seed`."""
    g = torch.Generator(device=device)
    # Mix like splitmix64 so nearby (seed, index) pairs give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    g.manual_seed((x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF)
    return g


def logprob_info(raw_logits: torch.Tensor, token_id: int, n_top: int) -> tuple[float, list]:
    """Log-probability of `token_id` and the `n_top` best alternatives under the raw logits."""
    logp = torch.log_softmax(raw_logits.float(), -1)
    top = []
    if n_top > 0:
        vals, ids = torch.topk(logp, n_top)
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(logp[token_id]), top


def processed_logits(logits: torch.Tensor, seq: SequenceState) -> torch.Tensor:
    """The row's logits after its repetition penalty (used by every strategy)."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seq.ids_tensor(logits.device), p.repetition_penalty)
    return logits


def choose_tokens(logits: torch.Tensor, seqs: list[SequenceState]) -> list[GeneratedToken]:
    """Pick the next token of greedy and sampled sequences from their logits [m, V]."""
    choices: list[GeneratedToken | None] = [None] * len(seqs)
    simple = [i for i, s in enumerate(seqs) if not s.params.needs_processing]
    if simple:
        # Most Steps are all greedy: then no gather of their rows.
        rows = logits if len(simple) == len(seqs) else logits[simple]
        ids = greedy.argmax_rows(rows)
        for i, t in zip(simple, ids):
            choices[i] = GeneratedToken(seqs[i].seq_id, t)
    for i, s in enumerate(seqs):
        if choices[i] is not None:
            continue
        row = processed_logits(logits[i].float(), s)
        if s.params.strategy == DecodingStrategy.SAMPLE:
            probs = torch.softmax(warp(row, s.params), -1)
            if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
                g = token_generator(s.params.seed, s.num_generated, row.device)
                t = int(torch.multinomial(probs, 1, generator=g))
            else:
                # Degenerate warping (e.g. every logit -inf after penalties): the limit
                # of sampling is the argmax, and one sequence must not fail the Step.
                t = int(row.argmax())
        else:
            t = int(row.argmax())
        choices[i] = GeneratedToken(s.seq_id, t)
    for i, s in enumerate(seqs):
        if s.params.logprobs >= 0:
            lp, top = logprob_info(logits[i], choices[i].token_id, s.params.logprobs)
            choices[i].logprob, choices[i].top = lp, top
    return choices  # type: ignore[return-value]

