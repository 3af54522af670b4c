"""The worker's direct Steps link: the servicer's Steps stream on a plain TCP connection
(framing and the reason for it: seqserve_common/steps_link.py).

A connection must first send a StepsLinkHello with the control-plane token, as every gRPC
call carries it; then it is one Steps stream, run by `WorkerServicer.run_steps` like the
gRPC call's. Blocking sockets and a thread per connection: there is one scheduler per
worker, and the compute thread, not this, is what Steps wait for.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Iterator

from seqserve.worker.v1 import worker_pb2

from seqserve_common.control_auth import REFUSED
from seqserve_common.steps_link import (HELLO_TIMEOUT_S, MAX_HELLO_BYTES, FrameError, frame,
                                        read_frame)
from worker_service.engine import StepError
from worker_service.servicer import WorkerServicer

logger = logging.getLogger(__name__)
# Seconds a connection stays open after the worker's last frame for the peer to close it.
LINGER_S = 2.0


class StepsLinkServer:
    """Listens on `host:port` (0: any free port) and serves each connection's Steps."""

    def __init__(self, servicer: WorkerServicer, token: str, host: str, port: int):
        self._servicer = servicer
        self._token = token.encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=16)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._ended = threading.Condition()  # guards _connections; notified as one ends
        self._stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._accept, name="steps-link", daemon=True).start()

    def stop(self, grace: float) -> None:
        """Take no new connection; give open ones `grace` seconds to end (the scheduler
        closes its stream once its Steps are answered), then cut them."""
        self._stopping.set()
        _shut(self._listener)  # wakes the accept (closing alone does not, on Linux)
        self._listener.close()
        deadline = time.monotonic() + grace
        with self._ended:
            while self._connections and (left := deadline - time.monotonic()) > 0:
                self._ended.wait(left)
            remaining = list(self._connections)
        for conn in remaining:
            _shut(conn)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed by stop()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._ended:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="steps-link-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            if self._authenticated(conn, peer):
                self._run(conn)
            else:
                _linger(conn, lambda: _read_to_end(conn))
        except OSError as exc:
            logger.debug("steps link from %s ended: %s", peer, exc)
        finally:
            with self._ended:
                self._connections.discard(conn)
                self._ended.notify_all()
            conn.close()

    def _authenticated(self, conn: socket.socket, peer) -> bool:
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            payload = read_frame(conn, MAX_HELLO_BYTES)
            hello = worker_pb2.StepsLinkHello.FromString(payload) if payload else None
        except (FrameError, ConnectionError, TimeoutError, ValueError) as exc:
            logger.warning("steps link from %s: no valid hello (%s); closed", peer, exc)
            return False
        if hello is None:
            return False  # a reachability probe: connected and closed
        conn.settimeout(None)
        if not hmac.compare_digest(hello.control_token.encode(), self._token):
            logger.warning("steps link from %s refused: wrong control-plane token", peer)
            _send_error(conn, "UNAUTHENTICATED", REFUSED)
            return False
        return True

    def _run(self, conn: socket.socket) -> None:
        requests = _Requests(conn)
        try:
            for response in self._servicer.run_steps(requests):
                conn.sendall(frame(worker_pb2.StepsLinkFrame(
                    response=response).SerializeToString()))
            return  # the scheduler closed the stream
        except StepError as exc:
            _send_error(conn, "FAILED_PRECONDITION", str(exc))
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - the scheduler must learn why its stream ended
            logger.exception("steps link: a Step failed")
            _send_error(conn, "INTERNAL", f"{type(exc).__name__}: {exc}")
        # The stream's reader thread still reads the Steps sent after the failed one (the
        # servicer drops them) until the scheduler, having read our error, closes.
        _linger(conn, lambda: requests.ended.wait(LINGER_S))


class _Requests:
    """The StepRequests a connection sends, until it closes (or sends a bad frame: then
    the stream ends like a broken gRPC call); `ended` is set once no more will come."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self.ended = threading.Event()

    def __iter__(self) -> Iterator[worker_pb2.StepRequest]:
        try:
            while (payload := read_frame(self._conn)) is not None:
                yield worker_pb2.StepRequest.FromString(payload)
        finally:
            self.ended.set()


def _send_error(conn: socket.socket, code: str, details: str) -> None:
    try:
        conn.sendall(frame(worker_pb2.StepsLinkFrame(
            error=worker_pb2.StepsLinkError(code=code, details=details)).SerializeToString()))
    except OSError:
        pass  # the scheduler is gone already


def _linger(conn: socket.socket, until_peer_closed) -> None:
    """End our side after our last frame and wait (at most LINGER_S) for the peer to close
    its own: closing with the peer's frames still unread would reset the connection, and a
    reset can discard our last frame before the peer reads it."""
    try:
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        return
    until_peer_closed()


def _read_to_end(conn: socket.socket) -> None:
    """Read and drop what the peer sends until it closes (no other thread reads `conn`)."""
    conn.settimeout(LINGER_S)
    try:
        while conn.recv(1 << 16):
            pass
    except OSError:
        pass


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
