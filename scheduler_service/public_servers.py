"""The servers clients talk to, over one Frontend: gRPC (seqserve.v1.Generation and
grpc.health.v1), DJL's /invocations and the OpenAI API, with the public TLS and bearer
token. The scheduler process starts them, or each front-end process of a split deployment
(frontend_main.py), which then binds the same ports (SO_REUSEPORT) as its siblings."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from seqserve.v1 import generate_pb2

from scheduler_service import auth
from scheduler_service.frontend import Frontend
from scheduler_service.grpc_api import GenerationServicer, add_to_server
from scheduler_service.http_api import InvocationsApp
from scheduler_service.openai_api import OpenAIApp
from seqserve_common import health as health_names
from seqserve_common import tls
from seqserve_common.config import ServingConfig

logger = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Public requests are one prompt each; gRPC's default of 4 MiB is plenty.
PUBLIC_MESSAGE_BYTES = 4 << 20


@dataclass
class PublicServers:
    server: grpc.aio.Server
    health: health_names.AioHealth
    http: InvocationsApp
    openai: OpenAIApp
    ports: dict[str, int]  # grpc, http, openai (-1: off)

    async def set_ready(self, ready: bool) -> None:
        await self.health.set_ready(ready)

    async def stop(self, grace: float) -> None:
        await asyncio.gather(self.server.stop(grace=grace), self.http.server.stop(),
                             self.openai.server.stop())


async def start_public(cfg: ServingConfig, frontend: Frontend, public_tls: tls.TlsFiles | None,
                       *, interceptors: list, add_services=None, reflect: tuple[str, ...] = (),
                       metrics_route=None, reuse_port: bool = False) -> PublicServers:
    """Listen on cfg.port, cfg.http_port and cfg.openai_port (-1: that one off), not yet
    ready. `add_services(server)` adds more services to the gRPC port (named in `reflect`
    for reflection); `metrics_route` serves /metrics on the OpenAI port; `reuse_port`: the
    HTTP ports are shared with sibling front ends (gRPC's always may be)."""
    if cfg.auth_token:
        interceptors = [*interceptors, auth.BearerTokenInterceptor(cfg.auth_token)]
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", PUBLIC_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", PUBLIC_MESSAGE_BYTES)])
    add_to_server(GenerationServicer(frontend), server)
    if add_services is not None:
        add_services(server)
    health = health_names.AioHealth(server, SERVICE_NAME, reflect)
    await health.start()
    if public_tls is not None:
        port = server.add_secure_port(f"{cfg.host}:{cfg.port}", public_tls.server_credentials(
            require_client_auth=public_tls.ca is not None))
    else:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    # What drain_timeout left running gets half a second, as gRPC streams do, then is cut.
    http = InvocationsApp(frontend, shutdown_timeout=0.5)
    if cfg.auth_token:
        http.app.middlewares.append(auth.bearer_middleware(cfg.auth_token))
    http_ssl = public_tls.server_ssl_context() if public_tls is not None else None
    http_port = (await http.server.start(cfg.host, cfg.http_port, http_ssl, reuse_port)
                 if cfg.http_port >= 0 else -1)
    openai_app = OpenAIApp(frontend, (cfg.served_model_name, cfg.model_id),
                           token=cfg.auth_token, shutdown_timeout=0.5, metrics=metrics_route)
    openai_port = (await openai_app.server.start(cfg.host, cfg.openai_port, http_ssl,
                                                     reuse_port)
                   if cfg.openai_port >= 0 else -1)
    servers = PublicServers(server, health, http, openai_app,
                            {"grpc": port, "http": http_port, "openai": openai_port})
    public_mode = ("plaintext" if public_tls is None else
                   "TLS" if public_tls.ca is None else "mutual TLS")
    logger.info("public API on %s: gRPC %d, HTTP %d, OpenAI %d; %s%s", cfg.host, port,
                http_port, openai_port, public_mode,
                ", bearer token required" if cfg.auth_token else "")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        if public_tls is None:
            logger.warning("listening on %s without TLS: requests%s travel in plaintext "
                           "(see docs/security.md)", cfg.host,
                           " and the bearer token" if cfg.auth_token else "")
        if not cfg.auth_token and public_tls is None:
            logger.warning("listening on %s with no bearer token and no client "
                           "certificates: anyone who reaches the port can generate", cfg.host)
    return servers
