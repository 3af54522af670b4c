"""Host memory for the KV groups' buffers: one region, mapped when the worker starts.

A group's buffers grow by reallocation (a new, larger buffer, the rows copied over). From
glibc's heap, a growing group's new buffer often fits none of the holes that freed
buffers left among the prefix cache's blocks, so the heap grows into pages never touched,
and on this project's machines each fresh 4 KiB page costs some 5 us to fault in
(docs/benchmarks.md, session 23: 0.85 GB faulted in one Mooncake run, 1.7-2.5 s of
reallocation). Here the groups' buffers come from one region the worker owns and maps at
start, as vLLM's CPU backend allocates its KV space at start, and the prefix cache keeps
the heap to itself. Each buffer takes one extent, first fit; a buffer that fits nowhere
comes from the heap instead (still correct, only slower), and the first such miss is
logged. Only the CPU worker has one: on a GPU torch's caching allocator keeps freed
device memory for reuse already.
"""

from __future__ import annotations

import bisect
import logging

import torch

logger = logging.getLogger(__name__)

# Extents start at multiples of this: a cache line, and a multiple of every dtype's size.
ALIGN = 64


class KVArena:
    """`capacity_bytes` of host memory carved into extents for group buffers."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < ALIGN:
            raise ValueError(f"a KV arena of {capacity_bytes} bytes is too small; give it at "
                             f"least {ALIGN}")
        self.capacity_bytes = capacity_bytes - capacity_bytes % ALIGN
        # zeros, not empty: writing every page maps the whole region now, at start.
        self.buffer = torch.zeros(self.capacity_bytes, dtype=torch.uint8)
        # The holes, as (offset, length), sorted by offset; neighbours are always merged.
        self._holes: list[tuple[int, int]] = [(0, self.capacity_bytes)]
        self.used_bytes = 0
        self.misses = 0  # buffers that fitted no hole (taken from the heap instead)

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(self._holes)

    def take(self, nbytes: int) -> int | None:
        """The offset of a new extent of `nbytes` (first fit), or None where no hole is
        long enough."""
        size = _aligned(nbytes)
        for i, (offset, length) in enumerate(self._holes):
            if length >= size:
                if length == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (offset + size, length - size)
                self.used_bytes += size
                return offset
        self.misses += 1
        if self.misses == 1:
            logger.info("KV arena: a %d-byte group buffer fits none of its holes (%d of %d "
                        "bytes in use); such buffers come from the heap, slower to map",
                        nbytes, self.used_bytes, self.capacity_bytes)
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Return the extent `take` gave at `offset` for `nbytes`."""
        size = _aligned(nbytes)
        i = bisect.bisect_left(self._holes, (offset, 0))
        before = self._holes[i - 1] if i else None
        after = self._holes[i] if i < len(self._holes) else None
        if (before and before[0] + before[1] > offset) or (after and offset + size > after[0]):
            raise ValueError(f"extent [{offset}, {offset + size}) overlaps a hole: given "
                             "back twice, or never taken")
        start, end = offset, offset + size
        if after and after[0] == end:
            end += after[1]
            del self._holes[i]
        if before and before[0] + before[1] == start:
            start = before[0]
            i -= 1
            del self._holes[i]
        self._holes.insert(i, (start, end - start))
        self.used_bytes -= size

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset:offset + nbytes]


def kv_arena(capacity_bytes: int, device: torch.device) -> KVArena | None:
    """The worker's arena for option.kv_cache_bytes: on CPU only (see above)."""
    return KVArena(capacity_bytes) if device.type == "cpu" else None


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
