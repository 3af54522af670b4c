"""From the worker's tokens to what a client sees: detokenized text, stop strings, EOS and
length limits, and the token and finish events a front end streams."""

from __future__ import annotations

from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.sequence import FinishEvent, FinishReason, Hypothesis, Sequence, TokenEvent
from scheduler_service.worker_client import StepToken


def token_text(seq: Sequence, token_id: int) -> str:
    """One token's text on its own, as the tokenizer decodes it alone (a partial character
    comes out as U+FFFD; special tokens keep their text, e.g. "</s>")."""
    tokenizer = seq.detokenizer.tokenizer
    return tokenizer.decode([token_id], skip_special_tokens=False)


def emit_token(seq: Sequence, tok: StepToken, eos_ids: frozenset[int]) -> FinishReason | None:
    """Append the token, stream its text, and say whether it ends the sequence."""
    seq.output_ids.append(tok.token_id)
    text, stopped = seq.stops.feed(seq.detokenizer.add(tok.token_id))
    top = top_text = None
    if tok.logprob is not None:
        top = list(tok.top_logprobs)
        top_text = [token_text(seq, token_id) for token_id, _ in top]
    seq.events.put_nowait(TokenEvent(tok.token_id, text, tok.logprob, top, top_text))
    if stopped:
        return FinishReason.STOP
    if tok.token_id in eos_ids and not seq.params.ignore_eos:
        return FinishReason.EOS
    if seq.eos_after_tokens is not None and len(seq.output_ids) >= seq.eos_after_tokens:
        return FinishReason.EOS
    if len(seq.output_ids) >= seq.params.max_new_tokens:
        return FinishReason.LENGTH
    return None


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
    for t in tok.beams[0][0]:
        seq.output_ids.append(t)
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
    return reason
