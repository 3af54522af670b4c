"""DJL-compatible HTTP front: `POST /invocations` and `GET /ping` on the scheduler.

    curl -X POST http://127.0.0.1:8080/invocations -H "Content-type: application/json" \
      -d '{"inputs": "Hello", "parameters": {"max_new_tokens": 50}, "cached_prompt": "..."}'

answers `{"generated_text": ...}`; with `"stream": true` it answers JSON lines, one per
token (`{"token": {"id", "text", "log_prob"}}`), then one with `text` (what the end released),
`generated_text` and
`details` (with beam search also `details.sequences`: the returned hypotheses, best first).
Requests go through the same validation and queue as the gRPC API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import web

from scheduler_service.admission import QueueFull
from scheduler_service.frontend import Frontend, GenerationRequest, Unavailable
from scheduler_service.http_server import (
    BODY_TIMEOUT_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_BODY_BYTES,
    SHUTDOWN_TIMEOUT_S,
    AppServer,
)
from scheduler_service.params import TOKEN_COUNTS, RequestError, check_token_count
from scheduler_service.sequence import FinishEvent, FinishReason, Sequence, TokenEvent

logger = logging.getLogger(__name__)
_TOP_LEVEL = {"inputs", "parameters", "cached_prompt", "stream", "request_id", "priority"}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "code": status}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (413 body too large, 404, 405, ...) in the JSON shape every
    other error has: `{"error": ..., "code": ...}`."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            message = (f"the request body exceeds the limit of {MAX_BODY_BYTES} bytes; "
                       "send a smaller request")
        elif exc.text and not exc.text.startswith(f"{exc.status}:"):
            message = exc.text
        else:
            message = f"{exc.reason} ({request.method} {request.path})"
        resp = _error(exc.status, message)
        for name in ("Allow", "WWW-Authenticate"):
            if name in exc.headers:
                resp.headers[name] = exc.headers[name]
        return resp


def _details(ev: FinishEvent) -> dict:
    details = {"finish_reason": ev.reason.value, "generated_tokens": ev.generated_tokens,
               "inputs": ev.prompt_tokens, "cached_tokens": ev.cached_tokens}
    if ev.sequences is not None:
        # Beam search: the num_return_sequences best hypotheses, best first.
        details["sequences"] = [
            {"generated_text": h.text, "token_ids": h.token_ids, "score": h.score,
             "finish_reason": h.reason.value} for h in ev.sequences]
    return details


class InvocationsApp:
    """The HTTP routes. `shutdown_timeout`: how long `stop` lets running requests finish
    before cancelling them (main.py gives option.drain_timeout); `body_timeout`: seconds
    for a request body to arrive; `keepalive_timeout`: seconds an idle connection stays."""

    def __init__(self, frontend: Frontend, *, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
                 body_timeout: float = BODY_TIMEOUT_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S):
        self.frontend = frontend
        self.shutdown_timeout = shutdown_timeout
        self.body_timeout = body_timeout
        self.keepalive_timeout = keepalive_timeout
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
        self.app.router.add_post("/invocations", self.invocations)
        self.app.router.add_get("/ping", self.ping)
        self.server = AppServer(self.app, shutdown_timeout=shutdown_timeout,
                                keepalive_timeout=keepalive_timeout)

    async def ping(self, request: web.Request) -> web.Response:
        ready = self.frontend.ready
        return web.json_response({"status": "Healthy" if ready else "Unhealthy"},
                                 status=200 if ready else 503)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        if not self.frontend.ready:
            return _error(503, "the server is not ready (no worker yet, or shutting down)")
        try:
            await asyncio.wait_for(request.read(), self.body_timeout)  # request.json() reuses it
        except asyncio.TimeoutError:
            resp = _error(408, f"the request body did not arrive within {self.body_timeout:g} s")
            resp.force_close()
            return resp
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError):
            # RecursionError: json nests by recursion, so a deeply nested body raises it.
            return _error(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object with an \"inputs\" field")
        unknown = sorted(set(body) - _TOP_LEVEL)
        if unknown:
            return _error(400, f"unknown field {unknown[0]!r}; known: {', '.join(sorted(_TOP_LEVEL))}")
        # `is None` rather than `or`: a wrong-typed falsy value ("parameters": 0, [], false;
        # "cached_prompt": 0) must get a 400, not be taken as absent.
        inputs, params = body.get("inputs"), body.get("parameters")
        params = {} if params is None else params
        cached = body.get("cached_prompt")
        cached = "" if cached is None else cached
        stream = body.get("stream", False)
        if not isinstance(params, dict):
            return _error(400, "parameters must be a JSON object")
        if not isinstance(cached, str) or not isinstance(stream, bool):
            return _error(400, "cached_prompt must be a string and stream true or false")
        batch = inputs if isinstance(inputs, list) else [inputs]
        if not batch or not all(isinstance(x, str) for x in batch):
            return _error(400, "inputs must be a string or a non-empty list of strings")
        if stream and len(batch) > 1:
            return _error(400, "stream supports a single string in inputs")
        rid = body.get("request_id")
        rid = "" if rid is None else rid
        if not isinstance(rid, str):
            return _error(400, f"request_id must be a string, got {type(rid).__name__}")
        try:
            priority = body.get("priority")
            counts = {k: check_token_count(k, params.get(k)) for k in TOKEN_COUNTS}
            params = {k: v for k, v in params.items() if k not in TOKEN_COUNTS}
            seqs = await self.frontend.submit(GenerationRequest(
                batch, params, cached, rid, priority=0 if priority is None else priority,
                **counts))
        except Unavailable as exc:
            return _error(503, str(exc))
        except RequestError as exc:
            return _error(400, str(exc))
        except QueueFull as exc:
            return _error(429, str(exc))
        if stream:
            return await self._stream(request, seqs[0])
        results = await asyncio.gather(*(self._collect(s) for s in seqs))
        for r in results:
            if isinstance(r, web.Response):
                return r
        if isinstance(inputs, list):
            return web.json_response([{"generated_text": t, "details": d} for t, d in results])
        text, details = results[0]
        return web.json_response({"generated_text": text, "details": details})

    async def _collect(self, seq: Sequence):
        # Cancelled (the client went away), all_events cancels the sequence.
        *tokens, end = await self.frontend.all_events(seq)
        if end.reason == FinishReason.ERROR:
            return _error(503, end.error or "generation failed")
        return "".join([e.text for e in tokens] + [end.text]), _details(end)

    async def _stream(self, request, seq: Sequence) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/jsonlines"})
        await resp.prepare(request)
        parts = []
        try:
            # aclosing: a write to a client that went away ends the loop, and the events
            # generator is closed at once, which cancels the sequence.
            async with contextlib.aclosing(self.frontend.events(seq)) as events:
                async for ev in events:
                    parts.append(ev.text)
                    if isinstance(ev, TokenEvent):
                        line = {"token": {"id": ev.token_id, "text": ev.text,
                                          "log_prob": ev.logprob}}
                    else:
                        # `text`: what the end released (held-back stop prefix, an
                        # incomplete last character), so the token texts plus it make
                        # generated_text.
                        line = {"text": ev.text, "generated_text": "".join(parts),
                                "details": _details(ev)}
                        if ev.reason == FinishReason.ERROR:
                            line = {"error": ev.error, "code": 503}
                    await resp.write((json.dumps(line) + "\n").encode())
            await resp.write_eof()
        except ConnectionError as exc:
            logger.debug("request %s: the client went away (%s)", seq.request_id, exc)
        return resp
