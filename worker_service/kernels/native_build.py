"""Compiles the worker's small C libraries at start and loads them with ctypes.

No torch headers and no build step at install: `cc -O3 -march=native`, so the code is tuned
for the CPU it runs on. The libraries are kept in a cache directory (`SEQSERVE_KERNEL_CACHE`,
by default `$XDG_CACHE_HOME/seqserve/kernels` or `~/.cache/seqserve/kernels`; `0` turns it
off) under a key of the sources, the compiler, the flags and the CPU, so a worker starts
without compiling when one before it on this machine built the same code (the four
libraries take about 4 s of one core to compile). Where no C compiler is found, or the
build fails, the caller gets None and keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
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
    cc = compiler()
    if cc is None:
        logger.info("no C compiler found for %s: %s", source.name, without)
        return None
    attempts = [(*CFLAGS, OPENMP), CFLAGS] if _torch_uses_libgomp() else [CFLAGS]
    cache = _cache_dir()
    detail = ""
    with tempfile.TemporaryDirectory(prefix="seqserve-") as tmp:
        for i, flags in enumerate(attempts):
            cached = cache / f"{source.stem}-{_key(source, cc, flags)}.so" if cache else None
            if cached is not None and cached.exists():
                loaded = _load(cached, functions)
                if loaded is not None:
                    logger.info("%s loaded from %s", source.name, cached)
                    return loaded
            lib = Path(tmp) / f"{source.stem}{i}.so"
            try:
                compile_library(cc, flags, source, lib)
            except (OSError, subprocess.SubprocessError) as exc:
                detail = str(getattr(exc, "stderr", "") or exc).strip()[:500]
                continue
            loaded = _load(lib, functions)
            if loaded is None:
                detail = f"{lib.name} built but does not load or lacks a function"
                continue
            logger.info("%s built: %s %s", source.name, cc, " ".join(flags))
            if cached is not None:
                _store(lib, cached)
            return loaded
    logger.warning("could not build %s (%s): %s", source.name, detail, without)
    return None


def compiler() -> str | None:
    """The C compiler the worker builds with: $CC, else cc, else gcc; None if none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(cc: str, flags: tuple[str, ...], source: Path, lib: Path) -> None:
    """Compile `source` into the shared library `lib`; raises CalledProcessError (with the
    compiler's stderr) or TimeoutExpired when it does not build."""
    subprocess.run([cc, *flags, "-o", str(lib), str(source), "-lm"], check=True,
                   capture_output=True, text=True, timeout=120)


def _load(lib: Path, functions: Signatures) -> ctypes.CDLL | None:
    """`lib` loaded with `functions` declared; None if it does not load or lacks one. The
    mapping outlives the file: the file may go once it is loaded."""
    try:
        loaded = ctypes.CDLL(str(lib))
        for name, (argtypes, restype) in functions.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, restype
    except (OSError, AttributeError) as exc:
        logger.info("%s not usable (%s)", lib, exc)
        return None
    return loaded


def _cache_dir() -> Path | None:
    """Where built libraries are kept; None when the cache is off or cannot be made."""
    setting = os.environ.get("SEQSERVE_KERNEL_CACHE", "")
    if setting == "0":
        return None
    if setting:
        path = Path(setting)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "seqserve" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.info("no kernel cache at %s (%s): building each start", path, exc)
        return None
    return path


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def _key(source: Path, cc: str, flags: tuple[str, ...]) -> str:
    """What the library's bytes depend on: the source and the headers it includes from
    its own directory, the compiler (path and version), the flags, and the CPU that
    -march=native reads (its model name and feature flags)."""
    digest = hashlib.sha256()
    text = source.read_bytes()
    digest.update(text)
    for header in sorted(set(_INCLUDE.findall(text))):
        local = source.parent / header.decode()
        if local.exists():
            digest.update(header + local.read_bytes())
    digest.update(cc.encode() + b"\0" + " ".join(flags).encode())
    digest.update(_compiler_version(cc).encode())
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:20]


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() + platform.machine()
    fields = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in info.splitlines()
                              if line.split(":")[0].strip() in fields}))


def _store(lib: Path, cached: Path) -> None:
    """Copy `lib` into the cache under its final name in one rename, so that a worker
    starting beside this one reads either no file or the whole one."""
    try:
        with tempfile.NamedTemporaryFile(dir=cached.parent, prefix=".part-",
                                         delete=False) as part:
            part.write(lib.read_bytes())
        os.replace(part.name, cached)
    except OSError as exc:
        logger.info("could not keep %s in the kernel cache (%s)", lib.name, exc)


def _torch_uses_libgomp() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False
