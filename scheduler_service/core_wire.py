"""The core's wire format (seqserve.core.v1) on both of its sides: a front end's sequences
going in, and each Step's tokens and endings coming back (core_service.py, remote_core.py)."""

from __future__ import annotations

from seqserve.core.v1 import core_pb2
from seqserve.worker.v1 import worker_pb2

from scheduler_service.params import DecodingConfig
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import StepToken
from seqserve_common.decoding import DecodingStrategy

_EARLY_STOPPING = {False: worker_pb2.EARLY_STOPPING_FALSE, True: worker_pb2.EARLY_STOPPING_TRUE,
                   "never": worker_pb2.EARLY_STOPPING_NEVER}
_EARLY_STOPPING_BACK = {v: k for k, v in _EARLY_STOPPING.items()}
_REASON = {FinishReason.EOS: core_pb2.FINISH_REASON_EOS,
           FinishReason.LENGTH: core_pb2.FINISH_REASON_LENGTH,
           FinishReason.ERROR: core_pb2.FINISH_REASON_ERROR}
_REASON_BACK = {v: k for k, v in _REASON.items()}


def encode_sequence(seq: Sequence) -> core_pb2.NewRequest:
    p = seq.params
    return core_pb2.NewRequest(
        sequence_id=seq.seq_id, request_id=seq.request_id, prompt_ids=seq.prompt_ids,
        decoding=core_pb2.Decoding(
            max_new_tokens=p.max_new_tokens, strategy=p.strategy.to_proto(),
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p,
            repetition_penalty=p.repetition_penalty, ignore_eos=p.ignore_eos,
            penalty_alpha=p.penalty_alpha, logprobs=p.logprobs, num_beams=p.num_beams,
            length_penalty=p.length_penalty, early_stopping=_EARLY_STOPPING[p.early_stopping],
            num_return_sequences=p.num_return_sequences),
        sampling_seed=seq.sampling_seed, pin_tokens=seq.pin_tokens, priority=seq.priority,
        length_hint=seq.length_hint, eos_after_tokens=seq.eos_after_tokens,
        arrival_time=seq.arrival_time)


def decode_sequence(msg: core_pb2.NewRequest) -> Sequence:
    """The core's copy of a front end's sequence: no text side (no detokenizer, no stop
    strings, no events); its tokens go back over the wire."""
    d = msg.decoding
    params = DecodingConfig(
        max_new_tokens=d.max_new_tokens, strategy=DecodingStrategy.from_proto(d.strategy),
        temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, typical_p=d.typical_p,
        repetition_penalty=d.repetition_penalty, ignore_eos=d.ignore_eos,
        penalty_alpha=d.penalty_alpha, logprobs=d.logprobs, num_beams=d.num_beams,
        length_penalty=d.length_penalty, early_stopping=_EARLY_STOPPING_BACK[d.early_stopping],
        num_return_sequences=d.num_return_sequences)

    def opt(name: str) -> int | None:
        return getattr(msg, name) if msg.HasField(name) else None
    return Sequence(
        seq_id=msg.sequence_id, request_id=msg.request_id, prompt_ids=list(msg.prompt_ids),
        params=params, detokenizer=None, stops=None, sampling_seed=opt("sampling_seed"),
        pin_tokens=msg.pin_tokens, priority=msg.priority, length_hint=opt("length_hint"),
        eos_after_tokens=opt("eos_after_tokens"), arrival_time=msg.arrival_time)


class OutputBatch:
    """Tokens and endings for one front end, gathered over a Step and sent as one
    StepOutputs message."""

    def __init__(self):
        self.sequence_ids: list[int] = []
        self.token_ids: list[int] = []
        self.scored: list[core_pb2.ScoredToken] = []
        self.finished: list[core_pb2.Finished] = []

    def __bool__(self) -> bool:
        return bool(self.sequence_ids or self.scored or self.finished)

    def add_token(self, tok: StepToken) -> None:
        if tok.logprob is None:
            self.sequence_ids.append(tok.seq_id)
            self.token_ids.append(tok.token_id)
        else:
            self.scored.append(core_pb2.ScoredToken(
                sequence_id=tok.seq_id, token_id=tok.token_id, logprob=tok.logprob,
                top_logprobs=[{"id": t, "logprob": lp} for t, lp in tok.top_logprobs]))

    def add_finish(self, seq: Sequence, reason: FinishReason, error: str | None,
                   beams: tuple = ()) -> None:
        self.finished.append(core_pb2.Finished(
            sequence_id=seq.seq_id, reason=_REASON[reason], error=error or "",
            cached_tokens=seq.cached_tokens,
            beams=[{"token_ids": ids, "score": score} for ids, score in beams]))

    def message(self, waiting: int) -> core_pb2.CoreEvent:
        return core_pb2.CoreEvent(outputs=core_pb2.StepOutputs(
            sequence_ids=self.sequence_ids, token_ids=self.token_ids, scored=self.scored,
            finished=self.finished, waiting=waiting))


def scored_token(msg: core_pb2.ScoredToken) -> tuple[int, float, list[tuple[int, float]]]:
    return msg.token_id, msg.logprob, [(t.id, t.logprob) for t in msg.top_logprobs]


def finish_reason(msg: core_pb2.Finished) -> FinishReason:
    return _REASON_BACK[msg.reason]


def beams(msg: core_pb2.Finished) -> tuple[tuple[tuple[int, ...], float], ...]:
    return tuple((tuple(b.token_ids), b.score) for b in msg.beams)
