"""From the worker's tokens to what a client sees: detokenized text, stop strings, EOS and
length limits, and the token and finish events a front end streams."""

from __future__ import annotations

from typing import Protocol

from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.sequence import FinishEvent, FinishReason, Hypothesis, Sequence, TokenEvent
from scheduler_service.worker_client import StepToken


def token_text(seq: Sequence, token_id: int) -> str:
    """One token's text on its own, as the tokenizer decodes it alone (a partial character
    comes out as U+FFFD; special tokens keep their text, e.g. "</s>")."""
    tokenizer = seq.detokenizer.tokenizer
    return tokenizer.decode([token_id], skip_special_tokens=False)


def accept_token(seq: Sequence, token_id: int, eos_ids: frozenset[int]) -> FinishReason | None:
    """Append the token to the output and say whether EOS or a length limit ends the
    sequence (what the core decides; stop strings are the text's, stream_token)."""
    seq.output_ids.append(token_id)
    if token_id in eos_ids and not seq.params.ignore_eos:
        return FinishReason.EOS
    if seq.eos_after_tokens is not None and len(seq.output_ids) >= seq.eos_after_tokens:
        return FinishReason.EOS
    if len(seq.output_ids) >= seq.params.max_new_tokens:
        return FinishReason.LENGTH
    return None


def stream_token(seq: Sequence, token_id: int, logprob: float | None = None,
                 top: list[tuple[int, float]] | None = None) -> bool:
    """Stream an accepted token's text (and logprobs); returns whether it completed a
    stop string."""
    text, stopped = seq.stops.feed(seq.detokenizer.add(token_id))
    top_text = None if top is None else [token_text(seq, t) for t, _ in top]
    seq.events.put_nowait(TokenEvent(token_id, text, logprob, top, top_text))
    return stopped


def emit_token(seq: Sequence, tok: StepToken, eos_ids: frozenset[int]) -> FinishReason | None:
    """Append the token, stream its text, and say whether it ends the sequence."""
    reason = accept_token(seq, tok.token_id, eos_ids)
    top = None if tok.logprob is None else list(tok.top_logprobs)
    if stream_token(seq, tok.token_id, tok.logprob, top):
        return FinishReason.STOP
    return reason


def accept_beams(seq: Sequence, tok: StepToken, eos_ids: frozenset[int]) -> FinishReason:
    """A beam search ended: its best hypothesis's tokens are the output; says why it ended."""
    best = tok.beams[0][0]
    seq.output_ids.extend(best)
    return FinishReason.EOS if best and best[-1] in eos_ids else FinishReason.LENGTH


def emit_beams(seq: Sequence, tok: StepToken, eos_ids: frozenset[int]) -> FinishReason:
    """A beam search ended: stream the best hypothesis's tokens now, keep every returned
    hypothesis for the finish event, and say why the best one ended."""
    seq.hypotheses = []
    for token_ids, score in tok.beams:
        detok = IncrementalDetokenizer(seq.detokenizer.tokenizer, seq.prompt_ids)
        text = "".join(detok.add(t) for t in token_ids) + detok.flush()
        reason = (FinishReason.EOS if token_ids and token_ids[-1] in eos_ids
                  else FinishReason.LENGTH)
        seq.hypotheses.append(Hypothesis(list(token_ids), text, score, reason))
    accept_beams(seq, tok, eos_ids)
    for t in tok.beams[0][0]:
        text, _ = seq.stops.feed(seq.detokenizer.add(t))  # no stop strings with beams
        seq.events.put_nowait(TokenEvent(t, text))
    return seq.hypotheses[0].reason


def emit_finish(seq: Sequence, reason: FinishReason, error: str | None = None) -> FinishReason:
    """Release the text held back and send the finish event; returns the final reason (a
    stop string completed by the held-back text turns EOS or LENGTH into STOP)."""
    tail = ""
    if reason in (FinishReason.EOS, FinishReason.LENGTH):
        tail, stopped = seq.stops.feed(seq.detokenizer.flush())
        if stopped:
            reason = FinishReason.STOP
        else:
            tail += seq.stops.flush()
    seq.events.put_nowait(FinishEvent(reason, tail, len(seq.prompt_ids), len(seq.output_ids),
                                      seq.cached_tokens, error, seq.hypotheses))
    seq.ended.set()
    return reason


class OutputSink(Protocol):
    """Where the loop hands a sequence's tokens and ending (Sequence.sink): this process's
    events (LOCAL), or a front-end process (core_service.FrontendLink)."""

    def token(self, seq: Sequence, tok: StepToken, eos_ids: frozenset[int]
              ) -> FinishReason | None: ...

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None
               ) -> FinishReason: ...


class LocalOutput:
    """Text and events made here, in the loop's process."""

    def token(self, seq: Sequence, tok: StepToken, eos_ids: frozenset[int]
              ) -> FinishReason | None:
        return emit_beams(seq, tok, eos_ids) if tok.beams else emit_token(seq, tok, eos_ids)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None) -> FinishReason:
        return emit_finish(seq, reason, error)


LOCAL = LocalOutput()
