"""`python -m scheduler_service.frontend_main`: one front-end process of a split
deployment. The scheduler core starts these (option.frontend_processes, frontend_pool.py)
with its own options plus --core-address and --frontend-index; each serves the public
APIs on the shared ports and submits to the core (remote_core.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import NoReturn

from scheduler_service.frontend import Frontend, make_serving_state
from scheduler_service.public_servers import start_public
from scheduler_service.remote_core import RemoteCore
from seqserve_common import control_auth, tls
from seqserve_common.command_line import process_arguments, run_and_exit, write_port_file
from seqserve_common.config import ConfigError, ServingConfig
from seqserve_common.startup_gc import freeze_startup_objects

logger = logging.getLogger("seqserve.frontend")
PARENT_POLL_S = 0.5


async def serve(cfg: ServingConfig, core_address: str, index: int, port_file: str | None,
                public_tls: tls.TlsFiles | None, token: str) -> int:
    from seqserve_common.model_source import load_tokenizer

    parent = os.getppid()  # the core, whose death ends the wait for it below
    core = RemoteCore(core_address, token, index, cfg.max_queue)
    frontend = Frontend(core.count_refusal)
    # Siblings bind the same ports: the first front end's, passed on by the core.
    public = await start_public(cfg, frontend, public_tls, interceptors=[], reuse_port=True,
                                metrics_route=core.metrics_route())
    write_port_file(port_file, public.ports)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg)
    connected = asyncio.ensure_future(core.connect())
    stopped = asyncio.ensure_future(stop.wait())
    orphaned = asyncio.ensure_future(_exited(parent))
    await asyncio.wait({connected, stopped, orphaned}, return_when=asyncio.FIRST_COMPLETED)
    orphaned.cancel()
    if not connected.done():
        # A core gone before this one connected looks like one with no worker yet
        # (UNAVAILABLE): without this the front end would wait for it, on its ports, for ever.
        connected.cancel()
        if orphaned.done():
            logger.error("the scheduler core (pid %d) exited before front end %d connected; "
                         "it exits too", parent, index)
        await public.stop(0)
        await core.close()
        return 0 if stopped.done() else 1
    frontend.state = make_serving_state(core, tokenizer, connected.result(), cfg)
    core.on_ready_change = lambda ready: asyncio.ensure_future(
        public.set_ready(ready and not frontend.draining))
    freeze_startup_objects()
    await public.set_ready(core.ready)
    logger.info("front end %d ready on gRPC %d (core %s)", index, public.ports["grpc"],
                core_address)

    lost = asyncio.ensure_future(core.lost.wait())
    await asyncio.wait({stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        logger.error("the scheduler core went away; front end %d exits", index)
        await public.stop(0)
        await core.close()
        return 1
    frontend.draining = True
    await public.set_ready(False)
    deadline = time.monotonic() + cfg.drain_timeout
    while core.seqs and time.monotonic() < deadline and not core.lost.is_set():
        await asyncio.sleep(0.05)
    await public.stop(0.5)
    await core.close()
    return 0


async def _exited(pid: int) -> None:
    """Returns once process `pid`, this one's parent, has exited (this one is re-parented)."""
    while os.getppid() == pid:
        await asyncio.sleep(PARENT_POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser, args, cfg = process_arguments(
        "seqserve-frontend", __doc__, argv,
        extra=lambda p: (p.add_argument("--core-address", required=True),
                         p.add_argument("--frontend-index", type=int, required=True)))
    try:
        public_tls = tls.public_tls(cfg)
        token = control_auth.control_token(cfg)
    except ConfigError as exc:
        parser.error(str(exc))
    return asyncio.run(serve(cfg, args.core_address, args.frontend_index, args.port_file,
                             public_tls, token))


def cli() -> NoReturn:
    """The console script's entry point: `main` and a prompt exit."""
    run_and_exit(main)


if __name__ == "__main__":
    cli()
