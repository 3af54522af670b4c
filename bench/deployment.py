"""A seqserve deployment on this machine: one worker and one scheduler started as real
processes on loopback ephemeral ports. The benchmarks and the test suite both deploy this way."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from bench.metrics import scrape
from bench.processes import Proc, free_port, launch, ready

logger = logging.getLogger("seqserve.bench")


def flags(options: dict) -> list[str]:
    """Serving options as command-line flags: {"max_splits": 4} -> ["--max-splits", "4"]."""
    out = []
    for k, v in options.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


class Deployment:
    """A worker and a scheduler, started with `python -m`; a context manager.

    `options` are the scheduler's serving options and `worker_options` the worker's, as
    dicts (later keys win, as later flags do); `env` is added to both processes'
    environment (e.g. OPTION_AUTH_TOKEN). Logs and port files go to `workdir`. Start both
    with `start()`, or each with `start_worker()` / `start_scheduler()` to test what
    happens in between."""

    def __init__(self, model_dir: Path, workdir: Path, options: dict | None = None,
                 worker_options: dict | None = None, *, env: dict | None = None,
                 start_timeout: float = 120.0, stop_timeout: float = 20.0):
        self.model_dir, self.workdir = Path(model_dir).resolve(), Path(workdir)
        self.options = dict(options or {})
        self.worker_options = dict(worker_options or {})
        self.env = dict(env or {})
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.workers: list[Proc] = []
        self.scheduler: Proc | None = None

    @property
    def worker(self) -> Proc | None:
        """The first worker (the only one unless start_worker was called again)."""
        return self.workers[0] if self.workers else None

    @worker.setter
    def worker(self, proc: Proc) -> None:
        if self.workers:
            self.workers[0] = proc
        else:
            self.workers.append(proc)

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (*self.workers, self.scheduler) if p is not None]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.ports['grpc']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.ports['http']}"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.ports['openai']}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.ports['metrics']}/metrics"

    @property
    def worker_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.worker.ports['metrics']}/metrics"

    def _launch(self, name: str, module: str, options: dict) -> Proc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return launch(name, module, flags(options), self.workdir, env=self.env)

    def _launch_worker(self, index: int, port: int) -> Proc:
        """Worker number `index` on `port` (0: any free one), launched, not waited for."""
        opts = {"model_id": self.model_dir, "host": "127.0.0.1", "worker_port": port,
                "worker_metrics_port": 0, **self.worker_options}
        return self._launch("worker" if index == 0 else f"worker{index}",
                            "worker_service.main", opts)

    def _scheduler_options(self, ports: list[int]) -> dict:
        return {"model_id": self.model_dir, "host": "127.0.0.1", "port": 0, "metrics_port": 0,
                "http_port": 0, "openai_port": 0,
                "worker_addresses": ",".join(f"127.0.0.1:{p}" for p in ports), **self.options}

    def start_worker(self, port: int = 0, wait_ready: bool = True, index: int = 0) -> Proc:
        """Start worker number `index` (a restart when it exists, else the next one) on
        `port` (0: any free one); with `wait_ready`, return once its model is loaded."""
        proc = ready(self._launch_worker(index, port), wait_ready, self.start_timeout)
        if index < len(self.workers):
            self.workers[index] = proc
        else:
            self.workers.append(proc)
        return proc

    def start_scheduler(self, worker_port: int | None = None, wait_ready: bool = True) -> Proc:
        """Start the scheduler against the worker at `worker_port` (default: every started
        worker); with `wait_ready`, return once it reports SERVING (a worker is ready)."""
        ports = [worker_port] if worker_port else [w.ports["grpc"] for w in self.workers]
        self.scheduler = ready(self._launch("scheduler", "scheduler_service.main",
                                            self._scheduler_options(ports)),
                               wait_ready, self.start_timeout)
        return self.scheduler

    def start(self, workers: int = 1) -> Deployment:
        """Start `workers` workers and the scheduler at once; return when the scheduler
        is SERVING with every worker joined (each has loaded the model).

        All start together, which halves the wait on a machine with two cores or more:
        each worker is given a free port up front so that the scheduler can be told it. A
        worker that fails to load raises at once with its own log."""
        t0 = time.perf_counter()
        try:
            ports = [self.worker_options.get("worker_port") or free_port()
                     for _ in range(workers)]
            self.workers = [self._launch_worker(i, port) for i, port in enumerate(ports)]
            self.scheduler = self._launch("scheduler", "scheduler_service.main",
                                          self._scheduler_options(ports))
            ready(self.scheduler, True, self.start_timeout, alongside=tuple(self.workers))
            for worker in self.workers:
                ready(worker, workers > 1, self.start_timeout)
            if workers > 1:
                self._wait_joined(workers)
        except BaseException:
            self.stop()
            raise
        logger.info("deployment up in %.1f s at %s (scheduler %s; worker %s; logs in %s)",
                    time.perf_counter() - t0, self.address, self.options, self.worker_options,
                    self.workdir)
        return self

    def _wait_joined(self, workers: int) -> None:
        """Wait until the scheduler counts `workers` ready workers (it serves once one is)."""
        deadline = time.monotonic() + self.start_timeout
        while scrape(self.metrics_url).get("seqserve_workers_ready", 0) < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler did not take up {workers} workers in "
                                   f"{self.start_timeout:.0f} s; log {self.scheduler.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the scheduler, then the worker; SIGKILL whatever outlives stop_timeout."""
        for proc in reversed(self.procs):
            running = proc.proc.poll() is None
            if proc.stop(timeout=self.stop_timeout) == -signal.SIGKILL and running:
                logger.warning("%s did not stop in %.0f s; killed it", proc.name,
                               self.stop_timeout)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
