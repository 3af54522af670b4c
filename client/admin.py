"""A blocking client for the scheduler's admin API (seqserve.admin.v1.WorkerAdmin):
register, drain and list its workers.

    from client.admin import AdminClient, read_control_token
    with AdminClient("127.0.0.1:8000", read_control_token()) as admin:
        admin.register("10.0.0.7:8100")
        admin.drain("10.0.0.5:8100", wait=True)

Every call carries the control-plane token (docs/security.md), not the public bearer token
(also sent when `token` is given, for servers that require it on every call).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from client.api import auth_metadata, channel_credentials
from seqserve.admin.v1 import admin_pb2, admin_pb2_grpc

CONTROL_METADATA_KEY = "x-seqserve-control-token"
DEFAULT_TOKEN_FILE = "~/.cache/seqserve/control-token"


def read_control_token(path: str | None = None) -> str:
    """$SEQSERVE_CONTROL_TOKEN, else the token file (default: the one a scheduler on this
    machine writes)."""
    token = os.environ.get("SEQSERVE_CONTROL_TOKEN")
    if token and path is None:
        return token
    file = Path(path or DEFAULT_TOKEN_FILE).expanduser()
    try:
        return file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the control-plane token from {file} ({exc.strerror}); "
                         "set SEQSERVE_CONTROL_TOKEN or --control-token-file") from None


@dataclass(frozen=True)
class WorkerState:
    """One worker of the scheduler's pool."""

    address: str
    state: str  # joining, serving, unreachable, draining, left
    running: int
    waiting: int
    kv_capacity_tokens: int

    @classmethod
    def from_proto(cls, w: admin_pb2.WorkerStatus) -> WorkerState:
        name = admin_pb2.WorkerStatus.State.Name(w.state).removeprefix("STATE_").lower()
        return cls(w.address, name, w.running, w.waiting, w.kv_capacity_tokens)


class AdminClient:
    def __init__(self, address: str, control_token: str, *, timeout: float = 30.0,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, token: str | None = None):
        creds = channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.channel = (grpc.insecure_channel(address) if creds is None
                        else grpc.secure_channel(address, creds))
        self.stub = admin_pb2_grpc.WorkerAdminStub(self.channel)
        self.timeout = timeout
        self.metadata = ((CONTROL_METADATA_KEY, control_token), *(auth_metadata(token) or ()))

    def _call(self, method, request):
        return method(request, timeout=self.timeout, metadata=self.metadata)

    def list(self) -> list[WorkerState]:
        reply = self._call(self.stub.ListWorkers, admin_pb2.ListWorkersRequest())
        return [WorkerState.from_proto(w) for w in reply.workers]

    def register(self, address: str) -> WorkerState:
        reply = self._call(self.stub.RegisterWorker,
                           admin_pb2.RegisterWorkerRequest(address=address))
        return WorkerState.from_proto(reply.worker)

    def drain(self, address: str, wait: bool = False, poll: float = 0.2,
              wait_timeout: float = 3600.0) -> WorkerState:
        """Start draining `address`; with `wait`, return once it has left the pool."""
        reply = self._call(self.stub.DrainWorker, admin_pb2.DrainWorkerRequest(address=address))
        state = WorkerState.from_proto(reply.worker)
        deadline = time.monotonic() + wait_timeout
        while wait and state.state != "left":
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} still drains after {wait_timeout:g} s")
            time.sleep(poll)
            now = next((w for w in self.list() if w.address == address), None)
            state = now or WorkerState(address, "left", 0, 0, state.kv_capacity_tokens)
        return state

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
