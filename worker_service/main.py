"""`seqserve-worker`: serve one model on one device to the scheduler over gRPC; with
option.tensor_parallel_degree=T, on T devices (or T shares of the CPU) as one group."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import start_http_server
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc

from seqserve_common import health as health_names
from seqserve_common.command_line import process_arguments, run_and_exit, write_port_file
from seqserve_common.config import ConfigError
from seqserve_common.control_auth import ControlTokenInterceptor, control_token
from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS
from seqserve_common.startup_gc import freeze_startup_objects
from seqserve_common.tls import worker_tls
from worker_service import tensor_parallel as tp

logger = logging.getLogger("seqserve.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Prompt tokens of the prefill timed at start for the swap-or-recompute choice: about a
# preempted sequence's length under the benchmark traces.
SWAP_PROBE_TOKENS = 512


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("option.device=cuda but torch sees no CUDA device; install a CUDA "
                          "build of torch (see README) or set option.device=cpu")
    return device


def follower_main(cfg, me: tp.Rank, device: str) -> int:
    """Ranks 1..T-1 of a tensor-parallel group: no gRPC; load this rank's shard of the
    model and run what rank 0 broadcasts (tp_engine.py) until it stops or fails."""
    from worker_service.engine import Engine
    from worker_service.host_memory import keep_freed_memory
    from worker_service.model_runner import ModelRunner
    from worker_service.prefix_cache import PrefixCache
    from worker_service.tp_engine import follow

    tp.follow_launcher()
    # Rank 0 decides when the group stops (it drains first, then says so); a terminal's
    # Ctrl-C or torchrun's SIGTERM reaching this rank too must not break that drain.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()
    try:
        tp.join_group(me, device)
        runner = ModelRunner(cfg.model_id, dtype=cfg.dtype, device=device,
                             trust_remote_code=cfg.trust_remote_code,
                             kv_dtype=cfg.kv_cache_dtype, gguf_cache_dir=cfg.gguf_cache_dir,
                             batch_invariant=cfg.batch_invariant,
                             tensor_parallel_degree=me.world_size)
    except Exception:
        logger.exception("rank %d could not load model %s", me.rank, cfg.model_id)
        return 1
    from worker_service.kv_arena import kv_arena
    from worker_service.kv_swap import swap_space

    # Rank 0's warm-up, which this rank mirrors, maps only the prefix cache's heap: group
    # buffers come from an arena here too (main() says why).
    engine = Engine(runner, PrefixCache(runner.kv_shape, cfg.prompt_cache_bytes,
                                        cfg.prompt_cache_block_tokens),
                    swap=swap_space(cfg.swap_space_bytes, runner.device),
                    arena=kv_arena(cfg, runner.device))
    freeze_startup_objects()
    code = follow(engine)
    logger.info("rank %d exits (%d)", me.rank, code)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, args, cfg = process_arguments("seqserve-worker", __doc__, argv)
    degree = cfg.tensor_parallel_degree
    try:
        tls = worker_tls(cfg)
        token = control_token(cfg)
        me = tp.Rank.from_environment(degree) if degree > 1 else None
        device = tp.rank_device(resolve_device(cfg.device), me)
    except (ConfigError, tp.TensorParallelError) as exc:
        parser.error(str(exc))
    if degree > 1 and device == "cpu":
        tp.split_threads(degree)
    if me is not None and not me.leader:
        tp.label_logs(me.rank)
        return follower_main(cfg, me, device)
    # Rank 0 of a group started without torchrun starts the other ranks itself.
    store, followers, group_stopping = None, [], threading.Event()
    if degree > 1:
        tp.label_logs(0)
    if degree > 1 and me is None:
        me, store, followers = tp.launch_followers(degree, argv)
        threading.Thread(target=tp.watch_followers, args=(followers, group_stopping),
                         name="tp-watchdog", daemon=True).start()

    # torch and the engine load here, after the configuration is checked (a bad option
    # fails fast).
    from worker_service.compute import MainThreadExecutor
    from worker_service.engine import Engine
    from worker_service.host_memory import keep_freed_memory
    from worker_service.kv_arena import kv_arena
    from worker_service.kv_swap import measure_rates, swap_space
    from worker_service.length_probe import LengthProbe, ProbeConfig
    from worker_service.metrics import WorkerMetrics
    from worker_service.model_runner import ModelRunner
    from worker_service.prefix_cache import PrefixCache
    from worker_service.servicer import WorkerServicer
    from worker_service.tp_engine import LeaderEngine

    metrics = WorkerMetrics()
    keep_freed_memory()
    # Every torch call runs on this, the main, thread (compute.py says why).
    compute = MainThreadExecutor()
    servicer = WorkerServicer(cfg.kv_cache_bytes, metrics, compute,
                              lease_seconds=cfg.worker_lease)
    health_servicer = health.HealthServicer()
    # Only a scheduler holding the control-plane token may call the Worker service.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         interceptors=[ControlTokenInterceptor(token)],
                         options=list(GRPC_MESSAGE_OPTIONS))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_names.enable_reflection((SERVICE_NAME,), server, aio=False)
    health_servicer.set(health_names.LIVENESS, health_names.SERVING)
    for name in health_names.readiness_names(SERVICE_NAME):
        health_servicer.set(name, health_names.NOT_SERVING)
    if tls is not None:
        # Mutual TLS: only a client (the scheduler) with a certificate signed by
        # option.worker_tls_ca_file gets through the handshake.
        port = server.add_secure_port(f"{cfg.host}:{cfg.worker_port}",
                                      tls.server_credentials(require_client_auth=True))
    else:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.worker_port}")
    server.start()
    metrics_port = -1
    if cfg.worker_metrics_port >= 0:
        httpd, _ = start_http_server(cfg.worker_metrics_port, addr=cfg.host,
                                     registry=metrics.registry)
        metrics_port = httpd.server_port
    link = None
    if cfg.worker_steps_link_port >= 0 and tls is None:
        # With mutual TLS the Steps stay on gRPC's TLS channel: the link has no TLS of its own.
        from worker_service.steps_link import StepsLinkServer

        link = StepsLinkServer(servicer, token, cfg.host, cfg.worker_steps_link_port)
        link.start()
        servicer.steps_link_port = link.port
    ports: dict = {"grpc": port, "metrics": metrics_port,
                   "steps_link": link.port if link is not None else -1}
    if followers:  # whoever supervises the group can see (and test) its other ranks
        ports["follower_pids"] = [p.pid for p in followers]
    write_port_file(args.port_file, ports)
    logger.info("worker listening on %s:%d (%s, metrics %d, steps link %d); loading %s",
                cfg.host, port, "mutual TLS" if tls is not None else "plaintext", metrics_port,
                ports["steps_link"], cfg.model_id)
    if tls is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("worker listening on %s without mutual TLS: the control-plane token "
                       "travels in plaintext (see docs/security.md)", cfg.host)

    stop_lease = threading.Event()

    def drain() -> None:
        # Steps already in flight finish during the grace period: the compute loop runs
        # until the server has stopped.
        logger.info("worker shutting down")
        stop_lease.set()
        health_servicer.enter_graceful_shutdown()
        stopped = server.stop(grace=5)
        if link is not None:
            link.stop(grace=5)
        stopped.wait()
        compute.shutdown()

    def on_signal(*_) -> None:
        threading.Thread(target=drain, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if degree > 1:
            tp.join_group(me, device, store)
        runner = ModelRunner(cfg.model_id, dtype=cfg.dtype, device=device,
                             trust_remote_code=cfg.trust_remote_code,
                             kv_dtype=cfg.kv_cache_dtype, gguf_cache_dir=cfg.gguf_cache_dir,
                             batch_invariant=cfg.batch_invariant,
                             tensor_parallel_degree=degree)
    except Exception:
        logger.exception("could not load model %s", cfg.model_id)
        server.stop(0)
        return 1
    prefix_cache = PrefixCache(runner.kv_shape, cfg.prompt_cache_bytes,
                               cfg.prompt_cache_block_tokens)
    # The length probe reads the leader's hidden states (identical on every rank).
    probe = (LengthProbe(runner.lm_head.in_features,
                         ProbeConfig(min_samples=cfg.length_probe_min_samples))
             if cfg.length_probe_used else None)
    if probe is not None:
        logger.info("length probe on (scheduling_policy length-aware, length_predictor %s)",
                    cfg.length_predictor)
    swap = swap_space(cfg.swap_space_bytes, runner.device)
    # On CPU the KV budget's memory is mapped now, as vLLM allocates its KV cache at
    # start: a page fault on fresh memory costs some 5 us on this project's machines, and
    # a run whose group buffers grow into heap memory not mapped before pays it per 4 KiB
    # (docs/benchmarks.md, session 23). Groups take their buffers from this region; the
    # heap, mapped in the warm-up, keeps the prefix cache's blocks.
    try:
        arena = kv_arena(cfg, runner.device)
    except RuntimeError:
        logger.exception("could not map option.kv_cache_bytes=%d x option.kv_arena_headroom="
                         "%g of host memory for KV; lower them to what this machine has free",
                         cfg.kv_cache_bytes, cfg.kv_arena_headroom)
        server.stop(0)
        return 1
    engine = Engine(runner, prefix_cache, probe, swap, arena)
    if degree > 1:
        # Every call that changes the engine or runs the model reaches every rank.
        engine = LeaderEngine(engine)
    try:
        seconds = engine.warm_up(cfg.max_num_batched_tokens,
                                 premap_bytes=cfg.prompt_cache_bytes)
    except Exception:
        logger.exception("warm-up: a %d-token prefill step failed on this device; lower "
                         "option.max_num_batched_tokens", cfg.max_num_batched_tokens)
        server.stop(0)
        return 1
    logger.info("warm-up: a %d-token prefill step took %.2f s", cfg.max_num_batched_tokens, seconds)
    rates = None
    if swap is not None:
        # What the scheduler weighs a swap against a recompute by (option.preemption_mode).
        rates = measure_rates(engine, min(cfg.max_num_batched_tokens, SWAP_PROBE_TOKENS))
        logger.info("swap space %d MiB: KV copies at %.1f GB/s to host and back, prefill at "
                    "%.0f tokens/s", swap.capacity_bytes >> 20, rates.copy_bytes_per_second / 1e9,
                    rates.prefill_tokens_per_second)
    servicer.attach(engine, rates)
    threading.Thread(target=servicer.watch_lease, args=(stop_lease,), name="lease",
                     daemon=True).start()
    if degree > 1:
        threading.Thread(target=engine.keep_alive, args=(compute.submit, stop_lease),
                         name="tp-heartbeat", daemon=True).start()
    freeze_startup_objects()
    for name in health_names.readiness_names(SERVICE_NAME):
        health_servicer.set(name, health_names.SERVING)
    logger.info("worker ready: %s on %s, %d KV tokens%s", cfg.model_id, device,
                servicer.kv_capacity_tokens,
                f" per rank, tensor-parallel group of {degree}" if degree > 1 else "")
    compute.serve()  # every Step, until SIGTERM or SIGINT has drained the server
    if degree > 1:
        group_stopping.set()
        engine.stop()
        for proc in followers:
            proc.wait(timeout=30)
    return 0


def cli() -> NoReturn:
    """The console script's entry point: `main` and a prompt exit."""
    run_and_exit(main)


if __name__ == "__main__":
    cli()
