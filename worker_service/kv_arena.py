"""Host memory for the KV groups' buffers: one region, mapped when the worker starts.

A group's buffers grow by reallocation (a new, larger buffer, the rows copied over). From
glibc's heap, a growing group's new buffer often fits none of the holes that freed
buffers left among the prefix cache's blocks, so the heap grows into pages never touched,
and on this project's machines each fresh 4 KiB page costs some 5 us to fault in
(docs/benchmarks.md, session 23: 0.85 GB faulted in one Mooncake run, 1.7-2.5 s of
reallocation). Here the groups' buffers come from one region the worker owns and maps at
start, as vLLM's CPU backend allocates its KV space at start, and the prefix cache keeps
the heap to itself. The region is option.kv_cache_bytes (the KV tokens the scheduler
admits) times option.kv_arena_headroom (the padding and growth room of the groups'
buffers, see kv_arena()). Each buffer takes one extent, first fit; where no hole is long enough
but the free bytes are, the held extents are moved down to close the holes, and only a
buffer larger than the free bytes comes from the heap instead (still correct, only
slower; the first such miss is logged). Only the CPU worker has one
for its groups: on a GPU torch's caching allocator keeps freed device memory for reuse
already. The swap space (kv_swap.py) keeps its host copies in an arena of its own, pinned
on a GPU.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from seqserve_common.config import ServingConfig
from worker_service.huge_pages import huge_page_buffer

logger = logging.getLogger(__name__)

# Extents start at multiples of this: a cache line, and a multiple of every dtype's size.
ALIGN = 64


class Movable(Protocol):
    def rebind(self) -> None:
        """Re-make the views of an extent whose offset the arena has just changed."""


@dataclass(eq=False)
class Extent:
    """Bytes [offset, offset + nbytes) of the arena, held for `owner` (whose `rebind` the
    arena calls after moving them). The arena changes `offset` when it closes holes."""

    offset: int
    nbytes: int  # a multiple of the arena's align
    owner: weakref.ref | None = None


class KVArena:
    """`capacity_bytes` of host memory carved into extents, each a multiple of `align`
    bytes long. `prefault`: write every page now, at start, so that none faults later;
    `pinned`: page-locked for a GPU's copies (the driver maps it at once). `before_move`
    runs before held extents move (to wait for device copies queued on them)."""

    def __init__(self, capacity_bytes: int, align: int = ALIGN, prefault: bool = True,
                 pinned: bool = False, before_move: Callable[[], None] | None = None):
        self.align = align
        self.capacity_bytes = max(0, capacity_bytes - capacity_bytes % align)
        self.before_move = before_move
        self.huge_pages = False  # whether the kernel was asked for 2 MiB pages, and agreed
        if pinned:
            self.buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.buffer, self.huge_pages = huge_page_buffer(self.capacity_bytes)
            if prefault:
                self.buffer.zero_()
        # The holes, as (offset, length), sorted by offset; neighbours are always merged.
        self._holes: list[tuple[int, int]] = [(0, self.capacity_bytes)] if self.capacity_bytes else []
        self._held: set[Extent] = set()
        # Extents of owners collected by the garbage collector, which may run on any
        # thread or inside this class's own methods: they wait here (a deque's append is
        # atomic) and are given back by the next call on the compute thread.
        self._returned: collections.deque[Extent] = collections.deque()
        self.misses = 0  # buffers that fitted nowhere (taken from the heap instead)
        self.compactions = 0  # times the holes were closed to make room

    @property
    def holes(self) -> list[tuple[int, int]]:
        self._give_returned()
        return list(self._holes)

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - sum(length for _, length in self.holes)

    def take(self, nbytes: int, owner: Movable | None = None) -> Extent | None:
        """A new extent of `nbytes`: the first hole that fits; where none does but the
        free bytes would, the held extents are moved down first (their owners re-make
        their views). None where the free bytes are too few."""
        size = max(self.align, -(-nbytes // self.align) * self.align)
        self._give_returned()
        if not any(length >= size for _, length in self._holes):
            if sum(length for _, length in self._holes) < size:
                self.misses += 1
                if self.misses == 1:
                    logger.info("KV arena: a %d-byte buffer does not fit (%d of %d bytes in "
                                "use); group buffers then come from the heap, slower to map",
                                nbytes, self.used_bytes, self.capacity_bytes)
                return None
            self._compact()
        for i, (offset, length) in enumerate(self._holes):
            if length >= size:
                if length == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (offset + size, length - size)
                extent = Extent(offset, size, weakref.ref(owner) if owner is not None else None)
                self._held.add(extent)
                return extent
        raise AssertionError("no hole after closing them all")  # free bytes were counted

    def give(self, extent: Extent) -> None:
        """Return an extent `take` gave (on the compute thread)."""
        self._give_returned()
        self._give(extent)

    def give_later(self, extent: Extent) -> None:
        """Return an extent from any thread (a finalizer): given back by the next call."""
        self._returned.append(extent)

    def _give_returned(self) -> None:
        while self._returned:
            self._give(self._returned.popleft())

    def _give(self, extent: Extent) -> None:
        if extent not in self._held:
            raise ValueError(f"extent at {extent.offset} of {extent.nbytes} bytes is not held: "
                             "given back twice, or not from this arena")
        self._held.discard(extent)
        offset, size = extent.offset, extent.nbytes
        i = bisect.bisect_left(self._holes, (offset, 0))
        before = self._holes[i - 1] if i else None
        after = self._holes[i] if i < len(self._holes) else None
        start, end = offset, offset + size
        if after and after[0] == end:
            end += after[1]
            del self._holes[i]
        if before and before[0] + before[1] == start:
            start = before[0]
            i -= 1
            del self._holes[i]
        self._holes.insert(i, (start, end - start))

    def view(self, extent: Extent) -> torch.Tensor:
        """An extent's bytes (uint8)."""
        return self.buffer[extent.offset:extent.offset + extent.nbytes]

    def _compact(self) -> None:
        """Move every held extent down against the one before it (memmove: the ranges
        may overlap), then tell each live owner; one hole is left, at the end. Runs with
        the garbage collector paused so that no owner's finalizer gives an extent back
        while the extents move."""
        self.compactions += 1
        logger.debug("KV arena: closing %d holes (%d of %d bytes in use)", len(self._holes),
                      self.used_bytes, self.capacity_bytes)
        if self.before_move is not None:
            self.before_move()
        base = self.buffer.data_ptr()
        paused = gc.isenabled()
        gc.disable()
        try:
            at, moved = 0, []
            for extent in sorted(self._held, key=lambda e: e.offset):
                if extent.offset != at:
                    ctypes.memmove(base + at, base + extent.offset, extent.nbytes)
                    extent.offset = at
                    moved.append(extent)
                at += extent.nbytes
            self._holes = [(at, self.capacity_bytes - at)] if at < self.capacity_bytes else []
            for extent in moved:
                owner = extent.owner() if extent.owner is not None else None
                if owner is not None:
                    owner.rebind()
        finally:
            if paused:
                gc.enable()


def kv_arena(cfg: ServingConfig, device: torch.device) -> KVArena | None:
    """The worker's arena, on CPU only (see above): option.kv_cache_bytes times
    option.kv_arena_headroom. The scheduler admits kv_cache_bytes of KV tokens, but the
    groups' buffers are padded (rows to the longest, within max_sparsity) and grown with
    headroom (KVGroup.ensure_capacity), so they need more; a buffer past the arena comes
    from the heap, whose fresh pages fault as they are first written (on a prompt-heavy
    trace, Mooncake on SmolLM2, an arena of 1x spent twice the time regrouping of 1.5x:
    docs/benchmarks.md, session 27)."""
    if device.type != "cpu":
        return None
    arena = KVArena(int(cfg.kv_cache_bytes * cfg.kv_arena_headroom))
    logger.info("KV arena: %d bytes mapped (option.kv_cache_bytes %d x kv_arena_headroom %g), "
                "%s", arena.capacity_bytes, cfg.kv_cache_bytes, cfg.kv_arena_headroom,
                "on transparent huge pages" if arena.huge_pages else "on 4 KiB pages")
    return arena

