"""Shared fixtures: generated models and real scheduler/worker processes on loopback."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bench.deployment import Deployment

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("SEQSERVE_TEST_MODELS", REPO / "models" / "test"))
# A CPU worker maps its whole KV budget at start (1.5 x 4 GiB by default) and the prefix
# cache's 512 MiB in its warm-up; on this project's machines memory never touched before
# faults in at some 150-200 MB/s, about 5 s of each worker's start at 512 MiB of each. So
# the workers the tests start get 64 MiB of each unless a test sets its own (OPTION_*
# variables are read by every process; flags win): 32,000 tokens of the generated models
# (at most 2 KiB a token) and 1,400 of the real SmolLM2 in float32 (45 KiB), more than any
# of their tests holds.
os.environ.setdefault("OPTION_KV_CACHE_BYTES", str(64 << 20))
os.environ.setdefault("OPTION_PROMPT_CACHE_BYTES", str(64 << 20))
ARCHITECTURES = ("llama", "gpt2", "qwen2", "mistral", "gpt_neox", "opt")


def _onednn_bf16() -> bool:
    import torch

    from worker_service.kernels import linear_prepack

    return linear_prepack.runs(torch.bfloat16)


# Tests of the bfloat16 CPU fast paths (prepacked and stacked products, the C loops inside
# a runner, batch-invariant mode): where oneDNN has no bfloat16 path (AVX2-only CPUs) a
# bfloat16 model computes in float32 and none of them is on.
needs_onednn_bf16 = pytest.mark.skipif(
    not _onednn_bf16(), reason="this CPU has no oneDNN bfloat16 path: bfloat16 models "
    "compute in float32 here")


def amx_on() -> bool:
    """The CPU has AMX-BF16 and the run has not switched the tiles off (SEQSERVE_AMX=0)."""
    from worker_service.kernels import linear_prepack

    return ("amx_bf16" in linear_prepack.cpu_flags()
            and os.environ.get("SEQSERVE_AMX", "1") != "0")


needs_amx = pytest.mark.skipif(not amx_on(),
                               reason="no AMX-BF16 on this CPU, or SEQSERVE_AMX=0")


def without_amx(tmp_path: Path, script: str, *tensors):
    """What `script` computes from `tensors` with SEQSERVE_AMX=0, in a fresh interpreter
    (the switch is read when a library loads): the script finds the tensors as `args` and
    leaves its answer in `result`."""
    import subprocess
    import sys

    import torch

    torch.save(tensors, tmp_path / "args.pt")
    wrapper = ("import sys, torch\nargs = torch.load(sys.argv[1])\n" + script +
               "\ntorch.save(result, sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", wrapper, str(tmp_path / "args.pt"),
                    str(tmp_path / "result.pt")], check=True, timeout=300, cwd=REPO,
                   env={**os.environ, "SEQSERVE_AMX": "0"})
    return torch.load(tmp_path / "result.pt")


def tiny_model(arch: str = "llama") -> Path:
    """A tiny random-weight model of `arch` (written once, reused across runs)."""
    from worker_service.fixtures import make_model

    return make_model(MODELS / f"tiny-{arch}", arch=arch, size="tiny", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model("llama")


# The tiny Llama decodes its whole 1024-token context in well under a second on a fast
# CPU, so a test that cancels a request, or lets its deadline pass, while it is still
# decoding asks for more tokens than that from this copy of it, whose context alone is
# longer (a config change: its rotary positions need no table, its weights are the same).
LONG_CONTEXT = 32768


def long_context_model() -> Path:
    """The tiny Llama with max_position_embeddings = LONG_CONTEXT (written once)."""
    out = MODELS / "tiny-llama-long-context"
    if not out.exists():
        staging = Path(tempfile.mkdtemp(dir=MODELS, prefix=".long-context-"))
        shutil.copytree(tiny_model("llama"), staging, dirs_exist_ok=True)
        config = json.loads((staging / "config.json").read_text())
        config["max_position_embeddings"] = LONG_CONTEXT
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        try:
            staging.rename(out)
        except OSError:  # another process wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    return out


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
