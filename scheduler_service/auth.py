"""Bearer tokens on the scheduler's public API (docs/security.md).

- `BearerTokenInterceptor` makes every public gRPC call except the health service and
  reflection carry `authorization: Bearer <token>` metadata (UNAUTHENTICATED otherwise).
- `bearer_middleware` does the same for the HTTP front (all paths but /ping).
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

AUTH_METADATA_KEY = "authorization"
# Always open, token or not: liveness/readiness probes and `grpcurl list`.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_HTTP_PATHS = frozenset({"/ping"})


MISSING = ("missing credentials: this server requires the metadata "
           "'authorization: Bearer <token>' (Client(..., token=...), or seqserve --token / "
           "$SEQSERVE_TOKEN)")
MALFORMED = "malformed credentials: the authorization metadata must be 'Bearer <token>'"
INVALID = "invalid bearer token"


def check_authorization(value: str | None, token: bytes) -> str | None:
    """None when `value` (an authorization header) carries `token`; else why not."""
    if not value:
        return MISSING
    scheme, _, given = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return MALFORMED
    if not hmac.compare_digest(given.strip().encode("utf-8"), token):
        return INVALID
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("empty token")
        self._token = token.encode("utf-8")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        value = None
        for key, val in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                value = val.decode("utf-8", "replace") if isinstance(val, bytes) else val
                break
        problem = check_authorization(value, self._token)
        return handler if problem is None else _denying_handler(handler, problem)


def bearer_middleware(token: str):
    """aiohttp middleware: 401 with a JSON error unless `Authorization: Bearer <token>`."""
    from aiohttp import web

    expected = token.encode("utf-8")

    @web.middleware
    async def middleware(request, handler):
        if request.path not in OPEN_HTTP_PATHS:
            problem = check_authorization(request.headers.get("Authorization"), expected)
            if problem is not None:
                if problem == MISSING:
                    problem = ("missing credentials: this server requires the header "
                               "'Authorization: Bearer <token>'")
                elif problem == MALFORMED:
                    problem = ("malformed credentials: the Authorization header must be "
                               "'Bearer <token>'")
                return web.json_response({"error": problem, "code": 401}, status=401,
                                         headers={"WWW-Authenticate": 'Bearer realm="seqserve"'})
        return await handler(request)

    return middleware
