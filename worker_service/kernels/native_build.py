"""Compiles the worker's small C libraries at start and loads them with ctypes.

No torch headers and no build step at install: `cc -O3 -march=native` (about 0.3 s) into a
temporary directory, so the code is tuned for the CPU it runs on. Where no C compiler is
found, or the build fails, the caller gets None and keeps its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# With OpenMP the loops run on torch's own thread team, but only where torch's OpenMP is
# GNU libgomp (Linux wheels): the library then binds to the libgomp.so.1 already loaded.
# Another runtime beside torch's would bring a second team to fight over the cores.
OPENMP = "-fopenmp"


Signatures = dict[str, tuple[list, type | None]]  # function -> (argtypes, restype)
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float  # pointer, int64_t, float


def build(source: Path, switch: str, without: str, functions: Signatures) -> ctypes.CDLL | None:
    """Compile and load `source` and declare its `functions`; None if the environment
    variable `switch` is 0, or no compiler or build works. `without` says, for the log,
    what the worker does then."""
    if os.environ.get(switch, "1") == "0":
        logger.info("%s off (%s=0): %s", source.name, switch, without)
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("no C compiler found for %s: %s", source.name, without)
        return None
    attempts = [(*CFLAGS, OPENMP), CFLAGS] if _torch_uses_libgomp() else [CFLAGS]
    detail = ""
    with tempfile.TemporaryDirectory(prefix="seqserve-") as tmp:
        for i, flags in enumerate(attempts):
            lib = Path(tmp) / f"{source.stem}{i}.so"
            try:
                subprocess.run([cc, *flags, "-o", str(lib), str(source), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                # The mapping outlives the file: the directory may go once it is loaded.
                loaded = ctypes.CDLL(str(lib))
                for name, (argtypes, restype) in functions.items():
                    fn = getattr(loaded, name)
                    fn.argtypes, fn.restype = argtypes, restype
                logger.info("%s built: %s %s", source.name, cc, " ".join(flags))
                return loaded
            except (OSError, subprocess.SubprocessError) as exc:
                detail = str(getattr(exc, "stderr", "") or exc).strip()[:500]
    logger.warning("could not build %s (%s): %s", source.name, detail, without)
    return None


def _torch_uses_libgomp() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False
