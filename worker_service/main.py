"""`seqserve-worker`: serve one model on one device to the scheduler over gRPC."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from scheduler_service.config import ConfigError, add_config_arguments, config_from_args
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc
from worker_service.engine import Engine
from worker_service.metrics import WorkerMetrics
from worker_service.model_runner import ModelRunner
from worker_service.prefix_cache import PrefixCache
from worker_service.servicer import WorkerServicer

logger = logging.getLogger("seqserve.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
MAX_MESSAGE_BYTES = 64 << 20


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("option.device=cuda but torch sees no CUDA device; install a CUDA "
                          "build of torch (see README) or set option.device=cpu")
    return device


def write_port_file(path: str | None, ports: dict[str, int]) -> None:
    """Tell a parent process (tests, make run) the ports actually bound."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seqserve-worker", description=__doc__)
    add_config_arguments(parser)
    parser.add_argument("--port-file", help="write the bound ports as JSON to this file")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        if not cfg.model_id:
            raise ConfigError("option.model_id is not set; pass --model-id DIR or set it in "
                              "serving.properties")
        device = resolve_device(cfg.device)
    except ConfigError as exc:
        parser.error(str(exc))

    metrics = WorkerMetrics()
    servicer = WorkerServicer(cfg.kv_cache_bytes, metrics)
    health_servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME), server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.worker_port}")
    server.start()
    metrics_port = -1
    if cfg.worker_metrics_port >= 0:
        httpd, _ = start_http_server(cfg.worker_metrics_port, addr=cfg.host,
                                     registry=metrics.registry)
        metrics_port = httpd.server_port
    write_port_file(args.port_file, {"grpc": port, "metrics": metrics_port})
    logger.info("worker listening on %s:%d (metrics %d); loading %s", cfg.host, port,
                metrics_port, cfg.model_id)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        runner = ModelRunner(cfg.model_id, dtype=cfg.dtype, device=device,
                             trust_remote_code=cfg.trust_remote_code)
    except Exception:
        logger.exception("could not load model %s", cfg.model_id)
        server.stop(0)
        return 1
    prefix_cache = PrefixCache(runner.kv_shape, cfg.prompt_cache_bytes,
                               cfg.prompt_cache_block_tokens)
    servicer.attach(Engine(runner, prefix_cache))
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("worker ready: %s on %s, %d KV tokens", cfg.model_id, device,
                servicer.kv_capacity_tokens)
    stop.wait()
    logger.info("worker shutting down")
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=5).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
