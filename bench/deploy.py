"""A seqserve deployment for benchmarks (one worker and one scheduler on loopback ephemeral
ports) and what its /metrics pages say about a run."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.processes import Proc, spawn

logger = logging.getLogger("seqserve.bench")


class Deployment:
    """One worker and one scheduler started with `python -m`; a context manager."""

    def __init__(self, model_dir: Path, logdir: Path, *, max_sparsity: float, max_splits: int,
                 max_rolling_batch_size: int, dtype: str = "auto", device: str = "auto",
                 worker_flags: Sequence[str] = (), server_flags: Sequence[str] = (),
                 start_timeout: float = 300.0):
        self.model_dir, self.logdir = Path(model_dir).resolve(), Path(logdir)
        self.scheduler_flags = ["--max-sparsity", str(max_sparsity), "--max-splits",
                                str(max_splits), "--max-rolling-batch-size",
                                str(max_rolling_batch_size)]
        self.worker_flags = list(worker_flags)  # any serving option, e.g. --prompt-cache-bytes 0
        self.server_flags = list(server_flags)  # given to both processes
        self.dtype, self.device, self.start_timeout = dtype, device, start_timeout
        self.procs: list[Proc] = []
        self.worker_ports: dict = {}
        self.scheduler_ports: dict = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler_ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler_ports['metrics']}/metrics"

    @property
    def worker_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.worker_ports['metrics']}/metrics"

    def start(self) -> Deployment:
        self.logdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            # The scheduler starts while the worker loads; it reports SERVING once the
            # worker is ready.
            worker = spawn("worker", "worker_service.main", [
                "--model-id", str(self.model_dir), "--host", "127.0.0.1", "--worker-port", "0",
                "--worker-metrics-port", "0", "--dtype", self.dtype, "--device", self.device,
                *self.server_flags, *self.worker_flags], self.logdir, wait_ready=False,
                timeout=self.start_timeout)
            self.procs.append(worker)
            self.worker_ports = worker.ports
            scheduler = spawn("scheduler", "scheduler_service.main", [
                "--model-id", str(self.model_dir), "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--http-port", "-1",
                "--worker-addresses", worker.address,
                *self.scheduler_flags, *self.server_flags], self.logdir,
                timeout=self.start_timeout)
            self.procs.append(scheduler)
            self.scheduler_ports = scheduler.ports
        except BaseException:
            self.stop()
            raise
        logger.info("deployment up in %.1f s at %s (%s; logs in %s)", time.perf_counter() - t0,
                    self.address, " ".join(self.scheduler_flags + self.server_flags + self.worker_flags), self.logdir)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the scheduler, then the worker; SIGKILL whatever outlives `timeout`."""
        for proc in reversed(self.procs):
            if proc.stop(timeout=timeout) == -signal.SIGKILL:
                logger.warning("%s did not stop in %.0f s; killed it", proc.name, timeout)
        self.procs.clear()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# Scheduler metrics
