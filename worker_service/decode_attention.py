"""Decoding attention over bfloat16 KV on CPU with a small C loop (`decode_attention.c`).

torch's CPU kernels read bfloat16 keys one query row at a time far below memory speed:
on this project's CPUs a decoding step over 30 rows of 300 slots (12 heads of 64) took
6.1 ms through SDPA in bfloat16, 2.7 ms with the KV in float32, and 1.5-1.6 ms through this
loop on one thread, which reads each row's keys and values once, only up to the row's
length (no padding), and converts them to float32 in registers. Replaying the issue-7 burst
in process: 5.7-6.2 s against 6.2-8.0 s with float32 KV.

The C file is compiled when the worker starts (`cc -O3 -march=native`, about 0.2 s) into a
temporary directory and loaded with ctypes: no torch headers, no build step at install.
With OpenMP it splits the (row, head) pairs over torch's own threads: 1.1 ms against 2.4
ms on one thread for the step above, and the in-process replay 5.0-5.8 s against 5.8-6.4.
Where no C compiler is found, or the build fails, `kernel()` is None and the worker keeps
half-precision KV in float32 instead (model_runner.resolve_kv_dtype).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# With OpenMP the loop runs on torch's own thread team, but only where torch's OpenMP is
# GNU libgomp (Linux wheels): the library then binds to the libgomp.so.1 already loaded.
# Another runtime beside torch's would bring a second team to fight over the cores.
OPENMP = "-fopenmp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_loaded: list = []  # [function or None] once tried


def _build() -> ctypes.CDLL | None:
    if os.environ.get("SEQSERVE_NATIVE_ATTENTION", "1") == "0":
        logger.info("native decode attention off (SEQSERVE_NATIVE_ATTENTION=0)")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("no C compiler found: half-precision KV is kept in float32 on CPU")
        return None
    attempts = [(*CFLAGS, OPENMP), CFLAGS] if _torch_uses_libgomp() else [CFLAGS]
    detail = ""
    with tempfile.TemporaryDirectory(prefix="seqserve-") as tmp:
        for i, flags in enumerate(attempts):
            lib = Path(tmp) / f"decode_attention{i}.so"
            try:
                subprocess.run([cc, *flags, "-o", str(lib), str(SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                # The mapping outlives the file: the directory may go once it is loaded.
                loaded = ctypes.CDLL(str(lib))
                logger.info("native decode attention built: %s %s", cc, " ".join(flags))
                return loaded
            except (OSError, subprocess.SubprocessError) as exc:
                detail = str(getattr(exc, "stderr", "") or exc).strip()[:500]
    logger.warning("could not build the native decode attention (%s); half-precision KV is "
                   "kept in float32 on CPU", detail)
    return None


def _torch_uses_libgomp() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def kernel():
    """The C function, built on first use; None where it cannot be built."""
    if not _loaded:
        lib = _build()
        fn = None
        if lib is not None:
            fn = lib.decode_attention_bf16
            fn.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, _I]
            fn.restype = ctypes.c_int
        _loaded.append(fn)
    return _loaded[0]


def supports(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether this query and these KV buffers can take the native path."""
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16
            and keys.dtype == torch.bfloat16 and keys.is_contiguous()
            and values.shape == keys.shape and values.is_contiguous()
            and kernel() is not None)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_start: int,
           ends: torch.Tensor, max_end: int, scale: float, window: int | None) -> torch.Tensor:
    """query [rows, heads, dim] (bfloat16); keys/values the group's whole buffers
    [row_capacity, kv_heads, slots, dim]; row i of the query is buffer row row_start + i
    and attends to its slots below ends[i] (int64, at most max_end), the last `window` of
    them when set. Returns [rows, heads, dim] bfloat16."""
    query = query.contiguous()
    rows, heads, dim = query.shape
    out = torch.empty_like(query)
    offset = row_start * keys.stride(0) * keys.element_size()
    status = kernel()(query.data_ptr(), keys.data_ptr() + offset, values.data_ptr() + offset,
                      out.data_ptr(), ends.data_ptr(), rows, heads, keys.shape[1], dim,
                      keys.stride(0), keys.stride(1), scale, window or 0, max_end)
    if status != 0:
        raise ValueError(f"native decode attention refused heads={heads} kv_heads="
                         f"{keys.shape[1]} dim={dim} (status {status})")
    return out
