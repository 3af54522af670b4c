"""Shared fixtures: generated models and real scheduler/worker processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("SEQSERVE_TEST_MODELS", REPO / "models" / "test"))
ARCHITECTURES = ("llama", "gpt2", "qwen2", "mistral", "gpt_neox", "opt")


def tiny_model(arch: str = "llama") -> Path:
    """A tiny random-weight model of `arch` (written once, reused across runs)."""
    from worker_service.fixtures import make_model

    return make_model(MODELS / f"tiny-{arch}", arch=arch, size="tiny", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model("llama")


def _wait_port_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"no port file after {timeout} s:\n{log.read_text()[-4000:]}")


def health_status(address: str, timeout: float = 2.0) -> str:
    """The overall status from grpc.health.v1 ("SERVING", "NOT_SERVING", ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    import grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if health_status(address) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout} s:\n{log.read_text()[-4000:]}")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    ports: dict
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class Deployment:
    """A worker and a scheduler, started as real processes on ephemeral loopback ports."""

    model_dir: Path
    workdir: Path
    options: dict = field(default_factory=dict)
    worker_options: dict = field(default_factory=dict)
    worker: Proc | None = None
    scheduler: Proc | None = None
    env: dict = field(default_factory=dict)  # extra environment (e.g. OPTION_AUTH_TOKEN)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.ports['grpc']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.ports['http']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.ports['metrics']}/metrics"

    def _spawn(self, name: str, module: str, args: list[str], wait_ready: bool = True) -> Proc:
        port_file = self.workdir / f"{name}.ports.json"
        port_file.unlink(missing_ok=True)
        log = self.workdir / f"{name}.log"
        cmd = [sys.executable, "-m", module, "--port-file", str(port_file), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               **self.env}
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                cwd=REPO)
        ports = _wait_port_file(port_file, proc, log)
        p = Proc(name, proc, ports, log)
        if wait_ready:
            wait_serving(f"127.0.0.1:{ports['grpc']}", proc, log)
        return p

    @staticmethod
    def _flags(options: dict) -> list[str]:
        out = []
        for k, v in options.items():
            out += [f"--{k.replace('_', '-')}", str(v)]
        return out

    def start_worker(self, port: int = 0, wait_ready: bool = True) -> Proc:
        opts = {"model_id": self.model_dir, "host": "127.0.0.1", "worker_port": port,
                "worker_metrics_port": 0, **self.worker_options}
        self.worker = self._spawn("worker", "worker_service.main", self._flags(opts), wait_ready)
        return self.worker

    def start_scheduler(self, worker_port: int | None = None, wait_ready: bool = True) -> Proc:
        port = worker_port or self.worker.ports["grpc"]
        opts = {"model_id": self.model_dir, "host": "127.0.0.1", "port": 0, "metrics_port": 0,
                "http_port": 0, "worker_addresses": f"127.0.0.1:{port}", **self.options}
        self.scheduler = self._spawn("scheduler", "scheduler_service.main", self._flags(opts),
                                     wait_ready)
        return self.scheduler

    def start(self) -> Deployment:
        self.start_worker()
        self.start_scheduler()
        return self

    def stop(self) -> None:
        for p in (self.scheduler, self.worker):
            if p is not None:
                p.stop()


@pytest.fixture
def deploy(tmp_path):
    """Factory: deploy(model_dir, **scheduler_options) -> a started Deployment."""
    started: list[Deployment] = []

    def start(model_dir: Path, worker_options: dict | None = None, **options) -> Deployment:
        d = Deployment(Path(model_dir), tmp_path, options, worker_options or {})
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.stop()
