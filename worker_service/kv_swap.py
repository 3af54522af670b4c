"""Preempted sequences whose KV waits in host memory until they run again.

When the scheduler preempts a sequence it either drops its KV (recompute: the sequence
is prefilled again later) or swaps it out (StepRequest.swap_out): the worker copies the
row's KV to host memory, keeps the sequence's state (its tokens and the next input) here,
and frees the row; `swap_in` copies it back into a group and the sequence decodes on. The
scheduler chooses per victim from what this module measures at start: the copy rate
between the device and host memory, and the prefill rate (docs/scheduling.md). It may
also name a swapped-out sequence it expects to run again soon in `prefetch`: its KV is
copied back to the device ahead of its swap_in, on a side stream on a GPU, so that the
Step that re-admits it does not wait for the copy (FastServe's proactive swapping).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from worker_service.kv_arena import Extent, KVArena
from worker_service.kv_groups import DetachedKV, KVGroup, KVShape
from worker_service.sequence import SequenceState
from worker_service.step import StepError

if TYPE_CHECKING:
    from worker_service.engine import Engine

# Host memory kept for swapped-out KV where option.swap_space_bytes is -1 (auto): vLLM's
# default swap space on an accelerator; none on CPU, whose KV budget is host memory already.
AUTO_SWAP_BYTES = 4 << 30


def swap_capacity(option_bytes: int, device: torch.device) -> int:
    """The swap space in bytes for option.swap_space_bytes (-1: auto)."""
    if option_bytes >= 0:
        return option_bytes
    return 0 if device.type == "cpu" else AUTO_SWAP_BYTES


def swap_space(option_bytes: int, device: torch.device) -> SwapSpace | None:
    """The worker's swap space for option.swap_space_bytes (None where it is 0): pinned
    host memory where the device is a GPU."""
    capacity = swap_capacity(option_bytes, device)
    return SwapSpace(capacity, pinned=device.type == "cuda", device=device) if capacity else None


@dataclass(frozen=True)
class SwapRates:
    """What the worker measured at start for the scheduler's choice (0: not measured)."""

    copy_bytes_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0


@dataclass
class Swapped:
    """A swapped-out sequence: its worker state, and its KV (`slots` tokens) in an extent
    of the swap space's arena."""

    seq: SequenceState
    slots: int
    shape: KVShape
    arena: KVArena = field(repr=False)
    extent: Extent | None = None  # set once taken (the arena needs its owner first)
    # A copy of `kv` on the device, made ahead of its swap_in (prefetch), and on a GPU the
    # event its side-stream copy records when done.
    device_kv: DetachedKV | None = None
    ready: torch.cuda.Event | None = None

    @property
    def kv(self) -> DetachedKV:
        """Its KV in the swap space, as views made at each use: where the arena has moved
        the extent since, they follow it."""
        return DetachedKV.carve(self.arena.view(self.extent), self.shape, self.slots)

    def rebind(self) -> None:
        """Nothing to re-make when the arena moves the extent: `kv` is made at each use."""


