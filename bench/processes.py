"""Start seqserve's processes on this machine: spawn one with a port file, wait until it
serves, stop it. The benchmark harness (bench/) and the test suite both deploy this
way: each process binds ephemeral ports and writes them to a JSON file once listening."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL = 4000  # characters of a process's log quoted when it fails to start
FREE_PORTS_BELOW = 12000  # how many ports under the ephemeral range free_port draws from


def _failed(what: str, log: Path) -> str:
    return f"{what}; log {log}:\n{log.read_text()[-LOG_TAIL:]}"


def wait_port_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> dict:
    """The ports a process wrote to `path`; raises if it exits or stays silent too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(_failed(f"process exited with {proc.returncode}", log))
        time.sleep(0.1)
    raise TimeoutError(_failed(f"no port file after {timeout:.0f} s", log))


def health_status(address: str, timeout: float = 2.0) -> str:
    """The overall status from grpc.health.v1 ("SERVING", "NOT_SERVING", ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout: float = 120,
                 alongside: tuple[Proc, ...] = ()) -> None:
    """Wait for the process at `address` to report SERVING (a worker has loaded its model;
    a scheduler has a ready worker). Raises at once, quoting the right log, if it or any
    process `alongside` (one it waits for, such as its worker) exits."""
    import grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(_failed(f"process exited with {proc.returncode}", log))
        for other in alongside:
            if other.proc.poll() is not None:
                raise RuntimeError(_failed(f"{other.name} exited with {other.proc.returncode}",
                                           other.log))
        try:
            if health_status(address) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError(_failed(f"{address} not SERVING after {timeout:.0f} s", log))


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for bind(0) and as outgoing connections' source."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port no process listens on now, for a process that must be named to another
    before it starts.

    It is drawn below the kernel's ephemeral range. A port from that range, given back
    and named to a scheduler that dials it before its worker binds it, can be taken in
    between: by another bind(0), or by the scheduler's own dial, which the kernel may
    give that very port as source and so connect to itself (TCP simultaneous open),
    leaving the worker "Address already in use". Ports below the range are never
    handed out that way."""
    low, _ = _ephemeral_range()
    first = max(1024, low - FREE_PORTS_BELOW)
    draw = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = draw.randrange(first, low) if low > first else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port on {host} in {first}..{low - 1} after 200 tries")


@dataclass
class Proc:
    """A started process, the ports it wrote and its log."""

    name: str
    proc: subprocess.Popen
    ports: dict
    log: Path
    port_file: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the process (SIGTERM: drain and exit); SIGKILL it after `timeout` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(name: str, module: str, args: list[str], logdir: Path, *,
           env: dict | None = None) -> Proc:
    """Start `python -m module --port-file ... args` with output in logdir/name.log and
    return at once; `ready` waits for it."""
    port_file = logdir / f"{name}.ports.json"
    port_file.unlink(missing_ok=True)
    log = logdir / f"{name}.log"
    cmd = [sys.executable, "-m", module, "--port-file", str(port_file), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                cwd=REPO)
    return Proc(name, proc, {}, log, port_file)


def ready(p: Proc, wait_serving_too: bool = True, timeout: float = 120,
          alongside: tuple[Proc, ...] = ()) -> Proc:
    """Wait until the launched `p` wrote its ports and, with `wait_serving_too`, its health
    service says SERVING; SIGKILL it and raise if it (or a process `alongside`) exits
    first or the time runs out."""
    try:
        p.ports = wait_port_file(p.port_file, p.proc, p.log, timeout)
        if wait_serving_too:
            wait_serving(p.address, p.proc, p.log, timeout, alongside)
    except BaseException:
        p.stop(signal.SIGKILL, timeout=5)
        raise
    return p


def spawn(name: str, module: str, args: list[str], logdir: Path, *, env: dict | None = None,
          wait_ready: bool = True, timeout: float = 120) -> Proc:
    """`launch`, then `ready`: returns once the process wrote its ports and, with
    `wait_ready`, its health service says SERVING."""
    return ready(launch(name, module, args, logdir, env=env), wait_ready, timeout)
