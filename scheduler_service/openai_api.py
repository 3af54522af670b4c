"""OpenAI-compatible HTTP API on the scheduler (option.openai_port, 8081 by default):
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`.

An adapter over the front end, like grpc_api.py and http_api.py: the body is parsed into a
pydantic model (openai_schemas.py), becomes a GenerationRequest, and the sequences'
events become OpenAI's reply, or its server-sent-event chunks with `stream: true`.
Errors are OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`).
docs/openai.md lists the parameters and what is not supported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import AsyncIterator

from aiohttp import web

from scheduler_service import auth
from scheduler_service.admission import QueueFull
from scheduler_service.frontend import Frontend, GenerationRequest, Unavailable
from scheduler_service.http_server import (
    BODY_TIMEOUT_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_BODY_BYTES,
    SHUTDOWN_TIMEOUT_S,
    AppServer,
)
from scheduler_service.openai_schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    decoding_params,
    parse,
)
from scheduler_service.params import RequestError
from scheduler_service.sequence import FinishEvent, FinishReason, Sequence, TokenEvent

logger = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/metrics"})
_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop",
           FinishReason.CANCELLED: "abort"}


def _json(status: int, body) -> web.Response:
    return web.json_response(body, status=status)


class _Choice:
    """One choice's text, logprobs and end, in OpenAI's completion or chat form."""

    def __init__(self, index: int, chat: bool, tokenizer, logprobs: bool):
        self.index, self.chat, self.tokenizer = index, chat, tokenizer
        self.logprobs = logprobs
        self.parts: list[str] = []
        self.entries: list[dict] = []  # chat: logprob objects of the tokens
        self.legacy = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0
        self.finish: FinishEvent | None = None

    def _text_of(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def add(self, ev: TokenEvent | FinishEvent) -> dict | None:
        """Record the event; returns the logprobs of just this event (None without)."""
        self.parts.append(ev.text)
        if isinstance(ev, FinishEvent):
            self.finish = ev
            return None
        if not self.logprobs or ev.logprob is None:
            self.offset += len(ev.text)
            return None
        text = self._text_of(ev.token_id)
        alts = list(zip(ev.top or [], ev.top_text or [self._text_of(i) for i, _ in ev.top or []]))
        if self.chat:
            entry = {"token": text, "logprob": ev.logprob, "bytes": list(text.encode()),
                     "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                      for (_, lp), t in alts]}
            self.entries.append(entry)
            self.offset += len(ev.text)
            return {"content": [entry], "refusal": None}
        top = {t: lp for (_, lp), t in alts}
        top.setdefault(text, ev.logprob)
        one = {"tokens": [text], "token_logprobs": [ev.logprob], "top_logprobs": [top],
               "text_offset": [self.offset]}
        for key, value in one.items():
            self.legacy[key].extend(value)
        self.offset += len(ev.text)
        return one

    def all_logprobs(self) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": self.entries, "refusal": None} if self.chat else self.legacy

    def reply(self) -> dict:
        text = "".join(self.parts)
        out = {"index": self.index}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        out["logprobs"] = self.all_logprobs()
        out["finish_reason"] = _FINISH.get(self.finish.reason, "stop")
        return out


def _usage(choices: list[_Choice], n: int) -> dict:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
    done = [c for c in choices if c.finish is not None]
    prompt = sum(c.finish.prompt_tokens for c in done if c.index % n == 0)
    cached = sum(c.finish.cached_tokens for c in done if c.index % n == 0)
    completion = sum(c.finish.generated_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class OpenAIApp:
    """The /v1 routes. `model_names`: the names a request's `model` may carry (the first is
    the one /v1/models lists); `token`: the bearer token required, empty for none."""

    def __init__(self, frontend: Frontend, model_names: tuple[str, ...], *, token: str = "",
                 shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
                 body_timeout: float = BODY_TIMEOUT_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S, metrics=None):
        self.frontend = frontend
        self.model_names = tuple(dict.fromkeys(n for n in model_names if n))
        self.token = token.encode("utf-8") if token else b""
        self.shutdown_timeout, self.body_timeout = shutdown_timeout, body_timeout
        self.keepalive_timeout = keepalive_timeout
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self._errors, self._auth])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model)
        self.app.router.add_get("/health", self.health)
        if metrics is not None:  # /metrics, open like /health (see docs/deployment.md)
            self.app.router.add_get("/metrics", metrics)
        self.server = AppServer(self.app, shutdown_timeout=shutdown_timeout,
                                keepalive_timeout=keepalive_timeout)

    # --- middlewares --------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """ApiError and aiohttp's own errors (404, 405, 413) as OpenAI's error object."""
        try:
            return await handler(request)
        except ApiError as exc:
            return _json(exc.status, exc.body())
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = f"the request body exceeds the limit of {MAX_BODY_BYTES} bytes"
            else:
                message = f"{exc.reason}: {request.method} {request.path}"
            code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status)
            resp = _json(exc.status, ApiError(exc.status, message, None, code).body())
            if "Allow" in exc.headers:
                resp.headers["Allow"] = exc.headers["Allow"]
            return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.token and request.path not in OPEN_PATHS:
            problem = auth.check_authorization(request.headers.get("Authorization"), self.token)
            if problem is not None:
                if problem == auth.MISSING:
                    problem = ("missing credentials: this server requires the header "
                               "'Authorization: Bearer <token>' (the openai client's api_key)")
                elif problem == auth.MALFORMED:
                    problem = "malformed credentials: send 'Authorization: Bearer <token>'"
                resp = _json(401, ApiError(401, problem, None, "invalid_api_key").body())
                resp.headers["WWW-Authenticate"] = 'Bearer realm="seqserve"'
                return resp
        return await handler(request)

    # --- small routes -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        ready = self.frontend.ready
        return _json(200 if ready else 503, {"status": "ok" if ready else "unavailable"})

    def _model_card(self) -> dict:
        card = {"id": self.model_names[0], "object": "model", "created": self.created,
                "owned_by": "seqserve"}
        state = self.frontend.state
        if state is not None:
            card["max_model_len"] = state.limits.max_position_embeddings
        return card

    async def models(self, request: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(200, self._model_card())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_names[0]!r}", "model", "model_not_found")

    # --- generation ---------------------------------------------------------------------

    async def _read(self, request: web.Request, schema):
        if not self.frontend.ready:
            raise ApiError(503, "the server is not ready (no worker yet, or shutting down); "
                           "retry")
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                           f"{self.body_timeout:g} s") from None
        req = parse(schema, raw)
        self._check_model(req.model)
        return req

    async def _submit(self, req, prompts, cached_prompt: str, prompt_field: str
                      ) -> tuple[str, list[Sequence]]:
        params = decoding_params(req)
        rid = uuid.uuid4().hex
        try:
            return rid, await self.frontend.submit(
                GenerationRequest(prompts, params, cached_prompt, rid, req.n, req.priority,
                                  req.length_hint, req.eos_after_tokens))
        except Unavailable as exc:
            raise ApiError(503, str(exc)) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), None, "queue_full") from None
        except RequestError as exc:
            raise _request_error(exc, req.max_new_tokens()[1], prompt_field) from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._read(request, CompletionRequest)
        rid, seqs = await self._submit(req, req.prompts(), req.cached_prompt or "", "prompt")
        return await self._answer(request, req, f"cmpl-{rid}", seqs, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._read(request, ChatCompletionRequest)
        messages = []
        for m in req.messages:
            message = {"role": "system" if m.role == "developer" else m.role,
                       "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        try:
            ids = await self.frontend.chat_prompt(messages)
        except Unavailable as exc:
            raise ApiError(503, str(exc)) from None
        except RequestError as exc:
            raise ApiError(400, str(exc), "messages") from None
        rid, seqs = await self._submit(req, [ids], "", "messages")
        return await self._answer(request, req, f"chatcmpl-{rid}", seqs, chat=True)

    async def _merge(self, seqs: list[Sequence]
                     ) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
        """(choice index, event) of every sequence as they come. Closing it early (the
        client went away, an error) closes every sequence's events, cancelling them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(index: int, seq: Sequence) -> None:
            async with contextlib.aclosing(self.frontend.events(seq)) as events:
                async for ev in events:
                    queue.put_nowait((index, ev))

        tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(seqs)]
        try:
            left = len(seqs)
            while left:
                index, ev = await queue.get()
                left -= isinstance(ev, FinishEvent)
                yield index, ev
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(self, request, req, rid: str, seqs: list[Sequence], chat: bool
                      ) -> web.StreamResponse:
        tokenizer = self.frontend.state.tokenizer  # set: submit succeeded
        wants_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        choices = [_Choice(i, chat, tokenizer, wants_logprobs) for i in range(len(seqs))]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_names[0]}
        if req.stream:
            return await self._stream(request, req, head, seqs, choices)
        # Each choice's events once it has ended. The first to end in an error answers at
        # once; cancelled then, or with the handler, each all_events cancels its sequence.
        waits = [asyncio.ensure_future(self.frontend.all_events(seq)) for seq in seqs]
        try:
            for ended in asyncio.as_completed(waits):
                end = (await ended)[-1]
                if end.reason == FinishReason.ERROR:
                    raise ApiError(503, end.error or "generation failed")
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        for choice, wait in zip(choices, waits):
            for ev in wait.result():
                choice.add(ev)
        return _json(200, {**head, "choices": [c.reply() for c in choices],
                           "usage": _usage(choices, req.n)})

    async def _stream(self, request, req, head: dict, seqs, choices: list[_Choice]
                      ) -> web.StreamResponse:
        chat = choices[0].chat
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(body: dict | str) -> None:
            data = body if isinstance(body, str) else json.dumps(body)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(choice: _Choice, text: str | None, logprobs, finish) -> dict:
            part = {"index": choice.index}
            if chat:
                part["delta"] = {} if text is None else {"content": text}
            else:
                part["text"] = text or ""
            part.update(logprobs=logprobs, finish_reason=finish)
            out = {**head, "choices": [part]}
            if include_usage:
                out["usage"] = None
            return out

        try:
            if chat:  # OpenAI's first chunk of each choice carries the role
                for c in choices:
                    first = chunk(c, "", None, None)
                    first["choices"][0]["delta"]["role"] = "assistant"
                    await send(first)
            async with contextlib.aclosing(self._merge(seqs)) as events:
                async for index, ev in events:
                    choice = choices[index]
                    if isinstance(ev, FinishEvent):
                        if ev.reason == FinishReason.ERROR:
                            await send(ApiError(503, ev.error or "generation failed").body())
                            break
                        choice.add(ev)
                        await send(chunk(choice, ev.text or None, None,
                                         _FINISH.get(ev.reason, "stop")))
                        continue
                    # One chunk per token, even when it completes no character yet (as
                    # vLLM does), so clients time first tokens and TPOT by tokens.
                    logprobs = choice.add(ev)
                    await send(chunk(choice, ev.text, logprobs, None))
            if include_usage and all(c.finish is not None for c in choices):
                await send({**head, "choices": [], "usage": _usage(choices, req.n)})
            await send("[DONE]")
            await resp.write_eof()
        except ConnectionError as exc:
            logger.debug("request %s: the client went away (%s)", head["id"], exc)
        return resp


def _request_error(exc: RequestError, limit_field: str, prompt_field: str) -> ApiError:
    """The front end's error, in OpenAI's names: max_new_tokens is `limit_field`, and the
    prompt is `prompt_field`."""
    message = str(exc).replace("max_new_tokens", limit_field)
    first = message.split(" ", 1)[0].rstrip(":,")
    known = {limit_field, "temperature", "top_p", "top_k", "typical_p", "repetition_penalty",
             "seed", "stop", "ignore_eos", "penalty_alpha", "decoding_strategy", "logprobs",
             "n", "cached_prompt", "num_beams", "length_penalty", "early_stopping",
             "priority", "length_hint", "eos_after_tokens"}
    if "plus max_new_tokens" in str(exc):  # prompt and limit together do not fit
        param = limit_field
    elif first in known:
        param = first
    elif first in ("prompt", "inputs", "each") or "prompt" in message:
        param = "stop" if first == "each" else prompt_field
    else:
        param = None
    if message.startswith("inputs"):
        message = prompt_field + message[len("inputs"):]
    return ApiError(400, message, param)