class SwapSpace:
    """The swapped-out sequences, their KV in one host buffer of `capacity_bytes`.

    The buffer is allocated once, pinned where the device is a GPU (copies then run as
    DMA, without holding the host: vLLM's swap space is pinned too). torch's pinned-memory
    cache rounds each allocation up to a power of two and keeps what is freed, so pinning
    every swap on its own could hold up to twice the space; one buffer is rounded once.
    Each swapped row takes one extent of it (a KVArena: first fit; where no hole is long
    enough but the free bytes are, the extents are moved down to close the holes), to the
    byte: so the byte account the scheduler keeps (slots x bytes per token, no padding) is
    the only limit.

    Copies into and out of the buffer are queued on the device's stream without waiting
    (non_blocking). That is safe because the host never touches the buffer's bytes except
    when closing holes, which waits for the device first, and a freed extent is written
    again only by a later copy on the same stream."""

    def __init__(self, capacity_bytes: int, pinned: bool = False,
                 device: torch.device = torch.device("cpu")):
        self.pinned = pinned
        self.device = device  # where prefetched copies go
        self._stream: torch.cuda.Stream | None = None  # prefetches' side stream (GPU)
        # Extents to the byte (each row's bytes are a multiple of its dtype's size, so every
        # offset is too); pages mapped when first written (pinned: at once, by the driver).
        self.arena = KVArena(capacity_bytes, align=1, prefault=False, pinned=pinned,
                             before_move=torch.cuda.synchronize if pinned else None)
        self.capacity_bytes = self.arena.capacity_bytes
        self.buffer = self.arena.buffer
        self._held: dict[int, Swapped] = {}

    @property
    def used_bytes(self) -> int:
        return self.arena.used_bytes

    @property
    def compactions(self) -> int:
        """Times the holes were closed (tests read it)."""
        return self.arena.compactions

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def store(self, seq: SequenceState, group: KVGroup, row: int) -> None:
        """Copy a row's KV into the buffer; the sequence's state waits with it."""
        slots = group.length(row)
        nbytes = slots * group.shape.bytes_per_token
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes do not fit the swap space "
                             f"({self.capacity_bytes - self.used_bytes} of "
                             f"{self.capacity_bytes} left)")
        entry = Swapped(seq, slots, group.shape, self.arena)
        entry.extent = self.arena.take(nbytes, owner=entry)
        try:
            group.copy_out_into(row, entry.kv, non_blocking=self.pinned)
        except BaseException:
            self.arena.give(entry.extent)
            raise
        self._held[seq.seq_id] = entry

    def take(self, seq_id: int) -> Swapped:
        """Hand back a sequence; its KV stays readable until the next `store` (which
        queues behind the copy that reads it, a prefetch's included)."""
        entry = self._held.pop(seq_id)
        self._await_prefetch(entry)
        self.arena.give(entry.extent)
        return entry

    @property
    def prefetched(self) -> int:
        """Sequences whose KV has a copy on the device."""
        return sum(e.device_kv is not None for e in self._held.values())

    def prefetch(self, seq_id: int) -> None:
        """Start copying a sequence's KV to the device (a second copy: the host one stays
        until `take`). On a GPU the copy runs on a side stream, after what the device's
        stream has queued so far (the swap-out that filled the host copy, say), beside the
        Step's own work."""
        entry = self._held[seq_id]
        if entry.device_kv is not None:
            return
        buffer = torch.empty(entry.extent.nbytes, dtype=torch.uint8, device=self.device)
        kv = DetachedKV.carve(buffer, entry.shape, entry.slots)
        if self.device.type == "cuda":
            # Allocated on the device's stream, which waits for the copy's event before it
            # reads the copy or frees it (_await_prefetch): no cross-stream reuse.
            self._stream = self._stream or torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for dst, src in zip(kv.tensors(), entry.kv.tensors()):
                    dst.copy_(src, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self._stream)
        else:
            for dst, src in zip(kv.tensors(), entry.kv.tensors()):
                dst.copy_(src)
        entry.device_kv = kv

    def unprefetch(self, seq_id: int) -> None:
        """Free a sequence's device copy; it stays swapped out in host memory."""
        entry = self._held[seq_id]
        self._await_prefetch(entry)
        entry.device_kv = None

    def _await_prefetch(self, entry: Swapped) -> None:
        """Order the device's stream after `entry`'s prefetch copy: whatever it queues
        next (reading the copy, freeing it, or writing the host extent again) comes after."""
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            entry.ready = None

    def drop(self, seq_id: int) -> bool:
        """Forget a swapped-out sequence (it ended or was cancelled while out)."""
        if seq_id not in self._held:
            return False
        self.take(seq_id)
        return True

    def clear(self) -> None:
        for seq_id in list(self._held):
            self.take(seq_id)


