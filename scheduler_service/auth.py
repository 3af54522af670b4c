"""Security of the deployment (docs/security.md): TLS material, bearer tokens.

- `public_tls(cfg)` / `worker_tls(cfg)` read and check the PEM files named by the
  `tls_*` and `worker_tls_*` options; a half-configured pair or a missing/unreadable file
  raises ConfigError naming the keys and the path, so start-up stops with a clear message.
- `BearerTokenInterceptor` makes every public gRPC call except the health service and
  reflection carry `authorization: Bearer <token>` metadata (UNAUTHENTICATED otherwise).
- `bearer_middleware` does the same for the HTTP front (all paths but /ping).
"""

from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from scheduler_service.config import ConfigError, ServingConfig

AUTH_METADATA_KEY = "authorization"
# Always open, token or not: liveness/readiness probes and `grpcurl list`.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_HTTP_PATHS = frozenset({"/ping"})


@dataclass(frozen=True)
class TlsFiles:
    """PEM contents of one process's TLS identity and, optionally, the CA it trusts."""

    cert_chain: bytes
    private_key: bytes
    ca: bytes | None = None
    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side of mutual TLS: trust `ca`, present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca,
                                            private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def server_ssl_context(self) -> ssl.SSLContext:
        """For the HTTP front: the same certificate; client certificates when `ca` is set."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_path, self.key_path)
        if self.ca is not None:
            ctx.load_verify_locations(cadata=self.ca.decode("ascii", "replace"))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def _read_pem(key: str, path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"option.{key}={path!r}: no such file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"option.{key}={path!r}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"option.{key}={path!r}: not a PEM file (no -----BEGIN line)")
    return data


def _load(cert_key: str, key_key: str, ca_key: str, cert: str, key: str, ca: str,
          ca_required: bool) -> TlsFiles | None:
    if bool(cert) != bool(key):
        have, missing = (cert_key, key_key) if cert else (key_key, cert_key)
        raise ConfigError(f"option.{have} is set but option.{missing} is not: set both "
                          f"option.{cert_key} (PEM certificate chain) and option.{key_key} "
                          f"(PEM private key), or neither")
    if not cert:
        if ca:
            raise ConfigError(f"option.{ca_key} is set but option.{cert_key} and "
                              f"option.{key_key} are not: set them too, or unset option.{ca_key}")
        return None
    if ca_required and not ca:
        raise ConfigError(f"option.{cert_key} and option.{key_key} are set but option.{ca_key} "
                          f"is not: mutual TLS needs the CA that signs the other side's "
                          f"certificate")
    files = TlsFiles(_read_pem(cert_key, cert), _read_pem(key_key, key),
                     _read_pem(ca_key, ca) if ca else None, cert, key, ca)
    # Parse them now (the ssl module reads the same PEM as gRPC) so a bad file or a key that
    # does not match the certificate stops start-up instead of failing every handshake.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def encrypted() -> bytes:  # instead of OpenSSL prompting on the terminal
        raise ConfigError(f"option.{key_key}={key!r} is an encrypted private key; gRPC needs "
                          f"it unencrypted (openssl pkey -in KEY -out PLAIN_KEY)")

    try:
        ctx.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as exc:
        raise ConfigError(f"option.{cert_key}={cert!r} and option.{key_key}={key!r} do not "
                          f"make a usable certificate and key ({exc.reason or exc}); is the "
                          f"key encrypted, or not the certificate's?") from None
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"option.{ca_key}={ca!r} is not a usable CA certificate "
                              f"({exc.reason or exc})") from None
    return files


def public_tls(cfg: ServingConfig) -> TlsFiles | None:
    """TLS of the scheduler's public ports (gRPC and HTTP); None: plaintext."""
    return _load("tls_cert_file", "tls_key_file", "tls_client_ca_file", cfg.tls_cert_file,
                 cfg.tls_key_file, cfg.tls_client_ca_file, ca_required=False)


def worker_tls(cfg: ServingConfig) -> TlsFiles | None:
    """Mutual TLS between scheduler and workers; None: plaintext (loopback only)."""
    return _load("worker_tls_cert_file", "worker_tls_key_file", "worker_tls_ca_file",
                 cfg.worker_tls_cert_file, cfg.worker_tls_key_file, cfg.worker_tls_ca_file,
                 ca_required=True)


# --- bearer token -------------------------------------------------------------------------

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
