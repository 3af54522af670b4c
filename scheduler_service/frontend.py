"""The front end every API adapter stands on: readiness, validation and tokenization of
requests, the waiting queue, each sequence's events, cancellation and draining.

The gRPC API (grpc_api.py) and the HTTP routes (http_api.py) are thin adapters: they turn
their wire format into a GenerationRequest, call `submit`, and turn the events back into
their wire format. Errors come back as RequestError (bad input), QueueFull (no room) or
Unavailable (no worker yet, or shutting down), each mapped to a status by the adapter.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

from scheduler_service.admission import QueueFull
from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.params import Limits, RequestError, check_text, resolve
from scheduler_service.sequence import FinishEvent, FinishReason, Sequence, TokenEvent
from scheduler_service.worker_client import WorkerInfo
from seqserve_common.config import ServingConfig

# No tokenizer packs more characters than this into one token: a longer prompt cannot fit
# the context, and is refused before tokenizing megabytes costs seconds of CPU.
MAX_CHARS_PER_TOKEN = 64


class Unavailable(Exception):
    """The server takes no requests now (no worker connected yet, or shutting down)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One client request as every API hands it in: one or several prompts sharing the
    decoding parameters (a mapping of parameter names to values, checked by params.resolve)."""

    prompts: list[str]
    params: Mapping[str, Any] = field(default_factory=dict)
    cached_prompt: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class ServingState:
    """What serving needs once a worker is connected."""

    loop: IterationLoop
    tokenizer: Any  # a transformers tokenizer
    limits: Limits
    worker: WorkerInfo
    config: ServingConfig


class Frontend:
    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics
        self.state: ServingState | None = None
        self.draining = False

    @property
    def ready(self) -> bool:
        return self.state is not None and not self.draining

    def serving_state(self) -> ServingState:
        """The state to serve a request with (raises Unavailable)."""
        if self.state is None:
            raise Unavailable("the server is starting: no worker connected yet; retry")
        if self.draining:
            raise Unavailable("the server is shutting down and admits no new requests")
        return self.state

    async def submit(self, request: GenerationRequest) -> list[Sequence]:
        """Validate, tokenize and queue every prompt of the request, all or none (raises
        RequestError, QueueFull or Unavailable; each is counted as a refusal)."""
        try:
            state = self.serving_state()
            # Refuse what cannot be queued before tokenizing it.
            state.loop.waiting.check_room(len(request.prompts))
            rid = request.request_id or uuid.uuid4().hex
            single = len(request.prompts) == 1
            seqs = [await self._new_sequence(state, text, request, rid if single else f"{rid}-{i}")
                    for i, text in enumerate(request.prompts)]
            queued = []
            try:
                for seq in seqs:
                    state.loop.submit(seq)
                    queued.append(seq)
            except QueueFull:
                for seq in queued:
                    state.loop.cancel(seq)
                raise
        except RequestError:
            self.metrics.requests_failed.labels("INVALID_ARGUMENT").inc()
            raise
        except QueueFull:
            self.metrics.requests_failed.labels("RESOURCE_EXHAUSTED").inc()
            raise
        except Unavailable:
            self.metrics.requests_failed.labels("UNAVAILABLE").inc()
            raise
        return seqs

    async def events(self, seq: Sequence) -> AsyncIterator[TokenEvent | FinishEvent]:
        """The sequence's events until its end; cancels it if the caller stops early (the
        client went away)."""
        done = False
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, FinishEvent):
                    done = True
                    if event.reason == FinishReason.ERROR:
                        self.metrics.requests_failed.labels("UNAVAILABLE").inc()
                yield event
                if done:
                    return
        finally:
            if not done and self.state is not None:
                self.state.loop.cancel(seq)

    async def _new_sequence(self, state: ServingState, inputs: str, request: GenerationRequest,
                            request_id: str) -> Sequence:
        cached_prompt = request.cached_prompt
        check_text("inputs", inputs, required=True)
        check_text("cached_prompt", cached_prompt, required=False)
        text = cached_prompt + inputs
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
        cfg = resolve(request.params, state.limits, len(ids))
        loop = state.loop
        if len(ids) + cfg.max_new_tokens > loop.kv_budget:
            raise RequestError(f"prompt plus max_new_tokens needs {len(ids) + cfg.max_new_tokens}"
                               f" KV tokens; the workers hold {loop.kv_budget}")
        return Sequence(
            seq_id=loop.new_seq_id(), request_id=request_id, prompt_ids=list(ids), params=cfg,
            detokenizer=IncrementalDetokenizer(state.tokenizer, ids),
            stops=StopMatcher(cfg.stop), sampling_seed=cfg.seed, pin_tokens=pin)
