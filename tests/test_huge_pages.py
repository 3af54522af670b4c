"""Weights moved onto 2 MiB pages in place (worker_service/huge_pages.py)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

from worker_service.huge_pages import HUGE_PAGE, MADV_COLLAPSE, collapse_onto_huge_pages


def _kernel_collapses() -> bool:
    """Whether this kernel collapses written anonymous memory (MADV_COLLAPSE, Linux 6.1),
    asked directly on a buffer of the test's own."""
    if not sys.platform.startswith("linux"):
        return False
    probe = torch.ones(3 * HUGE_PAGE, dtype=torch.uint8)
    start = -probe.data_ptr() % HUGE_PAGE + probe.data_ptr()
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(HUGE_PAGE), MADV_COLLAPSE) == 0


needs_collapse = pytest.mark.skipif(not _kernel_collapses(),
                                    reason="this kernel does not collapse pages (MADV_COLLAPSE)")


def _huge_kb_of_mapping(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping holding `address`."""
    current = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_collapse
def test_written_memory_moves_onto_huge_pages_and_keeps_its_contents():
    """Every whole 2 MiB page under the tensor is collapsed: the mapping holding it gains
    that many huge-page bytes, and the values and the address stay."""
    t = torch.arange(5 * HUGE_PAGE // 4, dtype=torch.int32)
    expected = t.clone()
    address = t.data_ptr()
    before = _huge_kb_of_mapping(address)
    done, asked = collapse_onto_huge_pages([t])
    first = -address % HUGE_PAGE + address
    whole = (address + t.numel() * 4 - first) // HUGE_PAGE  # pages wholly inside t
    assert asked >= done >= whole * HUGE_PAGE > 0
    assert _huge_kb_of_mapping(address) - before >= whole * HUGE_PAGE // 1024
    assert t.data_ptr() == address and torch.equal(t, expected)


@needs_collapse
def test_a_page_it_cannot_collapse_does_not_stop_the_others(tmp_path):
    """A tensor in a file's mapping (safetensors leaves some weights there) cannot be
    collapsed; one at a higher address, asked for after it, still is."""
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot, shared, private_anonymous = 3, 0x01, 0x22  # read|write; MAP_SHARED; PRIVATE|ANON
    low = 0x2000_0000_0000  # hints far below the mappings torch and Python made
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(2 * HUGE_PAGE))
    fd = os.open(path, os.O_RDWR)
    file_at = libc.mmap(low, 2 * HUGE_PAGE, prot, shared, fd, 0)
    os.close(fd)
    anon_at = libc.mmap(low + 64 * HUGE_PAGE, 5 * HUGE_PAGE, prot, private_anonymous, -1, 0)
    try:
        if not file_at < anon_at < 2**63:
            pytest.skip("the kernel placed the mappings elsewhere than hinted")
        in_file = torch.frombuffer((ctypes.c_char * (2 * HUGE_PAGE)).from_address(file_at),
                                   dtype=torch.uint8)
        anonymous = torch.frombuffer((ctypes.c_char * (5 * HUGE_PAGE)).from_address(anon_at),
                                     dtype=torch.uint8)
        anonymous.fill_(1)
        done, asked = collapse_onto_huge_pages([in_file, anonymous])
        assert done >= 5 * HUGE_PAGE  # all of the anonymous buffer
        assert done < asked  # the file's pages were asked for first and refused
    finally:
        libc.munmap(file_at, 2 * HUGE_PAGE)
        libc.munmap(anon_at, 5 * HUGE_PAGE)


def test_tensors_it_cannot_collapse_are_left_alone():
    """Off the CPU's strided memory (a meta tensor) or empty: nothing asked."""
    assert collapse_onto_huge_pages([torch.empty(1 << 20, device="meta"),
                                     torch.empty(0)]) == (0, 0)


# The worker's start, as worker_service/main.py makes it: glibc's heap for every allocation
# (host_memory.py), then the model. In pytest's own process glibc may give a weight a
# mapping of its own too small for a 2 MiB page.
RUNNER_SCRIPT = """
import json, sys
from worker_service.host_memory import keep_freed_memory
keep_freed_memory()
from worker_service.model_runner import ModelRunner
runner = ModelRunner(sys.argv[1], dtype="bfloat16")
weights = [t for t in list(runner.model.parameters()) + list(runner.model.buffers())
           if t.numel() * t.element_size() >= 64 << 10]
huge = [huge_kb_of_mapping(t.data_ptr()) for t in weights]
print(json.dumps({"bytes": runner.weight_huge_page_bytes, "weights": len(weights),
                  "huge_kb": huge}))
"""


@needs_collapse
def test_the_runner_puts_its_weights_on_huge_pages(llama_dir):
    """A CPU model's weights of 64 KiB and more (the tiny Llama's embedding and output
    layer in bfloat16) are on 2 MiB pages once a worker has loaded it."""
    import inspect
    import json
    import subprocess

    helper = inspect.getsource(_huge_kb_of_mapping).replace("_huge_kb_of_mapping",
                                                             "huge_kb_of_mapping")
    out = subprocess.run([sys.executable, "-c", helper + RUNNER_SCRIPT, str(llama_dir)],
                         check=True, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bytes"] >= HUGE_PAGE and got["weights"] >= 2, got
    assert all(kb > 0 for kb in got["huge_kb"]), got
