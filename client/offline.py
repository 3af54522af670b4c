"""Offline batch generation in the shape of the continuous-batching seed: a padded batch of
prompt ids in, a list of unpadded outputs out.

    from transformers import AutoTokenizer
    from client.offline import OfflineModel

    tok = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    tok.pad_token = tok.eos_token
    inputs = tok(prompts, padding=True, return_tensors="pt").input_ids
    model = OfflineModel("127.0.0.1:8000")          # a running seqserve scheduler
    outputs = model.generate(inputs, max_new_tokens=128, do_sample=False,
                             pad_token=tok.pad_token_id)
    texts = tok.batch_decode(outputs, skip_special_tokens=True)

Every row loses its padding here and goes to the server as its own request of token ids,
all of them at once (up to `max_in_flight`), so the scheduler batches them with its
rolling batch exactly as it batches online requests: the same admission, max-sparsity
splitting, worker and sampler, and so the same tokens a single request would get. Each
output is the row's prompt without padding followed by its generated tokens (an EOS the
model produced included), as Hugging Face's and the seed's generate return them.

For the paper's sequence scheduling of a batch job (groups of similar predicted length,
VBS and FCR; docs/scheduling.md), serve with option.scheduling_policy=length-batched and
send the whole job at once (`max_in_flight` >= the rows, within the server's max_queue),
so the scheduler groups every row; `length_hints` passes lengths the caller already knows
or predicts (one per row), which that policy uses instead of its own predictor.

It talks to a server rather than running the model in this process so that one code
path serves both: the worker keeps its compute on its own main thread (worker_service/
compute.py says why), and a script needs no torch (`bench.deployment.Deployment` starts a
local worker and scheduler when there is no server).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import grpc

from client.api import Client, build_request

PADDING_SIDES = ("auto", "left", "right")


def _rows(batch: Any) -> list[list[int]]:
    """A [batch, length] tensor, array or nested list as lists of ints."""
    rows = batch.tolist() if hasattr(batch, "tolist") else list(batch)
    if not all(isinstance(r, (list, tuple)) for r in rows):
        raise ValueError("input_ids must be 2-D [batch, length]: one row of ids per prompt")
    return [[int(t) for t in row] for row in rows]


def _side(rows: list[list[int]], pad: int) -> str:
    """Which side the padding of this batch is on: left, right or none."""
    padded = [r for r in rows if any(t != pad for t in r)]  # an all-pad row tells nothing
    left = any(r[0] == pad for r in padded)
    right = any(r[-1] == pad for r in padded)
    if left and right:
        raise ValueError(
            f"pad token {pad} starts some rows and ends others, so the padding side is "
            "ambiguous (is the pad token also part of a prompt?); pass padding_side='left' "
            "or 'right', or the tokenizer's attention_mask")
    return "left" if left else "right" if right else "none"


def strip_padding(input_ids: Any, pad_token: int, padding_side: str = "auto",
                  attention_mask: Any = None) -> list[list[int]]:
    """Each row of a padded batch without its padding.

    With `attention_mask` (the tokenizer's, 1 on real tokens) the masked-out positions are
    dropped, wherever they are. Otherwise the run of `pad_token` at the start of each row
    (left padding) or at its end (right padding) goes; `auto` tells the side from the
    batch. Pad tokens inside a prompt are kept."""
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side={padding_side!r}; expected one of {PADDING_SIDES}")
    rows = _rows(input_ids)
    if attention_mask is not None:
        masks = _rows(attention_mask)
        if [len(m) for m in masks] != [len(r) for r in rows]:
            raise ValueError("attention_mask must have the shape of input_ids")
        out = [[t for t, m in zip(row, mask) if m] for row, mask in zip(rows, masks)]
    else:
        side = _side(rows, pad_token) if padding_side == "auto" else padding_side
        out = []
        for row in rows:
            a, b = 0, len(row)
            if side == "left":
                while a < b and row[a] == pad_token:
                    a += 1
            elif side == "right":
                while b > a and row[b - 1] == pad_token:
                    b -= 1
            out.append(row[a:b])
    empty = [i for i, (row, full) in enumerate(zip(out, rows))
             if not row or (attention_mask is None and all(t == pad_token for t in full))]
    if empty:
        raise ValueError(f"rows {empty} are all padding: every prompt needs a token")
    return out


class OfflineModel:
    """The seed's `model.generate(padded_ids, pad_token=...)` over a seqserve server.

    `address` and the keyword arguments (timeout, tls_ca_file, token, ...) are `Client`'s.
    `max_in_flight`: rows sent before the first reply comes back; default twice the
    server's max_rolling_batch_size, so the running batch stays full and the server's
    waiting queue (max_queue) is never flooded by a large batch."""

    def __init__(self, address: str = "127.0.0.1:8000", *, max_in_flight: int | None = None,
                 **client_options: Any):
        self.client = Client(address, **client_options)
        if max_in_flight is None:
            max_in_flight = 2 * max(1, self.client.model_info().max_rolling_batch_size)
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}; it must be >= 1")
        self.max_in_flight = max_in_flight

    def generate(self, input_ids: Any, *, pad_token: int | None = None,
                 pad_token_id: int | None = None, attention_mask: Any = None,
                 padding_side: str = "auto", max_new_tokens: int | None = None,
                 do_sample: bool = False, seed: int | None = None,
                 include_prompt: bool = True, length_hints: Sequence[int] | None = None,
                 **params: Any) -> list[list[int]]:
        """Generate for every row of `input_ids` ([batch, length], padded with `pad_token`;
        `pad_token_id` is the same, by Hugging Face's name) and return one list of ids per
        row: its unpadded prompt (unless `include_prompt` is false) and what followed.

        `do_sample=False` is greedy; `do_sample=True` samples with `temperature`, `top_k`,
        `top_p` (and the other DecodingParameters fields in `params`). A `seed` makes the
        batch reproducible: row i samples with seed + i, so equal prompts in one batch
        still get independent samples, and row i gets what a request of its own with
        seed + i gets. `num_beams` > 1 is beam search (`length_penalty`, `early_stopping`,
        `num_return_sequences`, as in Hugging Face's generate): each row then gives
        num_return_sequences outputs in a row, best first. `length_hints`: each row's
        expected output tokens, for option.scheduling_policy=length-batched."""
        if pad_token is None:
            pad_token = pad_token_id
        elif pad_token_id is not None and pad_token_id != pad_token:
            raise ValueError(f"pad_token={pad_token} and pad_token_id={pad_token_id} differ; "
                             "give one")
        if pad_token is None:
            raise ValueError("pad_token is required: the id the batch is padded with "
                             "(tokenizer.pad_token_id)")
        prompts = strip_padding(input_ids, pad_token, padding_side, attention_mask)
        params = {**params, "max_new_tokens": max_new_tokens, "do_sample": do_sample}
        if length_hints is not None and len(length_hints) != len(prompts):
            raise ValueError(f"length_hints has {len(length_hints)} values for "
                             f"{len(prompts)} rows; give one per row")
        hints = list(length_hints) if length_hints is not None else [None] * len(prompts)
        requests = [build_request(p, **params, seed=None if seed is None else seed + i,
                                  length_hint=hint)
                    for i, (p, hint) in enumerate(zip(prompts, hints))]
        out = []
        for prompt, reply in zip(prompts, self.run_requests(requests)):
            head = list(prompt) if include_prompt else []
            # Beam search returns num_return_sequences hypotheses per row, best first:
            # consecutive outputs, as generate's [batch * num_return_sequences] rows.
            hypotheses = [list(s.token_ids) for s in reply.sequences]
            out += [head + ids for ids in hypotheses or [[t.id for t in reply.tokens]]]
        return out

    def run_requests(self, requests: Sequence) -> list:
        """GenerateUnary for every request, at most max_in_flight outstanding; replies in
        request order. A failed row raises its gRPC error (the others are cancelled)."""
        call = self.client.stub.GenerateUnary
        replies: list = [None] * len(requests)
        pending: deque = deque()
        try:
            for i, request in enumerate(requests):
                if len(pending) >= self.max_in_flight:
                    j, future = pending.popleft()
                    replies[j] = future.result()
                pending.append((i, call.future(request, timeout=self.client.timeout,
                                               metadata=self.client.metadata)))
            while pending:
                j, future = pending.popleft()
                replies[j] = future.result()
        except grpc.RpcError:
            for _, future in pending:
                future.cancel()
            raise
        return replies

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> OfflineModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
