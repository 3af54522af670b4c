"""`seqserve-scheduler`: the iteration loop over the workers, the public APIs (in this
process, or in option.frontend_processes front-end processes it starts), and metrics."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import NoReturn

from prometheus_client import start_http_server

from scheduler_service import admin_api
from scheduler_service.core_service import CoreServicer, start_core
from scheduler_service.frontend import Frontend, make_serving_state
from scheduler_service.frontend_pool import FrontendPool
from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics, metrics_route
from scheduler_service.policies import policy_factory
from scheduler_service.public_servers import start_public
from scheduler_service.worker_client import WorkerClient
from scheduler_service.worker_pool import WorkerPool
from seqserve_common import control_auth, tls
from seqserve_common.command_line import process_arguments, run_and_exit, write_port_file
from seqserve_common.config import ConfigError, ServingConfig
from seqserve_common.startup_gc import freeze_startup_objects

logger = logging.getLogger("seqserve.scheduler")


def load_security(cfg: ServingConfig) -> tuple[tls.TlsFiles | None, tls.TlsFiles | None]:
    """(public TLS, worker mutual TLS); ConfigError names the keys of a bad setting."""
    return tls.public_tls(cfg), tls.worker_tls(cfg)


async def serve(cfg: ServingConfig, port_file: str | None,
                security: tuple[tls.TlsFiles | None, tls.TlsFiles | None] | None = None,
                control_token: str | None = None, argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT. `argv`: the command line, passed on to front-end
    processes (option.frontend_processes >= 1)."""
    from seqserve_common.model_source import load_tokenizer

    public_tls, worker_tls = security if security is not None else load_security(cfg)
    control_token = control_token or control_auth.control_token(cfg)
    metrics = SchedulerMetrics()
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
                             length_labels=cfg.length_probe_used,
                             step_send_lead_ms=cfg.step_send_lead_ms,
                             preemption_mode=cfg.preemption_mode,
                             swap_prefetch=cfg.swap_prefetch)

    # Made before the servers start so the admin API can register workers from the start.
    workers = WorkerPool(cfg.worker_addresses, make_client, make_loop, cfg.max_queue)
    split = cfg.frontend_processes > 0
    if split:
        core = CoreServicer(workers, metrics, cfg.frontend_processes)
        node = await start_core(cfg, core, workers, control_token)
        frontends = FrontendPool(cfg, argv or [], f"127.0.0.1:{node.ports['core']}",
                                 control_token)
        ports = {**await frontends.start(), **node.ports}
        draining = lambda: core.draining  # noqa: E731
    else:
        frontend = Frontend(lambda code: metrics.requests_failed.labels(code).inc())
        node = await start_public(
            cfg, frontend, public_tls,
            interceptors=[admin_api.AdminTokenInterceptor(control_token)],
            add_services=lambda server: admin_api.add_to_server(workers, server),
            reflect=(admin_api.SERVICE_NAME,), metrics_route=metrics_route(metrics.registry))
        ports = dict(node.ports)
        draining = lambda: frontend.draining  # noqa: E731
    ports["metrics"] = -1
    if cfg.metrics_port >= 0:
        httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
        ports["metrics"] = httpd.server_port
    # Ports are known now; readiness is the health service's to tell (SERVING once a
    # worker is connected), so a supervisor can tell a starting server from a dead one.
    write_port_file(port_file, ports)
    logger.info("scheduler listening: %s; workers: %s; loading tokenizer of %s",
                ", ".join(f"{k} {v}" for k, v in ports.items()),
                "mutual TLS" if worker_tls is not None else "plaintext", cfg.model_id)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    if split:
        asyncio.ensure_future(frontends.exited.wait()).add_done_callback(lambda _: stop.set())

    def on_ready_change(ready: bool) -> None:
        asyncio.ensure_future(node.set_ready(ready and not draining()))
        if split:
            core.broadcast_state()

    workers.on_ready_change = on_ready_change
    tokenizer = None if split else await asyncio.to_thread(load_tokenizer, cfg)
    ready = asyncio.ensure_future(workers.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        if not split:
            frontend.state = make_serving_state(workers, tokenizer, ready.result(), cfg)
        freeze_startup_objects()
        on_ready_change(workers.ready)
        logger.info("ready: connect to %s:%d (seqserve.v1.Generation)", cfg.host, ports["grpc"])
        await stopped
    else:
        ready.cancel()
    logger.info("shutting down: no new requests; draining %d running, %d waiting for up to "
                "%g s", workers.running(), workers.waiting(), cfg.drain_timeout)
    # Keep listening while the running requests finish, so a new call is refused with a
    # clear UNAVAILABLE (front end) instead of failing to connect.
    if split:
        core.draining = True
        core.broadcast_state()
    else:
        frontend.draining = True
    await node.set_ready(False)
    deadline = time.monotonic() + cfg.drain_timeout
    if split:  # the front ends drain their streams, the core its sequences
        await frontends.stop(cfg.drain_timeout + 2)
    while ready.done() and not workers.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await node.stop(0.5)
    workers.stop()
    await workers.close()
    return 1 if split and frontends.exited.is_set() else 0


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
    return asyncio.run(serve(cfg, args.port_file, security, token,
                             sys.argv[1:] if argv is None else argv))


def cli() -> NoReturn:
    """The console script's entry point: `main` and a prompt exit."""
    run_and_exit(main)


if __name__ == "__main__":
    cli()
