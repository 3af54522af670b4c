"""The control plane's shared secret: every Info, Steps and Reset call from a scheduler to
its workers carries it, and a worker refuses a call without it (docs/security.md).

On one machine nobody has to handle it: the first process to start writes a random token
to `~/.cache/seqserve/control-token` (or option.control_token_file), readable by its owner
only, and the other reads it there. Across machines, or containers without a shared
volume, give both sides the same `OPTION_CONTROL_TOKEN`; mutual TLS (worker_tls_*) then
also authenticates the channel itself.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
import time
from pathlib import Path

import grpc

from seqserve_common.config import ConfigError, ServingConfig

logger = logging.getLogger(__name__)
METADATA_KEY = "x-seqserve-control-token"
DEFAULT_FILE = Path("~/.cache/seqserve/control-token")
# Health checks and reflection stay open: probes carry no secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REFUSED = ("missing or wrong control-plane token: only the scheduler that shares this "
           "worker's option.control_token (or control_token_file) may call it")


def control_token(cfg: ServingConfig) -> str:
    """The secret: option.control_token, else the token file's, created if absent."""
    if cfg.control_token:
        return cfg.control_token
    path = Path(cfg.control_token_file or DEFAULT_FILE).expanduser()
    key = "option.control_token_file"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            _create(path)
        return _read(path, key)
    except OSError as exc:
        raise ConfigError(f"{key}={str(path)!r}: cannot use it ({exc.strerror}); point it at a "
                          "writable file or set OPTION_CONTROL_TOKEN") from None


def _create(path: Path) -> None:
    """Write a new token atomically: a reader never sees a half-written file, and of two
    processes starting together one token wins (link fails if the file exists)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_urlsafe(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        logger.info("control-plane token created in %s", path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def _read(path: Path, key: str) -> str:
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{key}={str(path)!r} must belong to this user and be readable by "
                          f"it alone (chmod 600 {path}): another user could drive the workers")
    for _ in range(50):  # a file made by hand may still be being written
        token = path.read_text().strip()
        if token:
            return token
        time.sleep(0.1)
    raise ConfigError(f"{key}={str(path)!r} is empty; delete it to get a new token")


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, token),)


class ControlTokenInterceptor(grpc.ServerInterceptor):
    """Worker side: every call but health and reflection must carry the token; others get
    UNAUTHENTICATED and learn nothing else."""

    def __init__(self, token: str):
        self._token = token.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        def refuse_stream(request_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse_stream),
        }

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return handler
        return self._refusals[(handler.request_streaming, handler.response_streaming)]
