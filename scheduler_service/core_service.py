"""The scheduler core's side of a split deployment (option.frontend_processes >= 1): the
seqserve.core.v1.Core service its front-end processes call.

Each front end opens one Outputs stream; its FrontendLink is the sink (output.OutputSink)
of the sequences it submits, so the loop hands their tokens to a batch instead of making
text and events. A batch goes out once per turn of the event loop, which is once per
Step answer: the core's cost per Step is one message per front end, whatever the number
of client streams. EOS and length limits end a sequence here; stop strings are matched
on text in the front end, which cancels the sequence with `stopped`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from prometheus_client import generate_latest
from seqserve.core.v1 import core_pb2, core_pb2_grpc

from scheduler_service import admin_api
from scheduler_service.admission import QueueFull
from scheduler_service.core_wire import OutputBatch, decode_sequence
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.output import accept_beams, accept_token
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import StepToken
from scheduler_service.worker_pool import WorkerPool
from seqserve_common import health as health_names
from seqserve_common.config import ServingConfig
from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS

logger = logging.getLogger(__name__)
SERVICE_NAME = core_pb2.DESCRIPTOR.services_by_name["Core"].full_name


class FrontendLink:
    """One front end's Outputs stream and the sequences it submitted."""

    def __init__(self, name: str, pool: WorkerPool):
        self.name = name
        self.pool = pool
        self.seqs: dict[int, Sequence] = {}
        self.events: asyncio.Queue[core_pb2.CoreEvent] = asyncio.Queue()
        self._batch = OutputBatch()
        self._flush_due = False
        self._beams: dict[int, tuple] = {}

    def token(self, seq: Sequence, tok: StepToken, eos_ids: frozenset[int]
              ) -> FinishReason | None:
        if tok.beams:
            self._beams[seq.seq_id] = tok.beams  # sent with its ending, which follows now
            return accept_beams(seq, tok, eos_ids)
        self._batch.add_token(tok)
        self._schedule()
        return accept_token(seq, tok.token_id, eos_ids)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None) -> FinishReason:
        self.seqs.pop(seq.seq_id, None)
        self._batch.add_finish(seq, reason, error, self._beams.pop(seq.seq_id, ()))
        self._schedule()
        return reason

    def forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)
        self._beams.pop(seq.seq_id, None)

    def _schedule(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._batch:
            self.events.put_nowait(self._batch.message(self.pool.waiting()))
            self._batch = OutputBatch()


class CoreServicer(core_pb2_grpc.CoreServicer):
    def __init__(self, pool: WorkerPool, metrics: SchedulerMetrics, frontends: int):
        self.pool = pool
        self.metrics = metrics
        self.frontends = frontends  # how many connect: ready once all have
        self.links: dict[str, FrontendLink] = {}
        self.draining = False

    def state(self) -> core_pb2.CoreState:
        # Every front end or none: clients reach them through one port, so a ready one
        # beside one still connecting would pass health checks and refuse requests.
        ready = self.pool.ready and not self.draining and len(self.links) == self.frontends
        return core_pb2.CoreState(ready=ready,
                                  kv_budget_tokens=self.pool.kv_budget)

    def broadcast_state(self) -> None:
        """Tell every front end the core's readiness or budget changed."""
        event = core_pb2.CoreEvent(state=self.state())
        for link in self.links.values():
            link.events.put_nowait(event)

    async def Info(self, request, context):
        loops = self.pool.loops
        if not loops:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "no worker has connected to the scheduler core yet; retry")
        return core_pb2.InfoResponse(worker=loops[0].info.to_proto(), state=self.state())

    async def Outputs(self, request, context):
        name = request.frontend
        if not name or name in self.links:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS if name else
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"front end name {name!r} is empty or already connected")
        link = self.links[name] = FrontendLink(name, self.pool)
        logger.info("front end %s connected", name)
        self.broadcast_state()  # this one's first message, and maybe the others' readiness
        try:
            while True:
                yield await link.events.get()
        finally:
            del self.links[name]
            self.broadcast_state()
            for seq in list(link.seqs.values()):
                self.pool.cancel(seq)
            logger.warning("front end %s disconnected; cancelled its %d sequences", name,
                           len(link.seqs))

    async def Submit(self, request, context):
        link = self.links.get(request.frontend)
        if link is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"front end {request.frontend!r} has no Outputs stream open; "
                                "open it before submitting")
        if self.draining or not self.pool.loops:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the scheduler is shutting down and admits no new requests"
                                if self.draining else "no worker connected yet; retry")
        seqs = [decode_sequence(msg) for msg in request.sequences]
        for seq in seqs:
            seq.sink = link
        try:
            await self.pool.submit_all(seqs)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        for seq in seqs:
            link.seqs[seq.seq_id] = seq
        self.metrics.frontend_requests.labels(link.name).inc(len(seqs))
        return core_pb2.SubmitResponse()

    async def Cancel(self, request, context):
        reason = FinishReason.STOP if request.stopped else FinishReason.CANCELLED
        for sid in request.sequence_ids:
            for link in self.links.values():
                seq = link.seqs.get(sid)
                if seq is not None:
                    link.forget(seq)
                    self.pool.cancel(seq, reason)
                    break
        return core_pb2.CancelResponse()

    async def CountRefusal(self, request, context):
        if request.code not in grpc.StatusCode.__members__:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{request.code!r} is not a gRPC status code name")
        self.metrics.requests_failed.labels(request.code).inc()
        return core_pb2.RefusalResponse()

    async def Metrics(self, request, context):
        return core_pb2.MetricsResponse(text=generate_latest(self.metrics.registry))


def add_to_server(servicer: CoreServicer, server: grpc.aio.Server) -> None:
    core_pb2_grpc.add_CoreServicer_to_server(servicer, server)


@dataclass
class CoreServer:
    """The core's own gRPC port: Core for its front ends, WorkerAdmin, health."""

    server: grpc.aio.Server
    health: health_names.AioHealth
    ports: dict[str, int]  # core

    async def set_ready(self, ready: bool) -> None:
        await self.health.set_ready(ready)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)


async def start_core(cfg: ServingConfig, core: CoreServicer, pool: WorkerPool,
                     control_token: str) -> CoreServer:
    """Listen on the loopback (the front ends run on this host) at cfg.core_port; every
    Core and WorkerAdmin call needs the control-plane token."""
    server = grpc.aio.server(
        interceptors=[admin_api.AdminTokenInterceptor(
            control_token, services=(SERVICE_NAME, admin_api.SERVICE_NAME))],
        options=list(GRPC_MESSAGE_OPTIONS))
    add_to_server(core, server)
    admin_api.add_to_server(pool, server)
    health = health_names.AioHealth(server, SERVICE_NAME, (admin_api.SERVICE_NAME,))
    await health.start()
    port = server.add_insecure_port(f"127.0.0.1:{cfg.core_port}")
    await server.start()
    return CoreServer(server, health, {"core": port})
