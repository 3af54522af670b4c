"""gRPC health and reflection as both processes serve them.

Health answers four names: `liveness` is SERVING while the process runs (restart it when
not); `readiness`, the empty name and the process's own service follow whether it can do
its work now (send it traffic or not). Kubernetes' gRPC probes take these names.
Reflection answers both v1 and v1alpha: the two protocols' messages are the same on the
wire, so the v1alpha servicer serves v1 clients too.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

LIVENESS = "liveness"
READINESS = "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def readiness_names(service: str) -> tuple[str, ...]:
    """The names whose status is the process's readiness."""
    return ("", service, READINESS)


def status(ready: bool) -> int:
    return SERVING if ready else NOT_SERVING


def enable_reflection(services: tuple[str, ...], server, aio: bool) -> None:
    """Reflection v1alpha and v1 on `server` (grpc.aio when `aio`)."""
    names = (*services, health.SERVICE_NAME, reflection.SERVICE_NAME, _REFLECTION_V1)
    reflection.enable_server_reflection(names, server)
    if aio:
        from grpc_reflection.v1alpha._async import ReflectionServicer
    else:
        from grpc_reflection.v1alpha.reflection import ReflectionServicer
    handler = grpc.stream_stream_rpc_method_handler(
        ReflectionServicer(names).ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        _REFLECTION_V1, {"ServerReflectionInfo": handler}),))


class AioHealth:
    """Health and reflection on a grpc.aio server whose main service is `service` (more
    services in `reflect`): liveness SERVING from `start` on, readiness NOT_SERVING until
    `set_ready`."""

    def __init__(self, server: grpc.aio.Server, service: str, reflect: tuple[str, ...] = ()):
        self.service = service
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        enable_reflection((service, *reflect), server, aio=True)

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, SERVING)
        await self.set_ready(False)

    async def set_ready(self, ready: bool) -> None:
        for name in readiness_names(self.service):
            await self.servicer.set(name, status(ready))
