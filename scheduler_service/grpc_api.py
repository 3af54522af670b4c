"""The public gRPC API (seqserve.v1.Generation): an adapter over the front end."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields
from seqserve.v1 import generate_pb2, generate_pb2_grpc

from scheduler_service.admission import QueueFull
from scheduler_service.frontend import Frontend, GenerationRequest, Unavailable
from scheduler_service.params import RequestError
from scheduler_service.sequence import FinishEvent, FinishReason, Sequence, TokenEvent

logger = logging.getLogger(__name__)

_FINISH = {FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
           FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
           FinishReason.STOP: generate_pb2.FINISH_REASON_STOP}
_OPTIONAL = ("max_new_tokens", "decoding_strategy", "do_sample", "temperature", "top_k", "top_p",
             "typical_p", "repetition_penalty", "seed", "ignore_eos", "penalty_alpha", "logprobs",
             "num_beams", "length_penalty", "early_stopping", "num_return_sequences")


def _params(p: generate_pb2.DecodingParameters) -> dict[str, Any]:
    """The fields the client set (proto3 presence), as the front end's parameter mapping."""
    out = {name: getattr(p, name) for name in _OPTIONAL if p.HasField(name)}
    if p.stop:
        out["stop"] = list(p.stop)
    return out


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def _start(self, request, context) -> Sequence:
        if isinstance(request, bytes):  # registered by add_to_server: parse it here
            request = await _parse_request(request, context)
        try:
            if len(unknown_fields.UnknownFieldSet(request)) or (
                    request.HasField("parameters")
                    and len(unknown_fields.UnknownFieldSet(request.parameters))):
                raise RequestError("the request has fields this server does not know; "
                                   "check the client's seqserve.v1 proto")
            prompt = (list(request.input_ids.ids) if request.WhichOneof("prompt") == "input_ids"
                      else request.inputs)
            seqs = await self.frontend.submit(GenerationRequest(
                [prompt], _params(request.parameters), request.cached_prompt,
                request.request_id, priority=request.priority,
                length_hint=(request.length_hint if request.HasField("length_hint")
                             else None),
                eos_after_tokens=(request.eos_after_tokens
                                  if request.HasField("eos_after_tokens") else None)))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return seqs[0]

    async def Generate(self, request, context):
        seq = await self._start(request, context)
        # One message per token while the client keeps up; the tokens that piled up while
        # it did not go in one message (token_response): a message costs the scheduler a
        # send, which is most of its cost per token.
        async for batch in self.frontend.event_batches(seq):
            end = batch[-1] if isinstance(batch[-1], FinishEvent) else None
            tokens = batch[:-1] if end is not None else batch
            if tokens:
                yield token_response(seq.request_id, tokens)
            if end is not None:
                await _abort_on_error(end, context)
                yield generate_pb2.GenerateResponse(
                    request_id=seq.request_id, text=end.text,
                    finish_reason=_FINISH[end.reason], usage=_usage(end),
                    sequences=_sequences(end))

    async def GenerateUnary(self, request, context):
        seq = await self._start(request, context)
        *tokens, end = await self.frontend.all_events(seq)
        await _abort_on_error(end, context)
        return generate_pb2.GenerateReply(
            request_id=seq.request_id,
            generated_text="".join([e.text for e in tokens] + [end.text]),
            finish_reason=_FINISH[end.reason], usage=_usage(end),
            tokens=[_token(e) for e in tokens], sequences=_sequences(end))

    async def ModelInfo(self, request, context):
        try:
            state = self.frontend.serving_state()
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        cfg, info = state.config, state.worker
        return generate_pb2.ModelInfoResponse(
            model_id=cfg.model_id, architecture=info.architecture, vocab_size=info.vocab_size,
            max_position_embeddings=info.max_position_embeddings, dtype=info.dtype,
            device=info.device,
            # What a request can actually get: at least one prompt token shares the context.
            max_new_tokens_limit=min(state.limits.max_new_tokens_limit,
                                     info.max_position_embeddings - 1),
            decoding_strategy=cfg.decoding_strategy,
            max_rolling_batch_size=cfg.max_rolling_batch_size, max_sparsity=cfg.max_sparsity,
            max_splits=cfg.max_splits, kv_budget_tokens=state.workers.kv_budget,
            eos_token_ids=sorted(state.workers.eos_ids))


async def _parse_request(data: bytes, context) -> generate_pb2.GenerateRequest:
    # With the generated registration, grpc parses the request before the handler runs,
    # and bytes that do not parse (a string field that is not UTF-8, a truncated message)
    # come back as UNKNOWN with a traceback in the log. A malformed request is the
    # client's fault: INVALID_ARGUMENT, naming the problem.
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except pb_message.DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid seqserve.v1.GenerateRequest ({exc}); "
                            "string fields must be valid UTF-8")


def add_to_server(servicer: GenerationServicer, server) -> None:
    """Register `servicer` like generate_pb2_grpc.add_GenerationServicer_to_server, but
    with GenerateRequest parsed by the handlers, so undecodable bytes (invalid UTF-8 in a
    string field, corrupt wire format) get INVALID_ARGUMENT instead of grpc's UNKNOWN."""
    pb = generate_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(
            servicer.GenerateUnary, request_deserializer=None,
            response_serializer=pb.GenerateReply.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo, request_deserializer=pb.ModelInfoRequest.FromString,
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


async def _abort_on_error(event: FinishEvent, context) -> None:
    if event.reason == FinishReason.ERROR:
        await context.abort(grpc.StatusCode.UNAVAILABLE, event.error or "generation failed")


def token_response(request_id: str, events: list[TokenEvent]) -> generate_pb2.GenerateResponse:
    """The streamed message of one token (in `token`) or of several (in `tokens`, with
    each one's text in `token_texts` and all of it in `text`)."""
    if len(events) == 1:
        return generate_pb2.GenerateResponse(request_id=request_id, token=_token(events[0]),
                                             text=events[0].text)
    texts = [e.text for e in events]
    return generate_pb2.GenerateResponse(request_id=request_id,
                                         tokens=[_token(e) for e in events],
                                         token_texts=texts, text="".join(texts))


def _token(event: TokenEvent) -> generate_pb2.Token:
    tok = generate_pb2.Token(id=event.token_id)
    if event.logprob is not None:
        tok.logprob = event.logprob
        texts = event.top_text or [""] * len(event.top or [])
        tok.top_logprobs.extend(generate_pb2.TopLogprob(id=i, logprob=lp, text=text)
                                for (i, lp), text in zip(event.top or [], texts))
    return tok


def _sequences(event: FinishEvent) -> list[generate_pb2.ReturnedSequence]:
    return [generate_pb2.ReturnedSequence(text=h.text, token_ids=h.token_ids, score=h.score,
                                          finish_reason=_FINISH[h.reason])
            for h in event.sequences or ()]


def _usage(event: FinishEvent) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=event.prompt_tokens,
                              generated_tokens=event.generated_tokens,
                              cached_tokens=event.cached_tokens)
