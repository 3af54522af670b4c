"""Host memory on 2 MiB pages: fresh regions (the KV arena) and the model's weights.

A decoding step of a few rows streams every weight once, and on 4 KiB pages each page of
it costs a TLB miss: SmolLM2's 270 MB are 66 thousand pages a step. Linux's transparent
huge pages cover the same bytes with 2 MiB pages. Fresh regions ask for them before their
first write (`madvise(MADV_HUGEPAGE)`, honoured where the kernel's THP mode is "madvise"
or "always"); the weights, already written by the time they are prepacked, are collapsed
in place (`MADV_COLLAPSE`, Linux 6.1 on), which copies them onto huge pages inside the
kernel and frees the small ones, so the process never holds them twice. On this project's
CPU a decoding step of 1-16 rows took 1-5% less time with its weights on huge pages than
on a fresh copy on small ones, level at 64 rows and in prefill (docs/benchmarks.md,
session 49). Elsewhere (other kernels, THP off, no free 2 MiB pages, weights left in a
file's mapping) the memory stays on small pages: the same bytes, only slower.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

# Linux's transparent huge page size on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>
MADV_COLLAPSE = 25  # <sys/mman.h>, Linux 6.1


def _madvise(start: int, nbytes: int, advice: int) -> int:
    """madvise(2)'s errno for [start, start + nbytes) (0: done); ENOSYS off Linux."""
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), advice)
    except (OSError, AttributeError):
        return errno.ENOSYS
    return 0 if status == 0 else ctypes.get_errno()


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """`nbytes` of untouched host memory (uint8), starting on a 2 MiB boundary and marked
    for transparent huge pages where the kernel offers them, so the pages it faults in
    later are 2 MiB ones. A decoding step reads and writes one slot per row of buffers
    spread over gigabytes: with 4 KiB pages nearly every row costs a TLB miss
    (docs/benchmarks.md, session 28: 64 rows' decoding attention over 800 MB of KV,
    1.15-1.3x faster on huge pages). Returns the buffer and whether the kernel took the
    advice."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8), False
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[start:start + nbytes]
    status = _madvise(buffer.data_ptr(), nbytes, MADV_HUGEPAGE)
    if status != 0:
        logger.debug("no transparent huge pages for a fresh region (madvise: %s); 4 KiB "
                     "pages", errno.errorcode.get(status, status))
    return buffer, status == 0


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The host addresses [start, end) of `t`'s storage; None off the CPU, for an empty
    one, or where torch keeps it opaque (oneDNN's reordered weights)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
        return None
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    start = storage.data_ptr()
    return (start, start + storage.nbytes()) if storage.nbytes() else None


def collapse_onto_huge_pages(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Move the pages under `tensors` (CPU, strided) onto 2 MiB pages where the kernel
    can: each whole 2 MiB page that overlaps one of them is collapsed, neighbouring bytes
    included (they keep their contents and addresses). Returns (bytes of huge pages now
    under them, bytes asked for); (0, bytes) where the kernel cannot collapse (before 6.1,
    THP "never", no free 2 MiB pages). Takes about 0.25 s per 100 MB here."""
    pages: set[int] = set()
    for t in tensors:
        span = _storage_span(t)
        if span is not None:
            start, end = span
            pages.update(range(start // HUGE_PAGE, (end + HUGE_PAGE - 1) // HUGE_PAGE))
    asked = len(pages) * HUGE_PAGE
    done, failures = 0, {}
    for page in sorted(pages):
        status = _madvise(page * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE)
        if status == 0:
            done += HUGE_PAGE
        else:
            failures[status] = failures.get(status, 0) + 1
            # EINVAL also comes from one page (a file's mapping) on a kernel that collapses
            # the others, so only a missing madvise ends the loop early.
            if status == errno.ENOSYS:
                break
    if failures:
        logger.debug("MADV_COLLAPSE failed on %s", {errno.errorcode.get(e, e): n
                                                     for e, n in failures.items()})
    return done, asked


def weights_onto_huge_pages(model: torch.nn.Module, min_bytes: int = 64 << 10) -> int:
    """Collapse the pages under `model`'s parameters and buffers of at least `min_bytes`
    (the weights a step streams, not norms or biases) onto 2 MiB pages, and log how much
    of them made it; returns those bytes. Call it after the weights reach their final form
    (prepacking replaces them)."""
    seen: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel shard
        span = _storage_span(t)
        if span is not None and span[1] - span[0] >= min_bytes:
            seen.setdefault(span[0], t)
    if not seen:
        return 0
    done, asked = collapse_onto_huge_pages(seen.values())
    logger.info("weights on 2 MiB pages: %d of %d MB%s", done >> 20, asked >> 20,
                "" if done else " (none collapsed: they stay on 4 KiB pages, decoding a "
                "few percent slower; collapsing needs Linux 6.1 or later with transparent "
                "huge pages not set to never)")
    return done
