"""py-spy sampling of a deployment's processes during a run, and where the samples sit."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.deployment import Deployment

logger = logging.getLogger("seqserve.bench")


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
