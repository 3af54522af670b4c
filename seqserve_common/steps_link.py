"""Framing of the direct Steps link (worker.proto, StepsLinkHello and StepsLinkFrame): each
frame is a 4-byte big-endian length, then that many bytes of one protobuf message.

Why a second transport for the Steps: the scheduler's per-Step cost at one worker is
mostly gRPC's own (docs/benchmarks.md, "Why 1 worker stays near 5%"): every finished
operation crosses gRPC's poller thread and the event loop's wake-up pipe, about twice the
CPU of a plain socket's round trip. The link carries the same messages, so the protos stay
the contract; gRPC keeps everything else (Info, Reset, health, TLS).
"""

from __future__ import annotations

import asyncio
import socket
import struct

from seqserve_common.control_channel import MAX_MESSAGE_BYTES

HEADER = struct.Struct(">I")
# Before the token is checked a peer may send only this much: a hello holds one token.
MAX_HELLO_BYTES = 4096
# Seconds a new connection has to send its hello before the worker closes it.
HELLO_TIMEOUT_S = 5.0


class FrameError(ValueError):
    """A frame longer than its limit: the peer does not speak this protocol."""


def frame(payload: bytes) -> bytes:
    """One frame holding `payload` (a serialized message)."""
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes, limit: int = MAX_MESSAGE_BYTES) -> int:
    (n,) = HEADER.unpack(header)
    if n > limit:
        raise FrameError(f"a {n}-byte frame where at most {limit} bytes are accepted")
    return n


def read_frame(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> bytes | None:
    """The next frame's payload from a blocking socket; None when the peer closed the
    connection between frames. Raises ConnectionError for a close inside a frame."""
    header = _read_exactly(sock, HEADER.size, at_start=True)
    if header is None:
        return None
    return _read_exactly(sock, frame_length(header, limit), at_start=False) or b""


async def read_frame_async(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES
                           ) -> bytes:
    """The next frame's payload from an asyncio stream; raises IncompleteReadError when the
    peer closes first."""
    return await reader.readexactly(frame_length(await reader.readexactly(HEADER.size), limit))


def _read_exactly(sock: socket.socket, n: int, at_start: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if at_start and not buf:
                return None
            raise ConnectionError(f"the connection closed {len(buf)} bytes into a "
                                  f"{n}-byte read")
        buf += chunk
    return bytes(buf)


def link_host(address: str) -> str | None:
    """The host part of a gRPC target `host:port` ([v6]:port too), where the worker's link
    listens beside its gRPC port; None for targets that name no TCP host (unix:, dns:///)."""
    if "/" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
