"""`seqserve-scheduler`: the public gRPC API, the iteration loop, and metrics."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import start_http_server
from seqserve.v1 import generate_pb2

from scheduler_service import admin_api, auth
from scheduler_service.frontend import Frontend, ServingState
from scheduler_service.grpc_api import GenerationServicer, add_to_server
from scheduler_service.http_api import InvocationsApp
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics, metrics_route
from scheduler_service.openai_api import OpenAIApp
from scheduler_service.params import Limits
from scheduler_service.policies import policy_factory
from scheduler_service.worker_client import WorkerClient
from scheduler_service.worker_pool import WorkerPool
from seqserve_common import control_auth, tls
from seqserve_common import health as health_names
from seqserve_common.command_line import process_arguments, write_port_file
from seqserve_common.config import ConfigError, ServingConfig
from seqserve_common.decoding import DecodingStrategy

logger = logging.getLogger("seqserve.scheduler")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Public requests are one prompt each; gRPC's default of 4 MiB is plenty.
PUBLIC_MESSAGE_BYTES = 4 << 20


def load_security(cfg: ServingConfig) -> tuple[tls.TlsFiles | None, tls.TlsFiles | None]:
    """(public TLS, worker mutual TLS); ConfigError names the keys of a bad setting."""
    return tls.public_tls(cfg), tls.worker_tls(cfg)


async def serve(cfg: ServingConfig, port_file: str | None,
                security: tuple[tls.TlsFiles | None, tls.TlsFiles | None] | None = None,
                control_token: str | None = None) -> int:
    from seqserve_common.model_source import load_tokenizer

    public_tls, worker_tls = security if security is not None else load_security(cfg)
    control_token = control_token or control_auth.control_token(cfg)
    metrics = SchedulerMetrics()
    frontend = Frontend(metrics)
    servicer = GenerationServicer(frontend)
    health_servicer = health.aio.HealthServicer()

    async def set_ready(ready: bool) -> None:
        for name in health_names.readiness_names(SERVICE_NAME):
            await health_servicer.set(name, health_names.status(ready))

    credentials = worker_tls.channel_credentials() if worker_tls is not None else None

    def make_client(address: str) -> WorkerClient:
        return WorkerClient(address, control_token, credentials=credentials)

    new_policy = policy_factory(cfg)

    def make_loop(client: WorkerClient) -> IterationLoop:
        return IterationLoop(client, max_rolling_batch_size=cfg.max_rolling_batch_size,
                             max_queue=cfg.max_queue, max_sparsity=cfg.max_sparsity,
                             max_splits=cfg.max_splits, worker_timeout=cfg.worker_timeout,
                             metrics=metrics, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             steps_in_flight=cfg.steps_in_flight, policy=new_policy(),
                             enable_chunked_prefill=cfg.enable_chunked_prefill,
                             length_labels=cfg.length_probe_used)

    # Made before the server starts so the admin API can register workers from the start.
    workers = WorkerPool(cfg.worker_addresses, make_client, make_loop, cfg.max_queue)
    interceptors = [admin_api.AdminTokenInterceptor(control_token)]
    if cfg.auth_token:
        interceptors.append(auth.BearerTokenInterceptor(cfg.auth_token))
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", PUBLIC_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", PUBLIC_MESSAGE_BYTES)])
    add_to_server(servicer, server)
    admin_api.add_to_server(workers, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_names.enable_reflection((SERVICE_NAME, admin_api.SERVICE_NAME), server, aio=True)
    await health_servicer.set(health_names.LIVENESS, health_names.SERVING)
    await set_ready(False)
    if public_tls is not None:
        port = server.add_secure_port(f"{cfg.host}:{cfg.port}", public_tls.server_credentials(
            require_client_auth=public_tls.ca is not None))
    else:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    metrics_port = -1
    if cfg.metrics_port >= 0:
        httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
        metrics_port = httpd.server_port
    # What drain_timeout left running gets half a second, as gRPC streams do, then is cut.
    http = InvocationsApp(frontend, shutdown_timeout=0.5)
    if cfg.auth_token:
        http.app.middlewares.append(auth.bearer_middleware(cfg.auth_token))
    http_ssl = public_tls.server_ssl_context() if public_tls is not None else None
    http_port = (await http.server.start(cfg.host, cfg.http_port, http_ssl)
                 if cfg.http_port >= 0 else -1)
    openai_app = OpenAIApp(frontend, (cfg.served_model_name, cfg.model_id),
                           token=cfg.auth_token, shutdown_timeout=0.5,
                           metrics=metrics_route(metrics.registry))
    openai_port = (await openai_app.server.start(cfg.host, cfg.openai_port, http_ssl)
                   if cfg.openai_port >= 0 else -1)
    # Ports are known now; readiness is the health service's to tell (SERVING once a
    # worker is connected), so a supervisor can tell a starting server from a dead one.
    write_port_file(port_file, {"grpc": port, "metrics": metrics_port, "http": http_port,
                                "openai": openai_port})
    logger.info("scheduler listening on %s:%d (HTTP %d, OpenAI %d, metrics %d); loading "
                "tokenizer of %s", cfg.host, port, http_port, openai_port, metrics_port,
                cfg.model_id)
    public_mode = ("plaintext" if public_tls is None else
                   "TLS" if public_tls.ca is None else "mutual TLS")
    logger.info("public API: %s%s; workers: %s", public_mode,
                ", bearer token required" if cfg.auth_token else "",
                "mutual TLS" if worker_tls is not None else "plaintext")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        if public_tls is None:
            logger.warning("listening on %s without TLS: requests%s travel in plaintext "
                           "(see docs/security.md)", cfg.host,
                           " and the bearer token" if cfg.auth_token else "")
        if not cfg.auth_token and public_tls is None:
            logger.warning("listening on %s with no bearer token and no client "
                           "certificates: anyone who reaches the port can generate", cfg.host)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)

    tokenizer = await asyncio.to_thread(load_tokenizer, cfg)
    workers.on_ready_change = lambda ready: asyncio.ensure_future(
        set_ready(ready and not frontend.draining))
    ready = asyncio.ensure_future(workers.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        workers.stop()
        await asyncio.gather(http.server.stop(), openai_app.server.stop())
        await server.stop(0)
        await workers.close()
        return 0
    info = ready.result()
    limits = Limits(vocab_size=info.vocab_size,
                    max_position_embeddings=info.max_position_embeddings,
                    max_new_tokens_limit=cfg.max_new_tokens_limit,
                    default_max_new_tokens=cfg.default_max_new_tokens,
                    default_strategy=DecodingStrategy(cfg.decoding_strategy))
    frontend.state = ServingState(workers, tokenizer, limits, info, cfg)
    await set_ready(workers.ready)
    logger.info("ready: connect to %s:%d (seqserve.v1.Generation)", cfg.host, port)

    await stopped
    logger.info("shutting down: no new requests; draining %d running, %d waiting for up to "
                "%g s", workers.running(), workers.waiting(), cfg.drain_timeout)
    # Keep listening while the running requests finish, so a new call is refused with a
    # clear UNAVAILABLE (front end) instead of failing to connect.
    frontend.draining = True
    await set_ready(False)
    deadline = time.monotonic() + cfg.drain_timeout
    while not workers.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.gather(server.stop(grace=0.5), http.server.stop(), openai_app.server.stop())
    workers.stop()
    await workers.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, args, cfg = process_arguments("seqserve-scheduler", __doc__, argv)
    duplicates = sorted({a for a in cfg.worker_addresses if cfg.worker_addresses.count(a) > 1})
    if duplicates:
        parser.error(f"option.worker_addresses lists {', '.join(duplicates)} more than once; "
                     "give each worker once")
    try:
        security = load_security(cfg)
        token = control_auth.control_token(cfg)
    except ConfigError as exc:
        parser.error(str(exc))
    return asyncio.run(serve(cfg, args.port_file, security, token))


if __name__ == "__main__":
    raise SystemExit(main())
