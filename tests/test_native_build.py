"""native_build's cache of compiled libraries: a second build of the same code loads the
kept library without compiling; a changed source or included header, or a kept file that
does not load, compiles again; SEQSERVE_KERNEL_CACHE=0 compiles every time."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from worker_service.kernels import native_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

FUNCTIONS = {"answer": ([], ctypes.c_int)}


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A source with a local header, a cache directory, and a compiler that logs each
    compile it is asked for (not `--version`)."""
    (tmp_path / "value.h").write_text("#define VALUE 41\n")
    source = tmp_path / "answer.c"
    source.write_text('#include "value.h"\nint answer(void) { return VALUE + 1; }\n')
    log = tmp_path / "compiles.log"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$@" >> {log}\n'
                  f'exec {shutil.which("cc")} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SEQSERVE_KERNEL_CACHE", str(tmp_path / "cache"))

    def build() -> int:
        lib = native_build.build(source, "SEQSERVE_TEST_ANSWER", "no answer", FUNCTIONS)
        assert lib is not None
        return lib.answer()

    def compiles() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    return tmp_path, build, compiles


def test_a_second_build_loads_the_kept_library(setup):
    tmp_path, build, compiles = setup
    assert build() == 42 and compiles() == 1
    assert build() == 42 and compiles() == 1
    assert len(list((tmp_path / "cache").glob("answer-*.so"))) == 1


def test_a_changed_source_or_header_compiles_again(setup):
    tmp_path, build, compiles = setup
    assert build() == 42
    (tmp_path / "value.h").write_text("#define VALUE 1\n")
    assert build() == 2 and compiles() == 2
    (tmp_path / "answer.c").write_text('#include "value.h"\nint answer(void) { return 7; }\n')
    assert build() == 7 and compiles() == 3


def test_a_kept_file_that_does_not_load_is_rebuilt(setup):
    tmp_path, build, compiles = setup
    build()
    (kept,) = (tmp_path / "cache").glob("answer-*.so")
    kept.write_bytes(b"not a shared library")
    assert build() == 42 and compiles() == 2
    assert kept.read_bytes()[:4] == b"\x7fELF"


def test_the_cache_can_be_turned_off(setup, monkeypatch):
    tmp_path, build, compiles = setup
    monkeypatch.setenv("SEQSERVE_KERNEL_CACHE", "0")
    build()
    build()
    assert compiles() == 2 and not (tmp_path / "cache").exists()


def test_the_key_names_the_cpu_and_the_flags(setup, monkeypatch):
    tmp_path, _, _ = setup
    source = tmp_path / "answer.c"
    plain = native_build._key(source, "cc", native_build.CFLAGS)
    assert native_build._key(source, "cc", (*native_build.CFLAGS, "-fopenmp")) != plain
    assert native_build._cpu_identity()  # /proc/cpuinfo's model name and flags
    monkeypatch.setattr(native_build, "_cpu_identity", lambda: "another CPU")
    assert native_build._key(source, "cc", native_build.CFLAGS) != plain


def test_every_kernel_source_ships_with_the_package():
    """A non-editable install (the Docker image's) carries only the package data listed in
    pyproject.toml, and a kernel whose source is missing silently falls back."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    kernels = Path(native_build.__file__).parent
    listed = tomllib.loads((kernels.parents[1] / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["worker_service.kernels"]
    assert sorted(listed) == sorted(p.name for p in kernels.iterdir()
                                    if p.suffix in (".c", ".h"))


@pytest.mark.parametrize("source", sorted(p.name for p in Path(native_build.__file__).parent
                                          .glob("*.c")))
def test_every_kernel_source_compiles(source, tmp_path):
    """With the worker's own flags, on whatever CPU runs the tests: a library that does
    not build is not an error at run time (the worker falls back, and its tests skip), so
    without this a broken source would pass unnoticed."""
    kernels = Path(native_build.__file__).parent
    try:
        native_build.compile_library(native_build.compiler(),
                                     (*native_build.CFLAGS, native_build.OPENMP),
                                     kernels / source, tmp_path / "lib.so")
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"{source} does not compile:\n{exc.stderr[-2000:]}")


def _kernel_libraries() -> list[tuple[str, dict]]:
    """(source file name, the functions its loader declares) for every kernel library."""
    from worker_service.kernels import (bf16_weights, dpbf16_linear, fused_layers, greedy,
                                        native_attention, step_layers)

    found = [(m.SOURCE.name, m.FUNCTIONS) for m in (bf16_weights, dpbf16_linear, fused_layers,
                                                    greedy, native_attention, step_layers)]
    return found + [(native_attention.TILED_SOURCE.name, native_attention.TILED_FUNCTIONS)]


# Instruction sets the libraries must build and load for whichever the serving CPU has:
# x86-64 with SSE2 only, AVX2 (Zen 3 and older), AVX512 with BF16 and no AMX (as Zen 4),
# AMX (Sapphire Rapids). A function defined only inside one ISA's block leaves the whole library
# unloadable on the others, and the worker falls back without a test failing elsewhere.
TARGETS = ("x86-64", "x86-64-v3", "cooperlake", "sapphirerapids")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_library_declares_its_functions_on_every_instruction_set(target, tmp_path):
    """Compiled for `target` (loading needs no such CPU: nothing runs at load), each
    library has every function its Python loader declares. Unoptimized: the instruction
    set alone decides which blocks are compiled."""
    kernels = Path(native_build.__file__).parent
    given = {"-march=native": f"-march={target}", "-O3": "-O0"}
    flags = tuple(given.get(f, f) for f in native_build.CFLAGS) + (native_build.OPENMP,)
    missing = []
    for source, functions in _kernel_libraries():
        lib = tmp_path / f"{Path(source).stem}-{target}.so"
        try:
            native_build.compile_library(native_build.compiler(), flags, kernels / source, lib)
        except subprocess.CalledProcessError as exc:
            if "march" in exc.stderr:
                pytest.skip(f"this compiler does not know -march={target}")
            pytest.fail(f"{source} does not compile for {target}:\n{exc.stderr[-2000:]}")
        loaded = ctypes.CDLL(str(lib))
        missing += [f"{source}: {name}" for name in functions if not hasattr(loaded, name)]
    assert not missing, f"built for {target}, these functions are missing: {missing}"
