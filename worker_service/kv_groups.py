"""Padded KV caches, one per group of sequences, and the transformers Cache adapter over them.

Layout: each group holds, per layer, a preallocated key and value buffer of shape
[row_capacity, kv_heads, length_capacity, head_dim] (views of one buffer for all layers
where their shapes agree). Row r holds one sequence whose
tokens sit at slots 0..length-1 (start-aligned, so the padding is at the end of short
rows). That is the same padding cost as left padding, but rows of different groups can
be merged or split without shifting anything, and new keys are written in place at each
row's own next slot, so a decoding step never copies the cache. A step's forward
(`packed_batch.py`) writes and reads these buffers in place; per-row masks make padded
results equal unpadded ones.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker_service.kv_arena import Extent, KVArena

logger = logging.getLogger(__name__)

LENGTH_ALIGN = 64  # slots are allocated in multiples of this, with headroom on growth


@dataclass(frozen=True)
class KVShape:
    """Per-layer key and value shapes of one token, learned from the model at load time."""

    key_heads: tuple[int, ...]
    key_dims: tuple[int, ...]
    value_heads: tuple[int, ...]
    value_dims: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # Whether attention may read slots past a row's length (masked, as SDPA over a padded
    # group does): new buffers are then zero-filled, since a masked slot still meets a zero
    # weight in probs @ values and 0 * NaN from stale memory would be NaN. The native
    # bfloat16 loops read only each row's own slots, so their buffers skip the fill.
    reads_padding: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.key_heads)

    @property
    def uniform(self) -> bool:
        """Every layer's keys and values have one shape (heads, head size): a group then
        holds them all in one buffer, and moves a row's KV in one copy, not one a layer."""
        return len(set(self.key_heads + self.value_heads)) == 1 and \
            len(set(self.key_dims + self.value_dims)) == 1

    @property
    def bytes_per_token(self) -> int:
        elems = sum(h * d for h, d in zip(self.key_heads, self.key_dims))
        elems += sum(h * d for h, d in zip(self.value_heads, self.value_dims))
        return elems * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class DetachedKV:
    """KV slots of one group row copied out of the group, sharing no storage with it: a
    prefix cache block, or a swapped-out row in host memory. `kv` [2, layers, heads,
    slots, dim] where the layers' shapes agree (one copy out and one back), else
    `layer_kv`, (keys, values) [heads, slots, dim] per layer."""

    slots: int
    kv: torch.Tensor | None
    layer_kv: list[tuple[torch.Tensor, torch.Tensor]] | None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is not None:
            return self.kv[0, layer], self.kv[1, layer]
        return self.layer_kv[layer]

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv] if self.kv is not None else [t for pair in self.layer_kv for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @classmethod
    def carve(cls, buffer: torch.Tensor, shape: KVShape, slots: int) -> DetachedKV:
        """`slots` tokens of KV in the layout `KVGroup.copy_out` gives, as views of
        `buffer` (uint8, exactly slots x shape.bytes_per_token long)."""
        if shape.uniform:
            heads, dim = shape.key_heads[0], shape.key_dims[0]
            kv = carve(buffer, shape.dtype, [(2, shape.num_layers, heads, slots, dim)])[0]
            return cls(slots, kv, None)
        tensors = carve(buffer, shape.dtype, [
            s for kh, kd, vh, vd in zip(shape.key_heads, shape.key_dims, shape.value_heads,
                                        shape.value_dims)
            for s in ((kh, slots, kd), (vh, slots, vd))])
        return cls(slots, None, list(zip(tensors[0::2], tensors[1::2])))


def carve(buffer: torch.Tensor, dtype: torch.dtype, shapes: list[tuple[int, ...]]
          ) -> list[torch.Tensor]:
    """Tensors of `shapes`, one after another, as views of `buffer` (uint8, at least as
    long as they are together)."""
    counts = [math.prod(shape) for shape in shapes]
    data = buffer[:sum(counts) * dtype.itemsize].view(dtype)
    return [part.view(shape) for part, shape in zip(data.split(counts), shapes)]


def _round_up(n: int, align: int) -> int:
    return max(align, -(-n // align) * align)


@dataclass
class KVGroup:
    """The padded KV cache of one group: rows are sequences, slots are token positions."""

    shape: KVShape
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # Where the shape is uniform: [2, layers, row_capacity, heads, length_capacity, dim],
    # of which keys[layer] and values[layer] are views ([0, layer] and [1, layer]).
    kv: torch.Tensor | None = field(default=None, repr=False)
    seq_ids: list[int] = field(default_factory=list)  # row -> sequence id
    # row -> KV tokens held. Only the methods below change it, each together with the
    # buffers' contents, so a length always names slots that hold the row's KV.
    _lengths: list[int] = field(default_factory=list, repr=False)
    copied_bytes: int = 0  # bytes moved by growth, merges and removals (for metrics)
    # Where the buffers come from (kv_arena.py); None: torch's allocator.
    arena: KVArena | None = field(default=None, repr=False, compare=False)
    # The buffers' arena extent, and what gives it back when the group is collected (a
    # weakref.finalize, so a dropped group cannot leak it; reallocation detaches it and
    # gives the extent back at once).
    _extent: Extent | None = field(default=None, repr=False, compare=False)
    _release: weakref.finalize | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return len(self.seq_ids)

    @property
    def lengths(self) -> tuple[int, ...]:
        """KV tokens held by each row (read-only: a copy)."""
        return tuple(self._lengths)

    def length(self, row: int) -> int:
        return self._lengths[row]

    @property
    def row_capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def length_capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def max_length(self) -> int:
        return max(self._lengths, default=0)

    def padded_slots(self) -> int:
        """Slots that a forward over this group reads: rows x longest row."""
        return self.rows * self.max_length

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def row_of(self, seq_id: int) -> int:
        return self.seq_ids.index(seq_id)

    def ensure_capacity(self, rows: int, length: int) -> None:
        """Grow the buffers (with headroom) so `rows` rows of `length` slots fit. Rows
        double where the arena's free bytes hold twice the doubled buffer, else (and off
        the arena) grow by half: in a burst a group gains rows at every prefill chunk, and
        each growth copies every row (SmolLM2's Azure code run: 0.3 GB of such copies
        doubling, 0.67 GB at 1.5x; docs/benchmarks.md, session 47)."""
        if rows <= self.row_capacity and length <= self.length_capacity:
            return
        new_len = self.length_capacity
        if length > self.length_capacity:
            new_len = _round_up(max(length, int(length * 1.25)), LENGTH_ALIGN)
        new_rows = max(rows, self.row_capacity)
        if rows > self.row_capacity:
            new_rows = max(rows, int(self.row_capacity * 1.5), 4)
            doubled = max(rows, 2 * self.row_capacity, 4)
            arena = self.arena
            if arena is not None and 2 * doubled * new_len * self.shape.bytes_per_token <= (
                    arena.capacity_bytes - arena.used_bytes):
                new_rows = doubled
        self._reallocate(new_rows, new_len)

    def trim(self) -> None:
        """Give memory back when the buffers are far larger than the rows need."""
        need_len = _round_up(int(self.max_length * 1.25) + 1, LENGTH_ALIGN)
        need_rows = max(self.rows, 4)
        if self.length_capacity > 2 * need_len or self.row_capacity > 2 * need_rows:
            self._reallocate(min(self.row_capacity, int(need_rows * 1.5)),
                             min(self.length_capacity, need_len))

    def _reallocate(self, new_rows: int, new_len: int) -> None:
        s = self.shape
        keep_len = min(self.max_length, new_len)
        if s.uniform:
            shapes = [(2, s.num_layers, new_rows, s.key_heads[0], new_len, s.key_dims[0])]
        else:
            shapes = [shape for layer in range(s.num_layers) for shape in (
                (new_rows, s.key_heads[layer], new_len, s.key_dims[layer]),
                (new_rows, s.value_heads[layer], new_len, s.value_dims[layer]))]
        old_release, old_extent = self._release, self._extent
        tensors = self._buffers(shapes)
        copied = self.rows * keep_len
        if s.uniform:
            kv = tensors[0]
            if self.kv is not None and self.rows:
                held = sum(self._lengths)
                if held < 0.75 * copied:
                    # Rows of uneven lengths: each only up to its own length, not the
                    # longest's (one copy a row, where it saves a quarter or more).
                    for r, n in enumerate(self._lengths):
                        kv[:, :, r, :, :n] = self.kv[:, :, r, :, :n]
                    copied = held
                else:
                    kv[:, :, : self.rows, :, :keep_len] = self.kv[:, :, : self.rows, :, :keep_len]
            self.kv = kv
            new_keys, new_values = list(kv[0].unbind(0)), list(kv[1].unbind(0))
        else:
            new_keys, new_values = tensors[0::2], tensors[1::2]
            if self.keys and self.rows:
                for layer in range(s.num_layers):
                    new_keys[layer][: self.rows, :, :keep_len] = \
                        self.keys[layer][: self.rows, :, :keep_len]
                    new_values[layer][: self.rows, :, :keep_len] = \
                        self.values[layer][: self.rows, :, :keep_len]
        self.copied_bytes += copied * s.bytes_per_token
        self.keys, self.values = new_keys, new_values
        if old_release is not None and old_release.detach() is not None:
            self.arena.give(old_extent)  # the old buffers' rows are copied: free again

    def _buffers(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """New tensors of `shapes`, from one arena extent where the arena has room
        (zero-filled where attention reads padding, see KVShape)."""
        s = self.shape
        nbytes = sum(math.prod(shape) for shape in shapes) * s.dtype.itemsize
        # Taking may move the arena's extents, this group's current one too (rebind).
        extent = self.arena.take(nbytes, self) if self.arena is not None else None
        self._extent = extent
        if extent is None:
            self._release = None
            alloc = torch.zeros if s.reads_padding else torch.empty
            return [alloc(shape, dtype=s.dtype, device=s.device) for shape in shapes]
        self._release = weakref.finalize(self, self.arena.give_later, extent)
        tensors = self._carve(shapes)
        if s.reads_padding:
            for t in tensors:
                t.zero_()
        return tensors

    def _carve(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        return carve(self.arena.view(self._extent), self.shape.dtype, shapes)

    def rebind(self) -> None:
        """Re-make the buffers' views after the arena moved their extent (kv_arena.py)."""
        if self.kv is not None:
            self.kv = self._carve([tuple(self.kv.shape)])[0]
            self.keys, self.values = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))
            return
        shapes = [tuple(t.shape) for pair in zip(self.keys, self.values) for t in pair]
        tensors = self._carve(shapes)
        self.keys, self.values = tensors[0::2], tensors[1::2]

    def _copy_slots(self, dst_row: int, src: KVGroup, src_row: int, start: int,
                    end: int) -> None:
        """Slots [start, end) of every layer's keys and values, from src's row src_row to
        this group's row dst_row: one copy where both hold one buffer."""
        if self.kv is not None and src.kv is not None:
            self.kv[:, :, dst_row, :, start:end] = src.kv[:, :, src_row, :, start:end]
            return
        for layer in range(self.shape.num_layers):
            self.keys[layer][dst_row, :, start:end] = src.keys[layer][src_row, :, start:end]
            self.values[layer][dst_row, :, start:end] = src.values[layer][src_row, :, start:end]

    def add_empty_row(self, seq_id: int, reserve_length: int) -> int:
        """Append a row for a new sequence (filled by its prefill); returns the row."""
        self.ensure_capacity(self.rows + 1, reserve_length)
        self.seq_ids.append(seq_id)
        self._lengths.append(0)
        return self.rows - 1

    def add_row_from(self, other: KVGroup, other_row: int) -> int:
        """Copy one sequence's KV from another group into a new row here."""
        length = other._lengths[other_row]
        self.ensure_capacity(self.rows + 1, length + 1)
        row = self.rows
        self._copy_slots(row, other, other_row, 0, length)
        self.seq_ids.append(other.seq_ids[other_row])
        self._lengths.append(length)
        self.copied_bytes += length * self.shape.bytes_per_token
        return row

    def copy_out(self, row: int, start: int, end: int,
                 device: torch.device | None = None) -> DetachedKV:
        """A copy of slots [start, end) of a row, on `device` (the group's by default)."""
        device = device or self.shape.device

        def copy(src: torch.Tensor) -> torch.Tensor:
            if device == src.device:
                return src.clone(memory_format=torch.contiguous_format)
            return src.to(device, copy=True)

        if self.kv is not None:
            return DetachedKV(end - start, copy(self.kv[:, :, row, :, start:end]), None)
        return DetachedKV(end - start, None, [(copy(k[row, :, start:end]), copy(v[row, :, start:end]))
                                              for k, v in zip(self.keys, self.values)])

    def _row_views(self, row: int, start: int, end: int) -> list[torch.Tensor]:
        """Slots [start, end) of a row, as views in the order of DetachedKV.tensors()."""
        if self.kv is not None:
            return [self.kv[:, :, row, :, start:end]]
        return [t[row, :, start:end] for pair in zip(self.keys, self.values) for t in pair]

    def copy_out_into(self, row: int, kv: DetachedKV, non_blocking: bool = False) -> None:
        """Copy slots [0, kv.slots) of a row into `kv`'s tensors (the swap space's buffer).
        `non_blocking`: queue a copy to pinned host memory without waiting for it."""
        for dst, src in zip(kv.tensors(), self._row_views(row, 0, kv.slots)):
            dst.copy_(src, non_blocking=non_blocking)

    def copy_in(self, row: int, start: int, kv: DetachedKV, n: int,
                non_blocking: bool = False) -> None:
        """Write the first `n` slots of `kv` into slots [start, start + n) of a row (its
        length is the caller's to set). `non_blocking`: as in copy_out_into."""
        for dst, src in zip(self._row_views(row, start, start + n), kv.tensors()):
            dst.copy_(src[..., :n, :], non_blocking=non_blocking)

    def add_row_with(self, seq_id: int, kv: DetachedKV, reserve_length: int,
                     non_blocking: bool = False) -> int:
        """Append a row for `seq_id` holding the KV of `kv` (a swapped-out sequence coming
        back); returns the row."""
        row = self.add_empty_row(seq_id, max(reserve_length, kv.slots + 1))
        self.copy_in(row, 0, kv, kv.slots, non_blocking)
        self._lengths[row] = kv.slots
        self.copied_bytes += kv.slots * self.shape.bytes_per_token
        return row

    def copy_within(self, src_row: int, dst_row: int, start: int) -> None:
        """Row `dst_row` becomes a copy of row `src_row`, which holds the same KV at slots
        below `start` already (beam search forks a beam into the row of one that ended:
        only the slots past their common prefix are copied)."""
        length = self._lengths[src_row]
        start = min(start, length, self._lengths[dst_row])
        self._copy_slots(dst_row, self, src_row, start, length)
        self._lengths[dst_row] = length
        self.copied_bytes += (length - start) * self.shape.bytes_per_token

    def remove_row(self, row: int) -> None:
        """Drop a row; the last row moves into its place so the rows stay contiguous."""
        self.remove_rows([row])

    def remove_rows(self, rows: Iterable[int]) -> None:
        """Drop several rows at once; rows kept past the new row count move into the holes
        so the rows stay contiguous. Together, only those rows move: one by one, a last
        row could move into a hole and then be dropped itself, or move twice."""
        drop = set(rows)
        keep = self.rows - len(drop)
        holes = sorted(r for r in drop if r < keep)
        movers = [r for r in range(keep, self.rows) if r not in drop]
        for hole, src in zip(holes, movers):
            length = self._lengths[src]
            self._copy_slots(hole, self, src, 0, length)
            self.seq_ids[hole] = self.seq_ids[src]
            self._lengths[hole] = length
            self.copied_bytes += length * self.shape.bytes_per_token
        del self.seq_ids[keep:]
        del self._lengths[keep:]

    def advance(self, row_start: int, row_end: int) -> None:
        """Rows [row_start, row_end) each had one token's KV written at their next slot
        (a decoding forward)."""
        for row in range(row_start, row_end):
            self._lengths[row] += 1

    def fill(self, row: int, length: int) -> None:
        """Row `row` holds KV at slots 0..length-1 (a prefill, or a prefix-cache copy and
        the prefill of the rest, wrote them)."""
        assert length >= self._lengths[row], "a row's KV is only ever extended"
        self._lengths[row] = length

    def keep_candidate(self, row: int, slot: int) -> None:
        """Keep the KV at `slot`, written past the row's length, as the row's next token:
        contrastive search scores its candidates at slots length.. and keeps one."""
        next_slot = self._lengths[row]
        if slot != next_slot:
            for layer in range(self.shape.num_layers):
                self.keys[layer][row, :, next_slot] = self.keys[layer][row, :, slot]
                self.values[layer][row, :, next_slot] = self.values[layer][row, :, slot]
        self._lengths[row] = next_slot + 1
