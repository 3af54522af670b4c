"""The scheduler's seqserve.admin.v1.WorkerAdmin service: register, drain and list the
workers of its pool while it serves (worker_pool.py does the work).

It changes the deployment, so its calls must carry the control-plane token, the secret the
scheduler already shares with its workers (seqserve_common/control_auth.py); the public
API's bearer token does not open it (where option.auth_token is set, a call carries both).
It is served on the public gRPC port: reaching the port is not enough without the token.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc
from seqserve.admin.v1 import admin_pb2, admin_pb2_grpc

from scheduler_service.worker_pool import Member, PoolChangeRefused, State, WorkerPool
from seqserve_common.control_auth import METADATA_KEY

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name
REFUSED = ("the admin API needs the control-plane token: metadata 'x-seqserve-control-token' "
           "with the scheduler's option.control_token (or the content of its "
           "control_token_file); seqserve workers --control-token-file FILE sends it")
_STATES = {State.JOINING: admin_pb2.WorkerStatus.STATE_JOINING,
           State.SERVING: admin_pb2.WorkerStatus.STATE_SERVING,
           State.UNREACHABLE: admin_pb2.WorkerStatus.STATE_UNREACHABLE,
           State.DRAINING: admin_pb2.WorkerStatus.STATE_DRAINING,
           State.LEFT: admin_pb2.WorkerStatus.STATE_LEFT}


def status(m: Member) -> admin_pb2.WorkerStatus:
    loop = m.loop
    return admin_pb2.WorkerStatus(
        address=m.address, state=_STATES[m.state],
        running=len(loop.running) if loop else 0, waiting=len(loop.waiting) if loop else 0,
        kv_capacity_tokens=loop.kv_budget if loop else 0)


class AdminServicer(admin_pb2_grpc.WorkerAdminServicer):
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    async def RegisterWorker(self, request, context):
        try:
            m = await self.pool.register(request.address.strip())
        except PoolChangeRefused as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return admin_pb2.RegisterWorkerResponse(worker=status(m))

    async def DrainWorker(self, request, context):
        try:
            m = self.pool.drain(request.address.strip())
        except PoolChangeRefused as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return admin_pb2.DrainWorkerResponse(worker=status(m))

    async def ListWorkers(self, request, context):
        return admin_pb2.ListWorkersResponse(workers=[status(m) for m in self.pool.members])


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call to one of `services` (WorkerAdmin by default) without the
    control-plane token; every other service of the port passes untouched."""

    def __init__(self, token: str, services: tuple[str, ...] = (SERVICE_NAME,)):
        if not token:
            raise ValueError("empty control-plane token")
        self._token = token.encode()
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
            yield  # an async generator, as a response-streaming handler is

        # The guarded methods take one request; they answer one message or a stream.
        make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(refuse_stream if handler.response_streaming else refuse,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def add_to_server(pool: WorkerPool, server: grpc.aio.Server) -> None:
    admin_pb2_grpc.add_WorkerAdminServicer_to_server(AdminServicer(pool), server)
