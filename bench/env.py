"""Facts about the machine and the model that every result records."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from pathlib import Path

from bench.workload import REPO


def model_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint was saved in (config.json), e.g. "bfloat16"."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def model_context(model_dir: Path) -> int | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("max_position_embeddings")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def uptime() -> str:
    """`uptime`'s line (the load averages a reader checks first); '' where it is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cores": machine_cores(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "load_average": load_average()}
    with contextlib.suppress(Exception):
        env["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
    return env
