"""The front end every API adapter stands on: readiness, validation and tokenization of
requests, the waiting queue, each sequence's events, cancellation and draining.

The gRPC API (grpc_api.py) and the HTTP routes (http_api.py) are thin adapters: they turn
their wire format into a GenerationRequest, call `submit`, and turn the events back into
their wire format. Errors come back as RequestError (bad input), QueueFull (no room) or
Unavailable (no worker yet, or shutting down), each mapped to a status by the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Protocol

from scheduler_service.admission import QueueFull
from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.params import Limits, RequestError, check_text, resolve
from scheduler_service.policies.priority import check_priority
from scheduler_service.sequence import FinishEvent, Sequence, TokenEvent
from scheduler_service.worker_client import WorkerInfo
from seqserve_common.config import ServingConfig
from seqserve_common.decoding import DecodingStrategy

# No tokenizer packs more characters than this into one token: a longer prompt cannot fit
# the context, and is refused before tokenizing megabytes costs seconds of CPU.
MAX_CHARS_PER_TOKEN = 64
# Choices per prompt (OpenAI's `n`): each is a sequence of its own.
MAX_CHOICES = 16
# The id comes back in every streamed message: a long one multiplies the bytes a request
# costs the server per token (a 3 MB id made a 27 MB reply of 8 tokens).
MAX_REQUEST_ID_CHARS = 256

# Events handed out together at most (event_batches): bounds a catching-up message's size.
MAX_EVENTS_PER_BATCH = 64

Prompt = str | list[int]  # text, or token ids as the model's tokenizer makes them


def take_pending(queue: asyncio.Queue, first: TokenEvent | FinishEvent,
                 limit: int = MAX_EVENTS_PER_BATCH) -> list[TokenEvent | FinishEvent]:
    """`first` and the events queued behind it, at most `limit`, ending at a FinishEvent
    (nothing follows one)."""
    batch = [first]
    # empty() before get_nowait(): the usual case, nothing queued, raises no exception.
    while len(batch) < limit and not isinstance(batch[-1], FinishEvent) and not queue.empty():
        batch.append(queue.get_nowait())
    return batch


class Unavailable(Exception):
    """The server takes no requests now (no worker connected yet, or shutting down)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One client request as every API hands it in: one or several prompts sharing the
    decoding parameters (a mapping of parameter names to values, checked by params.resolve),
    and `n` choices of each. Sequences come back prompt by prompt, choice by choice."""

    prompts: list[Prompt]
    params: Mapping[str, Any] = field(default_factory=dict)
    cached_prompt: str = ""
    request_id: str = ""
    n: int = 1
    # Lower is more urgent, as in vLLM (policies/priority.py); checked by check_priority.
    priority: Any = 0
    # Policy length-batched: the client's expected output length (generate.proto 14).
    length_hint: int | None = None
    # Benchmarks and tests: end as by EOS after this many tokens (generate.proto 15).
    eos_after_tokens: int | None = None


class Core(Protocol):
    """The queues and workers behind a front end: the worker pool in this process
    (worker_pool.WorkerPool), or a core process (remote_core.RemoteCore)."""

    ready: bool
    kv_budget: int
    eos_ids: frozenset[int]

    def new_seq_id(self) -> int: ...

    def check_room(self, n: int) -> None:
        """Raise QueueFull when `n` more requests would not fit the waiting queues."""

    async def submit_all(self, seqs: list[Sequence]) -> None:
        """Queue every sequence or none (raises QueueFull, or Unavailable)."""

    def cancel(self, seq: Sequence) -> None: ...


@dataclass(frozen=True)
class ServingState:
    """What serving needs once a worker is connected."""

    workers: Core
    tokenizer: Any  # a transformers tokenizer
    limits: Limits
    worker: WorkerInfo
    config: ServingConfig


def make_serving_state(core: Core, tokenizer: Any, info: WorkerInfo, cfg: ServingConfig
                       ) -> ServingState:
    """The state to serve with once `core` has a worker that answered `info`."""
    limits = Limits(vocab_size=info.vocab_size,
                    max_position_embeddings=info.max_position_embeddings,
                    max_new_tokens_limit=cfg.max_new_tokens_limit,
                    default_max_new_tokens=cfg.default_max_new_tokens,
                    default_strategy=DecodingStrategy(cfg.decoding_strategy))
    return ServingState(core, tokenizer, limits, info, cfg)


class Frontend:
    def __init__(self, count_refusal: Callable[[str], None]):
        """`count_refusal(code)`: count a refused request (seqserve_requests_failed_total)."""
        self.count_refusal = count_refusal
        self.state: ServingState | None = None
        self.draining = False

    @property
    def ready(self) -> bool:
        """Whether to take traffic: a worker serves and the server is not shutting down."""
        return self.state is not None and not self.draining and self.state.workers.ready

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
            if isinstance(request.n, bool) or not isinstance(request.n, int) or not (
                    1 <= request.n <= MAX_CHOICES):
                raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {request.n!r}")
            priority = check_priority(request.priority)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise RequestError(
                    f"request_id has {len(request.request_id)} characters; at most "
                    f"{MAX_REQUEST_ID_CHARS} are allowed (it is echoed in every streamed "
                    f"message): send a shorter id")
            for name in ("length_hint", "eos_after_tokens"):
                value = getattr(request, name)
                if value is not None and value < 1:
                    raise RequestError(f"{name} must be >= 1 when given, got {value}")
            # Refuse what cannot be queued before tokenizing it.
            state.workers.check_room(len(request.prompts) * request.n)
            rid = request.request_id or uuid.uuid4().hex
            single = len(request.prompts) * request.n == 1
            seqs = []
            for i, prompt in enumerate(request.prompts):
                first = await self._new_sequence(state, prompt, request,
                                                 rid if single else f"{rid}-{len(seqs)}")
                first.priority = priority
                if request.eos_after_tokens is not None and first.params.num_beams > 1:
                    # Beam search picks among ended hypotheses on the worker; a cut on
                    # the scheduler's stream would not end them.
                    raise RequestError("eos_after_tokens does not work with beam search "
                                       "(num_beams > 1): leave one of them out")
                first.length_hint = request.length_hint
                first.eos_after_tokens = request.eos_after_tokens
                seqs.append(first)
                for choice in range(1, request.n):
                    seqs.append(self._another_choice(state, first, choice, f"{rid}-{len(seqs)}"))
            await state.workers.submit_all(seqs)
        except RequestError:
            self.count_refusal("INVALID_ARGUMENT")
            raise
        except QueueFull:
            self.count_refusal("RESOURCE_EXHAUSTED")
            raise
        except Unavailable:
            self.count_refusal("UNAVAILABLE")
            raise
        return seqs

    async def events(self, seq: Sequence) -> AsyncIterator[TokenEvent | FinishEvent]:
        """The sequence's events one by one until its end; cancels it if the caller stops
        early (the client went away)."""
        # aclosing: closing this generator closes event_batches now, whose `finally`
        # cancels the sequence, instead of whenever the garbage collector gets to it.
        async with contextlib.aclosing(self.event_batches(seq, limit=1)) as batches:
            async for batch in batches:
                yield batch[0]

    async def all_events(self, seq: Sequence) -> list[TokenEvent | FinishEvent]:
        """Every event of the sequence, once it has ended (a reply that is not streamed):
        one wake-up, where `events` wakes the caller for each token. Cancels the sequence
        if the caller is cancelled first (the client went away)."""
        try:
            await seq.ended.wait()
        except asyncio.CancelledError:
            if self.state is not None:
                self.state.workers.cancel(seq)
            raise
        return [seq.events.get_nowait() for _ in range(seq.events.qsize())]

    async def event_batches(self, seq: Sequence, limit: int = MAX_EVENTS_PER_BATCH
                            ) -> AsyncIterator[list[TokenEvent | FinishEvent]]:
        """The sequence's events until its end, each time the first with those already
        queued behind it, at most `limit` (see take_pending): a stream that fell behind
        catches up in one message. Cancels the sequence if the caller stops early."""
        done = False
        try:
            while True:
                batch = take_pending(seq.events, await seq.events.get(), limit)
                done = isinstance(batch[-1], FinishEvent)
                yield batch
                if done:
                    return
        finally:
            if not done and self.state is not None:
                self.state.workers.cancel(seq)

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's own chat template, ready
        for the assistant's reply (raises RequestError when the model has none)."""
        tokenizer = self.serving_state().tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use the "
                               "completions endpoint with a prompt instead")

        def render() -> list[int]:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
            return list(out["input_ids"] if isinstance(out, Mapping) else out)
        try:
            return await asyncio.to_thread(render)
        except Exception as exc:  # noqa: BLE001 - a template raises what it likes
            raise RequestError(f"messages: the chat template refused them ({exc})") from None

    def _another_choice(self, state: ServingState, first: Sequence, choice: int,
                        request_id: str) -> Sequence:
        """Choice number `choice` of the same prompt. With a seed, it draws from seed +
        choice, so the choices differ and the request still reproduces."""
        seed = (None if first.sampling_seed is None
                else (first.sampling_seed + choice) % 2**63)
        return Sequence(
            seq_id=state.workers.new_seq_id(), request_id=request_id,
            prompt_ids=list(first.prompt_ids), params=first.params,
            detokenizer=IncrementalDetokenizer(state.tokenizer, first.prompt_ids),
            stops=StopMatcher(first.params.stop), sampling_seed=seed,
            pin_tokens=first.pin_tokens, priority=first.priority,
            length_hint=first.length_hint, eos_after_tokens=first.eos_after_tokens)

    async def _prompt_ids(self, state: ServingState, prompt: Prompt, cached_prompt: str
                          ) -> tuple[list[int], int]:
        """(token ids, leading ids of the cached prompt to pin in the prefix cache)."""
        if not isinstance(prompt, str):
            if cached_prompt:
                raise RequestError("cached_prompt works with a text prompt only; put its "
                                   "tokens at the head of the token ids instead")
            if not prompt:
                raise RequestError("the prompt has no token ids; send at least one")
            vocab = state.limits.vocab_size
            bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
                        or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad!r} is not in [0, {vocab}), the "
                                   "model's vocabulary")
            if len(prompt) > state.limits.max_position_embeddings:
                raise RequestError(f"prompt of {len(prompt)} tokens exceeds the model's context "
                                   f"of {state.limits.max_position_embeddings} tokens")
            return list(prompt), 0
        check_text("inputs", prompt, required=True)
        check_text("cached_prompt", cached_prompt, required=False)
        text = cached_prompt + prompt
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
        return ids, pin

    async def _new_sequence(self, state: ServingState, prompt: Prompt,
                            request: GenerationRequest, request_id: str) -> Sequence:
        ids, pin = await self._prompt_ids(state, prompt, request.cached_prompt)
        cfg = resolve(request.params, state.limits, len(ids))
        workers = state.workers
        need = (len(ids) + cfg.max_new_tokens) * cfg.rows
        if need > workers.kv_budget:
            beams = f" times num_beams {cfg.rows}" if cfg.rows > 1 else ""
            raise RequestError(f"prompt plus max_new_tokens{beams} needs {need} KV tokens; a "
                               f"worker holds at most {workers.kv_budget}")
        return Sequence(
            seq_id=workers.new_seq_id(), request_id=request_id, prompt_ids=list(ids), params=cfg,
            detokenizer=IncrementalDetokenizer(state.tokenizer, ids),
            stops=StopMatcher(cfg.stop), sampling_seed=cfg.seed, pin_tokens=pin)