# --------------------------------------------------------------------------------------------


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of a Prometheus text page: `name{label="v",...}` (labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape_plain(url: str, names: Sequence[str], timeout: float = 5.0) -> dict[str, float]:
    """The values of unlabelled samples `names` on a Prometheus text page. A line scan, not
    the full parser: the peak poller calls this ten times a second during measured runs,
    and parsing every family there cost the load generator about 5 ms a poll, CPU taken
    from the system it measures."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    wanted, out = set(names), {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


class GaugePeak:
    """Polls one gauge of a /metrics page every `interval` seconds in a thread; keeps the max.

    Only polls that see running sequences (`seqserve_num_requests_running` > 0) count, so a
    run too short to be seen gives nan rather than 0."""

    def __init__(self, url: str, name: str, interval: float = 0.1):
        self.url, self.name, self.interval = url, name, interval
        self.peak = float("nan")
        self.polls = self.active_polls = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                page = scrape_plain(self.url, (self.name, "seqserve_num_requests_running"),
                                    timeout=2.0)
                self.polls += 1
                value = page.get(self.name)
                if page.get("seqserve_num_requests_running", 0) > 0 and value is not None:
                    self.active_polls += 1
                    if not value <= self.peak:  # nan-safe max
                        self.peak = value
            except Exception as exc:  # noqa: BLE001 - a missed poll is not fatal
                self.errors += 1
                logger.debug("metrics poll failed: %s", exc)
            self._stop.wait(self.interval)

    def __enter__(self) -> GaugePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.active_polls < 20 and self.interval <= 0.2:  # a peak meant to be read
            logger.warning("peak %s from only %d polls during the run: too short a run for "
                           "a reliable peak", self.name, self.active_polls)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _hist_mean(before: dict[str, float], after: dict[str, float], hist: str) -> float:
    n = _delta(before, after, f"{hist}_count")
    return _delta(before, after, f"{hist}_sum") / n if n else float("nan")


STEP_PHASES = ("plan", "rpc", "worker", "postprocess")


def server_metrics(before: dict[str, float], after: dict[str, float],
                   peak: GaugePeak | None = None) -> dict:
    """What the scheduler says about the measured run (counters as deltas)."""
    def delta(name: str) -> float:
        return _delta(before, after, name)

    return {
        "peak_kv_padded_slots": peak.peak if peak else float("nan"),
        "metrics_polls": peak.polls if peak else 0,
        "metrics_polls_while_running": peak.active_polls if peak else 0,
        "metrics_poll_errors": peak.errors if peak else 0,
        "steps": delta("seqserve_batch_splits_count"),
        "mean_batch_sparsity": _hist_mean(before, after, "seqserve_batch_sparsity"),
        "mean_batch_splits": _hist_mean(before, after, "seqserve_batch_splits"),
        "mean_batch_size": _hist_mean(before, after, "seqserve_batch_size"),
        "regroup_bytes": delta("seqserve_regroup_bytes_total"),
        "regroups": delta("seqserve_regroups_total"),
        "prompt_tokens": delta("seqserve_prompt_tokens_total"),
        "generation_tokens": delta("seqserve_generation_tokens_total"),
        "prefix_cache_hit_tokens": delta("seqserve_prefix_cache_hit_tokens_total"),
        # Where a step's time goes, summed over the run (seconds).
        "step_seconds": {p: delta(f'seqserve_step_seconds_sum{{phase="{p}"}}')
                         for p in STEP_PHASES},
    }


def worker_metrics(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the worker says about the measured run (counters as deltas; seconds summed)."""
    def delta(name: str) -> float:
        return _delta(before, after, name)

    return {
        "steps": delta("seqserve_worker_steps_total"),
        "forward_s": delta("seqserve_worker_forward_seconds_sum"),
        "sampling_s": delta("seqserve_worker_sampling_seconds_sum"),
        "regroup_s": delta("seqserve_worker_regroup_seconds_sum"),
        "generated_tokens": delta("seqserve_worker_generated_tokens_total"),
        "prefix_cache_queries": delta("seqserve_worker_prefix_cache_queries_total"),
        "prefix_cache_hits": delta("seqserve_worker_prefix_cache_hits_total"),
        "prefix_cache_hit_tokens": delta("seqserve_worker_prefix_cache_hit_tokens_total"),
        "prefix_cache_evictions": delta("seqserve_worker_prefix_cache_evictions_total"),
        "prefix_cache_bytes": after.get("seqserve_worker_prefix_cache_bytes", float("nan")),
    }


# --------------------------------------------------------------------------------------------
# Profiling with py-spy
# --------------------------------------------------------------------------------------------


def find_py_spy() -> str | None:
    import shutil

    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


class Profiler:
    """py-spy sampling of each deployment process during a run (collapsed stacks, busy
    threads only); `summary()` gives the frames where the samples sit."""

    def __init__(self, deployment: Deployment, out_dir: Path, rate: int = 100):
        self.deployment, self.out_dir, self.rate = deployment, Path(out_dir), rate
        self.py_spy = find_py_spy()
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.error: str | None = None if self.py_spy else (
            "py-spy not found (pip install py-spy); profile skipped")

    def __enter__(self) -> Profiler:
        if self.error:
            logger.warning("%s", self.error)
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, proc in ((p.name, p.proc) for p in self.deployment.procs):
            out = self.out_dir / f"{name}.collapsed.txt"
            log = (self.out_dir / f"{name}.py-spy.log").open("w")
            p = subprocess.Popen([self.py_spy, "record", "--pid", str(proc.pid), "--rate",
                                  str(self.rate), "--format", "raw", "--output", str(out),
                                  "--nonblocking"], stdout=log, stderr=subprocess.STDOUT)
            self.procs.append((name, p, out))
        time.sleep(0.5)  # let py-spy attach
        return self

    def __exit__(self, *exc) -> None:
        for name, p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for name, p, _ in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def summary(self, top: int = 12) -> dict:
        if self.error:
            return {"skipped": self.error}
        out = {}
        for name, p, path in self.procs:
            if not path.exists():
                log = (self.out_dir / f"{name}.py-spy.log").read_text()[-500:]
                out[name] = {"skipped": f"py-spy wrote nothing (exit {p.returncode}): {log}"}
                continue
            out[name] = summarize_collapsed(path.read_text(), top)
            out[name]["file"] = str(path)
        return out


def _frame_name(frame: str) -> str:
    """'function (path/to/file.py:123)' -> 'function (file.py)'."""
    fn, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{fn} ({Path(file).name})" if file else fn


def summarize_collapsed(text: str, top: int = 12) -> dict:
    """Shares of samples from py-spy's collapsed stacks ('f1;f2;...;fn count' lines): `self`
    by the innermost frame, `inclusive` by every seqserve frame on the stack (once a stack)."""
    self_c: dict[str, int] = {}
    incl: dict[str, int] = {}  # project frames only: the rest is wrappers (threads, torch)
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_c[frames[-1]] = self_c.get(frames[-1], 0) + n
        ours = {_frame_name(f) for f in stack.split(";") if any(
            f"{d}/" in f for d in ("worker_service", "scheduler_service", "client"))}
        for fr in ours:
            incl[fr] = incl.get(fr, 0) + n

    def ranked(d: dict[str, int]) -> list[list]:
        items = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        return [[k, v / total] for k, v in items]

    return {"samples": total, "self": ranked(self_c) if total else [],
            "inclusive": ranked(incl) if total else []}
