"""The scheduler's connection to one worker (seqserve.worker.v1 over gRPC)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class WorkerUnavailable(RuntimeError):
    """No worker answered within the configured time."""


class StepFailed(RuntimeError):
    """A Step (or the stream carrying it) failed; `code` is the gRPC status name."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class StepStream:
    """One `Steps` call: Steps go out in order and their answers come back in that order,
    so several may be in flight. Every failure surfaces as StepFailed."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self._call = stub.Steps()

    async def send(self, request: worker_pb2.StepRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # A write that meets a call the worker already ended fails as INTERNAL; the
            # call's own status says why it ended.
            raise await self._ended() from None

    async def receive(self) -> worker_pb2.StepResponse:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise StepFailed(exc.code().name, exc.details() or "") from None
        if response is grpc.aio.EOF:
            raise await self._ended()
        return response

    async def _ended(self) -> StepFailed:
        code = await self._call.code()
        return StepFailed(code.name, await self._call.details() or "the worker ended the stream")

    def close(self) -> None:
        self._call.cancel()


class WorkerClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None):
        """`credentials`: grpc.ssl_channel_credentials for mutual TLS (seqserve_common.tls.TlsFiles
        .channel_credentials()); None: a plaintext channel."""
        self.address = address
        options = [
            *GRPC_MESSAGE_OPTIONS,
            # Reconnect quickly to a restarted worker instead of gRPC's backoff of minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.info: worker_pb2.InfoResponse | None = None

    def open_steps(self) -> StepStream:
        return StepStream(self.stub)

    async def reset(self) -> None:
        await self.stub.Reset(worker_pb2.ResetRequest(), timeout=30)

    async def wait_ready(self, timeout: float | None) -> worker_pb2.InfoResponse:
        """Poll Info until the worker has its model loaded; then drop its old sequences."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_log = 0.0
        while True:
            try:
                info = await self.stub.Info(worker_pb2.InfoRequest(), timeout=2)
                await self.reset()
                self.info = info
                logger.info("worker %s ready: %s (%s, %s)", self.address,
                            info.model_id, info.dtype, info.device)
                return info
            except grpc.aio.AioRpcError as exc:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise WorkerUnavailable(
                        f"worker {self.address} did not answer within {timeout:g} s "
                        f"({exc.code().name}: {exc.details()})") from None
                if now - last_log > 10:
                    logger.info("waiting for worker %s (%s: %s)", self.address,
                                exc.code().name, exc.details())
                    last_log = now
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.channel.close()
