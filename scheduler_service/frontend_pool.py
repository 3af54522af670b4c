"""The scheduler core's front-end processes (option.frontend_processes >= 1): start them
with the core's own options, learn the public ports they bound, stop them.

The first one binds the configured ports (0: free ones); the others then bind the same
ports, which gRPC and the HTTP servers open with SO_REUSEPORT, so the kernel spreads
client connections over them. A front end that exits on its own ends the core too
(`exited`), so one supervisor restart brings the deployment back whole."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from seqserve_common.config import ServingConfig

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # loading a tokenizer from a .gguf file can take a while
POLL_S = 0.05


def forwarded_arguments(argv: list[str]) -> list[str]:
    """The core's command line less its --port-file (each front end gets its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--port-file":
            skip = True
        elif not arg.startswith("--port-file="):
            out.append(arg)
    return out


class FrontendPool:
    def __init__(self, cfg: ServingConfig, argv: list[str], core_address: str, token: str):
        self.cfg = cfg
        self.argv = forwarded_arguments(argv)
        self.core_address = core_address
        self.env = {**os.environ, "OPTION_CONTROL_TOKEN": token}
        self.procs: list[asyncio.subprocess.Process] = []
        self._dir = tempfile.TemporaryDirectory(prefix="seqserve-frontends-")
        self.exited = asyncio.Event()  # one front end ended while the core serves
        self._stopping = False

    async def start(self) -> dict[str, int]:
        """Start every front end; returns the public ports they share."""
        ports = await self._spawn(0, {})
        fixed = {"port": ports["grpc"], "http_port": ports["http"],
                 "openai_port": ports["openai"]}
        for i in range(1, self.cfg.frontend_processes):
            await self._spawn(i, fixed)
        for proc in self.procs:
            asyncio.ensure_future(self._watch(proc))
        return ports

    async def _spawn(self, index: int, fixed: dict[str, int]) -> dict[str, int]:
        port_file = Path(self._dir.name) / f"frontend-{index}.json"
        args = [*self.argv, "--core-address", self.core_address, "--frontend-index", str(index),
                "--port-file", str(port_file), "--metrics-port", "-1",
                *(f"--{k.replace('_', '-')}={v}" for k, v in fixed.items())]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "scheduler_service.frontend_main", *args, env=self.env)
        self.procs.append(proc)
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not port_file.exists():
            if proc.returncode is not None:
                raise RuntimeError(f"front end {index} exited with {proc.returncode} at start "
                                   "(its log is above)")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"front end {index} bound no port in {START_TIMEOUT_S:g} s")
            await asyncio.sleep(POLL_S)
        ports = json.loads(port_file.read_text())
        logger.info("front end %d (pid %d) serves gRPC %d, HTTP %d, OpenAI %d", index, proc.pid,
                    ports["grpc"], ports["http"], ports["openai"])
        return ports

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self._stopping:
            logger.error("front end pid %d exited with %d; the scheduler core stops too",
                         proc.pid, code)
            self.exited.set()

    async def stop(self, timeout: float) -> None:
        """SIGTERM every front end (they drain their streams), then SIGKILL what is left
        after `timeout` s."""
        self._stopping = True
        for proc in self.procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), timeout)
        except asyncio.TimeoutError:
            for proc in self.procs:
                if proc.returncode is None:
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in self.procs))
        self._dir.cleanup()
