"""The public gRPC API (seqserve.v1.Generation): validate, tokenize, queue, stream."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator

import grpc
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.loop import IterationLoop
from scheduler_service.params import Limits, RequestError, check_text, resolve
from scheduler_service.sequence import FinishEvent, FinishReason, Sequence, TokenEvent
from scheduler_service.waiting_queue import QueueFull
from seqserve.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

_FINISH = {FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
           FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
           FinishReason.STOP: generate_pb2.FINISH_REASON_STOP}
MAX_CHARS_PER_TOKEN = 64
_OPTIONAL = ("max_new_tokens", "decoding_strategy", "do_sample", "temperature", "top_k", "top_p",
             "typical_p", "repetition_penalty", "seed", "ignore_eos", "penalty_alpha", "logprobs")


def params_to_dict(p: generate_pb2.DecodingParameters) -> dict[str, Any]:
    """The fields the client set (proto3 presence), as the validator's mapping."""
    out = {name: getattr(p, name) for name in _OPTIONAL if p.HasField(name)}
    if p.stop:
        out["stop"] = list(p.stop)
    return out


class ServingState:
    """What the handlers need once the worker is connected; None before (not ready)."""

    def __init__(self, loop: IterationLoop, tokenizer, limits: Limits, model_info):
        self.loop, self.tokenizer, self.limits, self.model_info = loop, tokenizer, limits, model_info


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.state: ServingState | None = None
        self.draining = False

    async def _ready(self, context) -> ServingState:
        if self.state is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is starting: no worker connected yet; retry")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is shutting down and admits no new requests")
        return self.state

    async def new_sequence(self, state: ServingState, inputs: str, cached_prompt: str,
                           params: dict[str, Any], request_id: str) -> Sequence:
        """Validate and tokenize one request (raises RequestError)."""
        check_text("inputs", inputs, required=True)
        check_text("cached_prompt", cached_prompt, required=False)
        text = cached_prompt + inputs
        # Refuse before tokenizing: no tokenizer packs this many characters per token, so
        # the prompt cannot fit the context, and tokenizing megabytes costs seconds of CPU.
        max_chars = MAX_CHARS_PER_TOKEN * state.limits.max_position_embeddings
        if len(text) > max_chars:
            raise RequestError(f"prompt of {len(text)} characters cannot fit the model's context "
                               f"of {state.limits.max_position_embeddings} tokens; send at most "
                               f"{max_chars} characters")
        ids = await asyncio.to_thread(lambda: state.tokenizer(text).input_ids)
        if not ids:
            raise RequestError("inputs tokenized to no tokens; send some text")
        pin = 0
        if cached_prompt:
            # Tokens merge across the boundary, so pin only the tokens that the cached
            # prompt alone and the whole prompt share.
            alone = await asyncio.to_thread(lambda: state.tokenizer(cached_prompt).input_ids)
            while pin < min(len(alone), len(ids)) and alone[pin] == ids[pin]:
                pin += 1
        cfg = resolve(params, state.limits, len(ids))
        loop = state.loop
        if len(ids) + cfg.max_new_tokens > loop.kv_budget:
            raise RequestError(f"prompt plus max_new_tokens needs {len(ids) + cfg.max_new_tokens}"
                               f" KV tokens; the workers hold {loop.kv_budget}")
        return Sequence(
            seq_id=loop.new_seq_id(), request_id=request_id or uuid.uuid4().hex,
            prompt_ids=list(ids), params=cfg,
            detokenizer=IncrementalDetokenizer(state.tokenizer, ids),
            stops=StopMatcher(cfg.stop), sampling_seed=cfg.seed, pin_tokens=pin)

    async def _start(self, request, context) -> tuple[ServingState, Sequence]:
        if isinstance(request, bytes):  # registered by add_to_server: parse it here
            request = await _parse_request(request, context)
        state = await self._ready(context)
        try:
            if len(unknown_fields.UnknownFieldSet(request)) or (
                    request.HasField("parameters")
                    and len(unknown_fields.UnknownFieldSet(request.parameters))):
                raise RequestError("the request has fields this server does not know; "
                                   "check the client's seqserve.v1 proto")
            seq = await self.new_sequence(state, request.inputs, request.cached_prompt,
                                          params_to_dict(request.parameters), request.request_id)
            state.loop.submit(seq)
        except RequestError as exc:
            state.loop.metrics.requests_failed.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            state.loop.metrics.requests_failed.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return state, seq

    async def events(self, state: ServingState, seq: Sequence) -> AsyncIterator:
        """The sequence's events until its end; cancels it if the caller goes away."""
        done = False
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, FinishEvent):
                    done = True
                yield event
                if done:
                    return
        finally:
            if not done:
                state.loop.cancel(seq)

    async def Generate(self, request, context):
        state, seq = await self._start(request, context)
        async for event in self.events(state, seq):
            if isinstance(event, TokenEvent):
                yield generate_pb2.GenerateResponse(
                    request_id=seq.request_id, token=_token(event), text=event.text)
            else:
                await _abort_on_error(state, event, context)
                yield generate_pb2.GenerateResponse(
                    request_id=seq.request_id, text=event.text,
                    finish_reason=_FINISH[event.reason], usage=_usage(event))

    async def GenerateUnary(self, request, context):
        state, seq = await self._start(request, context)
        texts, tokens = [], []
        async for event in self.events(state, seq):
            texts.append(event.text)
            if isinstance(event, TokenEvent):
                tokens.append(_token(event))
            else:
                await _abort_on_error(state, event, context)
                return generate_pb2.GenerateReply(
                    request_id=seq.request_id, generated_text="".join(texts),
                    finish_reason=_FINISH[event.reason], usage=_usage(event), tokens=tokens)

    async def ModelInfo(self, request, context):
        state = await self._ready(context)
        return state.model_info


async def _parse_request(data: bytes, context) -> generate_pb2.GenerateRequest:
    # Why: with the generated registration, grpc parses the request before the handler
    # runs, and bytes that do not parse (a string field that is not UTF-8, a truncated
    # message) come back as UNKNOWN "Unexpected DecodeError" with a traceback in the log.
    # A malformed request is the client's fault: INVALID_ARGUMENT, naming the problem.
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


async def _abort_on_error(state: ServingState, event: FinishEvent, context) -> None:
    if event.reason == FinishReason.ERROR:
        state.loop.metrics.requests_failed.labels("UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, event.error or "generation failed")


def _token(event: TokenEvent) -> generate_pb2.Token:
    tok = generate_pb2.Token(id=event.token_id)
    if event.logprob is not None:
        tok.logprob = event.logprob
        tok.top_logprobs.extend(generate_pb2.TopLogprob(id=i, logprob=lp)
                                for i, lp in (event.top or []))
    return tok


def _usage(event: FinishEvent) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=event.prompt_tokens,
                              generated_tokens=event.generated_tokens,
                              cached_tokens=event.cached_tokens)