def swap_out(engine: Engine, seq_id: int) -> None:
    """Copy a sequence's KV to host memory and free its row; its state waits with it."""
    seq = engine.sequences.get(seq_id)
    if engine.swap is None:
        raise StepError(f"swap_out of sequence {seq_id}: this worker has no swap space "
                        "(option.swap_space_bytes is 0); preempt it by recompute")
    if seq is None:
        raise StepError(f"swap_out of sequence {seq_id}, which this worker does not run")
    group = engine.group_of[seq_id]
    row = group.row_of(seq_id)
    if seq.beam or seq.contrastive or seq.next_input is None or \
            group.length(row) < seq.prompt_len:
        raise StepError(f"sequence {seq_id} cannot be swapped out: only greedy or sampled "
                        "sequences past their prompt can; preempt it by recompute")
    try:
        engine.swap.store(seq, group, row)
    except ValueError as e:
        raise StepError(f"swap_out of sequence {seq_id} needs more room: {e}; preempt it "
                        "by recompute") from None
    del engine.sequences[seq_id]
    del engine.group_of[seq_id]
    group.remove_row(row)


def swap_in(engine: Engine, seq_id: int) -> tuple[DetachedKV, bool]:
    """Make a swapped-out sequence live again; returns its KV for `regroup.regroup` to
    place (the device copy where it was prefetched), and whether it was."""
    if engine.swap is None or seq_id not in engine.swap:
        raise StepError(f"swap_in of sequence {seq_id}, which this worker does not hold "
                        "swapped out; re-admit it by prefill")
    if seq_id in engine.sequences:
        raise StepError(f"sequence {seq_id} is swapped in and running at once")
    entry = engine.swap.take(seq_id)
    engine.sequences[seq_id] = entry.seq
    if entry.device_kv is not None:
        return entry.device_kv, True
    return entry.kv, False


def prefetch(engine: Engine, prefetch_ids: list[int], unprefetch_ids: list[int]) -> None:
    """Free the device copies of `unprefetch_ids`, then start those of `prefetch_ids`
    (StepRequest.unprefetch, prefetch)."""
    for name, ids in (("unprefetch", unprefetch_ids), ("prefetch", prefetch_ids)):
        for sid in ids:
            if engine.swap is None or sid not in engine.swap:
                raise StepError(f"{name} of sequence {sid}, which this worker does not hold "
                                "swapped out")
    for sid in unprefetch_ids:
        engine.swap.unprefetch(sid)
    for sid in prefetch_ids:
        engine.swap.prefetch(sid)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_rate(device: torch.device, host: torch.Tensor, repeats: int = 3) -> float:
    """Bytes per second of a copy from `device` to `host` (uint8: the swap space's buffer,
    pinned or not as it is kept) and back, each direction counted once: the median of
    `repeats` round trips after one unmeasured."""
    src = torch.empty(host.numel(), dtype=torch.uint8, device=device).random_(0, 255)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        src.copy_(host, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * host.numel() / statistics.median(times[1:])


def measure_prefill_rate(engine, tokens: int) -> float:
    """Prompt tokens per second of one `tokens`-token prefill step (Engine.warm_up's
    prompts of up to 256 tokens, after the warm-up, so kernels are loaded): what
    recomputing a preempted sequence costs per token."""
    device = engine.device
    _sync(device)
    t0 = time.perf_counter()
    engine.warm_up(tokens)
    _sync(device)
    return tokens / (time.perf_counter() - t0)


def measure_rates(engine, prefill_tokens: int, copy_bytes: int = 32 << 20) -> SwapRates:
    """Both rates of a worker whose engine has warmed up and has swap space (Info reports
    them); the copies go through the swap space's own buffer."""
    host = engine.swap.buffer[:min(copy_bytes, engine.swap.capacity_bytes)]
    return SwapRates(measure_copy_rate(engine.device, host),
                     measure_prefill_rate(engine, prefill_tokens))
