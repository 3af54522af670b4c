"""Weights moved onto 2 MiB pages in place (worker_service/huge_pages.py)."""

from __future__ import annotations

import ctypes
import sys

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


def test_tensors_it_cannot_collapse_are_left_alone():
    """Off the CPU's strided memory (a meta tensor) or empty: nothing asked."""
    assert collapse_onto_huge_pages([torch.empty(1 << 20, device="meta"),
                                     torch.empty(0)]) == (0, 0)


@needs_collapse
def test_the_runner_puts_its_weights_on_huge_pages(llama_dir):
    """A CPU model's weights of 64 KiB and more (the tiny Llama's embedding and output
    layer in bfloat16) are collapsed once it is loaded. Only those in a mapping that can
    hold a 2 MiB page are: in the worker every one (its heap, host_memory.py); here, in
    pytest's process, glibc may have given a small one a mapping of its own."""
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(str(llama_dir), dtype="bfloat16")
    assert runner.weight_huge_page_bytes >= HUGE_PAGE
    weights = [t for t in list(runner.model.parameters()) + list(runner.model.buffers())
               if t.numel() * t.element_size() >= 64 << 10]
    assert any(_huge_kb_of_mapping(t.data_ptr()) > 0 for t in weights)
