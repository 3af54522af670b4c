"""Keep freed host memory in the process instead of returning it to the kernel.

A prefill forward over a few thousand tokens makes activations of tens of megabytes, and
KV buffers of a group run to a hundred megabytes a layer. glibc serves allocations above
its mmap threshold (at most 32 MB) with fresh pages from the kernel and unmaps them on
free, so every such tensor of every step pays page faults again (on this project's CPUs
about five times the cost of writing the memory). Turning mmap off for allocations
(M_MMAP_MAX = 0) and never trimming the heap keeps those pages mapped for the next step.
On the 64-request benchmark burst replayed in process (docs/benchmarks.md), raising the
threshold cut page faults from 0.6-0.8 million to 0.4 million (bf16 KV); with float32 KV,
whose per-layer buffers pass 32 MB, turning mmap off cut them from 190 thousand to about
a thousand. The price: the worker's resident memory
stays at its peak, as a preallocated KV cache would (vLLM allocates its whole KV space at
start).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
TOP_PAD = 64 << 20
TRIM_THRESHOLD = -1  # never trim the heap (mallopt(3): -1 disables trimming)


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above; returns whether it applied (glibc on Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here; host allocator left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_MAX, 0), (M_TOP_PAD, TOP_PAD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    if not ok:
        logger.debug("mallopt refused a setting; host allocator partly tuned")
    return ok
