"""Preempted sequences whose KV waits in host memory until they run again.

When the scheduler preempts a sequence it either drops its KV (recompute: the sequence
is prefilled again later) or swaps it out (StepRequest.swap_out): the worker copies the
row's KV to host memory, keeps the sequence's state (its tokens and the next input) here,
and frees the row; `swap_in` copies it back into a group and the sequence decodes on. The
scheduler chooses per victim from what this module measures at start: the copy rate
between the device and host memory, and the prefill rate (docs/scheduling.md).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_service.kv_groups import DetachedKV
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


@dataclass(frozen=True)
class SwapRates:
    """What the worker measured at start for the scheduler's choice (0: not measured)."""

    copy_bytes_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0


@dataclass
class Swapped:
    """A swapped-out sequence: its worker state and its KV in host memory."""

    seq: SequenceState
    kv: DetachedKV


class SwapSpace:
    """The swapped-out sequences, within `capacity_bytes` of host memory.

    The copies live in pageable memory, not pinned: torch's pinned-memory cache rounds each
    block up to a power of two and keeps freed blocks, so swaps of ever new lengths could
    hold up to twice the swap space pinned. A pinned pool of capacity_bytes carved into
    token blocks (vLLM's way) would copy faster; it is not built."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._held: dict[int, Swapped] = {}
        self.used_bytes = 0

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def put(self, seq: SequenceState, kv: DetachedKV) -> None:
        self._held[seq.seq_id] = Swapped(seq, kv)
        self.used_bytes += kv.nbytes

    def take(self, seq_id: int) -> Swapped:
        entry = self._held.pop(seq_id)
        self.used_bytes -= entry.kv.nbytes
        return entry

    def drop(self, seq_id: int) -> bool:
        """Forget a swapped-out sequence (it ended or was cancelled while out)."""
        if seq_id not in self._held:
            return False
        self.take(seq_id)
        return True

    def clear(self) -> None:
        self._held.clear()
        self.used_bytes = 0


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
    nbytes = group.length(row) * group.shape.bytes_per_token
    if not engine.swap.fits(nbytes):
        raise StepError(f"swap_out of sequence {seq_id} needs {nbytes} bytes; the swap "
                        f"space has {engine.swap.capacity_bytes - engine.swap.used_bytes} of "
                        f"{engine.swap.capacity_bytes} left")
    engine.swap.put(seq, group.copy_out(row, 0, group.length(row), torch.device("cpu")))
    del engine.sequences[seq_id]
    del engine.group_of[seq_id]
    group.remove_row(row)


def swap_in(engine: Engine, seq_id: int) -> DetachedKV:
    """Make a swapped-out sequence live again; returns its KV for `_regroup` to place."""
    if engine.swap is None or seq_id not in engine.swap:
        raise StepError(f"swap_in of sequence {seq_id}, which this worker does not hold "
                        "swapped out; re-admit it by prefill")
    if seq_id in engine.sequences:
        raise StepError(f"sequence {seq_id} is swapped in and running at once")
    entry = engine.swap.take(seq_id)
    engine.sequences[seq_id] = entry.seq
    return entry.kv


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_rate(device: torch.device, nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """Bytes per second of a copy from `device` to host memory (pageable, as SwapSpace
    keeps it) and back, each direction counted once: the median of `repeats` round trips
    after one unmeasured."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src)
        src.copy_(host)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:])


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


def measure_rates(engine, prefill_tokens: int) -> SwapRates:
    """Both rates of a worker whose engine has warmed up (Info reports them)."""
    return SwapRates(measure_copy_rate(engine.device),
                     measure_prefill_rate(engine, prefill_tokens))
