"""What the scheduler's HTTP front ends (http_api.py, openai_api.py) share: their limits,
an aiohttp server that starts and stops the same way, and quiet logs for broken clients."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20
# The whole body must arrive within this many seconds of the headers (4 MiB at 140 KB/s);
# a client that trickles it gets 408 and its connection closed, so slow senders cannot
# hold connections and memory open (slowloris).
BODY_TIMEOUT_S = 30.0
# A connection that sends no request (none yet, or none since its last answer) for this
# long is closed. aiohttp's default is an hour.
KEEPALIVE_TIMEOUT_S = 75.0
# On stop, how long running requests may go on before their handlers are cancelled (which
# cancels their sequences). main.py passes half a second, after its own drain.
SHUTDOWN_TIMEOUT_S = 60.0
# After an answer given before the whole body was read (408, 413), the rest is read and
# dropped for at most this long before the connection closes, so the client sees the
# answer rather than a reset. aiohttp's default is 10 s.
LINGERING_TIME_S = 2.0


class _QuietServerErrors(logging.Filter):
    """aiohttp.server logs a malformed request (bad request line, bad header) and a client
    that went away at ERROR with a traceback, so anyone able to connect could fill the log.
    The first become a one-line WARNING, the second a DEBUG line; other errors (a bug in a
    handler) keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            first = str(exc.message).strip().splitlines()[0][:120] if exc.message else ""
            record.args = (record.getMessage(), exc.code, first)
            record.msg = "%s: bad HTTP request (%d %s)"
        elif isinstance(exc, (ConnectionError, asyncio.CancelledError)):
            logger.debug("%s: the client went away (%r)", record.getMessage(), exc)
            return False
        else:
            return True
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def quiet_aiohttp_server_logs() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _QuietServerErrors) for f in server_log.filters):
        server_log.addFilter(_QuietServerErrors())


class AppServer:
    """Serves an aiohttp application on one port with the limits above."""

    def __init__(self, app: web.Application, *, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S):
        self.app = app
        self.shutdown_timeout, self.keepalive_timeout = shutdown_timeout, keepalive_timeout
        self.runner: web.AppRunner | None = None
        quiet_aiohttp_server_logs()

    async def start(self, host: str, port: int, ssl_context=None, reuse_port: bool = False
                    ) -> int:
        """Listen (HTTPS when `ssl_context` is given); returns the bound port. `reuse_port`:
        share it with sibling processes (SO_REUSEPORT; the kernel spreads connections)."""
        # handler_cancellation: a client that disconnects cancels its handler, which closes
        # the events of its sequences and so cancels them, instead of generating to
        # max_new_tokens for nobody.
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True,
                                    keepalive_timeout=self.keepalive_timeout,
                                    lingering_time=LINGERING_TIME_S,
                                    shutdown_timeout=self.shutdown_timeout)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context,
                           reuse_port=reuse_port or None)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
