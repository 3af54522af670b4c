"""Shared fixtures: generated models and real scheduler/worker processes on loopback."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.processes import Proc, health_status, spawn  # noqa: F401 - health_status: for tests

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
        return spawn(name, module, args, self.workdir, env=self.env, wait_ready=wait_ready)

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
