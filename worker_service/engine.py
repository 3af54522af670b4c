"""Executes the scheduler's Step on the worker: release, regroup, prefill, decode, sample.

Free of gRPC: the servicer converts messages to the dataclasses of step.py and back.
Contrastive search, which needs more than one token's logits, is in contrastive.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from worker_service import kv_swap, regroup, sampling, step_checks
from worker_service.beam import BeamSearches
from worker_service.contrastive import CandidateTree, ContrastiveSearch
from worker_service.kv_arena import KVArena
from worker_service.kv_groups import KVGroup
from worker_service.kv_swap import SwapSpace
from worker_service.length_probe import LengthProbe
from worker_service.model_runner import ModelRunner
from worker_service.packed_batch import DecodeSegment, PackedBatch
from worker_service.prefix_cache import PrefixCache
from worker_service.sequence import SequenceState
from worker_service.step import Prefill, PrefillSpec, StepError, StepResult
from worker_service.urgent_steps import UrgentSteps

logger = logging.getLogger(__name__)


@dataclass
class SampledRow:
    """A greedy or sampled sequence whose next token comes from the logits of one token of
    the packed forward (its decoding token, or its prompt's last)."""

    seq: SequenceState
    token_index: int


@dataclass
class StepForward:
    """The step's packed forward and what its output is for."""

    batch: PackedBatch
    decodes: list[DecodeSegment] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)
    sampled: list[SampledRow] = field(default_factory=list)
    trees: list[CandidateTree] = field(default_factory=list)  # contrastive decoding rows


class Engine:
    """The worker's sequences and group caches."""

    urgent_steps = True  # it takes urgent Steps (urgent_steps.py)

    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache | None = None,
                 length_probe: LengthProbe | None = None, swap: SwapSpace | None = None,
                 arena: KVArena | None = None):
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.length_probe = length_probe
        self.swap = swap  # None: this worker does not swap (the scheduler recomputes)
        self.arena = arena  # where group buffers come from (None: torch's allocator)
        self.device = runner.device
        self.sequences: dict[int, SequenceState] = {}
        self.groups: list[KVGroup] = []
        self.group_of: dict[int, KVGroup] = {}
        self.contrastive = ContrastiveSearch(runner)
        self.beams = BeamSearches(self)
        self.urgent = UrgentSteps(self)

    # --- bookkeeping -----------------------------------------------------------------

    def reset(self) -> None:
        """Drop every sequence and the prefix cache (a scheduler (re)connects)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.length_probe is not None:
            self.length_probe.forget()
        self.drop_sequences()

    def drop_sequences(self) -> None:
        """Drop every sequence and its KV; cached prefixes stay (they belong to no one)."""
        self.urgent.clear()
        self.sequences.clear()
        self.groups.clear()
        self.group_of.clear()
        self.beams.clear()
        if self.swap is not None:
            self.swap.clear()

    def warm_up(self, num_tokens: int, chunk: int = 256, premap_bytes: int = 0) -> float:
        """Prefill `num_tokens` throwaway tokens in one forward, as the largest step the
        scheduler may send (max_num_batched_tokens), then drop them. As TGI's warm-up does, this
        shows at start that such a step fits in memory, and it maps the activation memory
        and loads the kernels of those shapes before the first request pays for them.
        On CPU it also maps `premap_bytes` of host memory for the heap (the prefix cache's
        blocks; group buffers come from the arena where there is one). Returns the seconds
        it took."""
        t0 = time.perf_counter()
        chunk = max(1, min(chunk, self.runner.facts.max_position_embeddings - 1))
        lengths = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
        group = KVGroup(self.runner.kv_shape, arena=self.arena)
        group.ensure_capacity(len(lengths), max(lengths) + 1)
        batch = PackedBatch(self.device, self.runner.layer_attention)
        for row, n in enumerate(lengths):
            group.add_empty_row(-1 - row, n + 1)
            batch.add_row(group, row, [0] * n, 0)
        hidden = self.runner.forward(batch)
        self.runner.logits(hidden[-len(lengths):])
        if self.device.type == "cpu" and premap_bytes > 0:
            # Map heap memory now: freed host memory stays mapped (host_memory.py), so the
            # first requests' prefix-cache blocks (and any group buffer that fits no arena
            # hole) reuse these pages instead of faulting in fresh ones.
            chunk = 16 << 20
            held = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(premap_bytes // chunk)]
            del held
        return time.perf_counter() - t0

    def _all_groups(self) -> list[KVGroup]:
        """The planned groups and those of urgent Steps that no plan has named yet."""
        return self.groups + self.urgent.side_groups()

    def kv_usage(self) -> tuple[int, int]:
        """(padded slots a forward reads, real KV tokens) over all groups."""
        groups = self._all_groups()
        slots = sum(g.padded_slots() for g in groups)
        tokens = sum(sum(g.lengths) for g in groups)
        return slots, tokens

    def allocated_bytes(self) -> int:
        return sum(g.allocated_bytes() for g in self._all_groups())

    def _copied(self) -> int:
        return sum(g.copied_bytes for g in self.groups)

    def release(self, *seq_ids: int) -> None:
        """Forget ended sequences and drop their rows, each group's at once (fewer rows
        move than one by one)."""
        rows = []
        for seq_id in seq_ids:
            self.urgent.forget(seq_id)
            if self.swap is not None and self.swap.drop(seq_id):
                continue  # it ended while swapped out
            self.sequences.pop(seq_id, None)
            group = self.group_of.pop(seq_id, None)
            if group is not None:
                rows.append((group, group.row_of(seq_id)))
        regroup.remove_rows_together(rows)

    # --- the step --------------------------------------------------------------------

    def step(self, release: list[int], prefill: list[PrefillSpec],
             plan: list[list[int]], chunks: dict[int, int] | None = None,
             finished: list[tuple[int, int, bool]] | None = None,
             swap_out: list[int] | None = None, swap_in: list[int] | None = None,
             prefetch: list[int] | None = None, unprefetch: list[int] | None = None
             ) -> StepResult:
        """`chunks`: sequence id -> prefill through token_ids[:end], for sequences created
        partly prefilled (PrefillSpec.prefill_end) in an earlier step. `finished`: (id,
        tokens generated, exact) of sequences that ended, for the length probe.
        `swap_out`: sequences whose KV goes to host memory after the release, `swap_in`:
        swapped-out ones that run again, `prefetch` and `unprefetch`: swapped-out ones
        whose KV is copied back to the device ahead of their swap_in, or no longer
        (kv_swap.py)."""
        self.urgent.run()  # posted before this Step began: they go first
        t0 = time.perf_counter()
        self.urgent.nested_seconds = 0.0
        result = StepResult()
        probe = self.length_probe
        for f in (finished or ()) if probe is not None else ():
            probe.finished(*f)
        for g in self.groups:
            g.copied_bytes = 0
        self.release(*self.beams.expand_release(release))
        plan = self.beams.expand_plan(plan)  # a beam request's rows beside it
        for sid in swap_out or ():
            self.urgent.forget(sid)
            kv_swap.swap_out(self, sid)
        restored = {}
        for sid in swap_in or ():
            restored[sid], was_prefetched = kv_swap.swap_in(self, sid)
            result.prefetched_swap_ins += was_prefetched
        if prefetch or unprefetch:
            kv_swap.prefetch(self, prefetch or [], unprefetch or [])
        new_ids = set(restored) | step_checks.new_sequences(prefill, self.sequences,
                                                            self.swap or ())
        chunks = chunks or {}
        live = self.urgent.adopt(plan)
        step_checks.check_plan(plan, live, new_ids)
        step_checks.check_chunks(chunks, live)
        self.create(prefill)
        for sid, end in chunks.items():
            self.sequences[sid].chunk_end = end
        groups, old_counts, dropped_bytes = regroup.regroup(self, plan, new_ids, restored)
        result.regroup_seconds = time.perf_counter() - t0
        self.run(groups, old_counts, result, between=self.urgent.between)
        if probe is not None:
            probe.train(1)  # after the step's tokens: at most one small minibatch a step
        result.regroup_bytes = self._copied() + dropped_bytes
        self.report(result, t0)
        # The worker's time for this Step, as the scheduler's pacing fits it, is its own.
        result.forward_seconds -= self.urgent.nested_seconds
        result.total_seconds -= self.urgent.nested_seconds
        return result

    def create(self, prefill: list[PrefillSpec]) -> None:
        """The Step's new sequences (checked already)."""
        for ns in prefill:
            n = len(ns.token_ids)
            self.sequences[ns.seq_id] = SequenceState(
                seq_id=ns.seq_id, token_ids=list(ns.token_ids), num_generated=ns.num_generated,
                params=ns.params, pin_tokens=ns.pin_tokens, prompt_len=n,
                chunk_end=ns.prefill_end or n)

    def report(self, result: StepResult, t0: float) -> None:
        """The engine's state after a Step, into its result."""
        result.kv_slots, result.kv_tokens = self.kv_usage()
        result.sequences = len(self.sequences)
        result.kv_allocated_bytes = self.allocated_bytes()
        if self.swap is not None:
            result.swapped_sequences, result.swap_bytes = len(self.swap), self.swap.used_bytes
            result.prefetched_sequences = self.swap.prefetched
        if self.arena is not None:
            result.arena_stats = (self.arena.compactions, self.arena.misses)
        pc = self.prefix_cache
        if pc is not None:
            st = pc.stats
            result.prefix_cache_bytes = pc.bytes_held
            result.prefix_stats = (st.queries, st.hits, st.hit_tokens, st.evictions)
        result.total_seconds = time.perf_counter() - t0

    # --- forwards --------------------------------------------------------------------

    def run(self, groups: list[KVGroup], old_counts: list[int], result: StepResult,
            between=None) -> None:
        """One packed forward over every row: rows whose KV holds their prompt decode (one
        token, or contrastive candidates), the others prefill their next chunk (the rows
        new in this step, rows [n_old, rows) of each group, start after a cached prefix).
        `between` may run between the forward's layers (urgent Steps)."""
        t = time.perf_counter()
        self._reserve(groups)
        result.regroup_seconds += time.perf_counter() - t
        t = time.perf_counter()
        for group, n_old in zip(groups, old_counts):
            for r in range(n_old, group.rows):
                if group.length(r) == 0:  # not a swapped-in row, which holds its KV
                    self._reuse_prefix(group, r, self._seq(group, r))
        result.prefix_cache_seconds += time.perf_counter() - t

        fwd = self._pack(groups, result)
        if not fwd.batch.num_tokens:
            return
        t = time.perf_counter()
        # The states read are the sampled tokens' (the forward may then skip the last
        # layer of the rest but for its KV), unless contrastive search keeps a prompt's
        # states or scores a tree's candidates. _pack appends sampled rows as it adds their
        # segments, so their token indices ascend, as the forward requires.
        index = [s.token_index for s in fwd.sampled]
        whole = fwd.trees or any(p.seq.contrastive for p in fwd.prefills)
        hidden = self.runner.forward(fwd.batch, None if whole else index, between)
        sampled = hidden[index] if whole else hidden
        logits = self.runner.logits(sampled) if fwd.sampled else None
        result.forward_seconds += time.perf_counter() - t
        predicted = ({} if self.length_probe is None else
                     self.length_probe.observe_prefills(fwd.prefills, sampled, index))
        for seg in fwd.decodes:
            seg.group.advance(seg.row_start, seg.row_end)
        t = time.perf_counter()
        for p in fwd.prefills:
            end = p.segment.kv_len
            p.segment.group.fill(p.segment.row, end)
            if self.prefix_cache is not None:
                # Each chunk's whole blocks at once: a request sharing the prefix can reuse
                # them before this prompt's last chunk.
                self.prefix_cache.insert(p.seq.token_ids[:end], p.segment.group,
                                         p.segment.row, p.seq.pin_tokens)
        result.prefix_cache_seconds += time.perf_counter() - t
        if fwd.sampled:
            self._emit([s.seq for s in fwd.sampled], logits, result)
        for tree in fwd.trees:
            self.contrastive.choose(tree, hidden, result)
        self.contrastive.first_tokens([p for p in fwd.prefills if p.seq.contrastive], hidden,
                                      result)
        self.beams.advance(result)
        for token in result.tokens if predicted else ():
            token.predicted_tokens = predicted.get(token.seq_id)

    def _pack(self, groups: list[KVGroup], result: StepResult) -> StepForward:
        """Lay out the step's tokens: per group, runs of greedy and sampled decoding rows
        as decode segments, each contrastive row's candidates as a tree, and each prefilling
        row's chunk from the first token its KV lacks (a row whose chunk is not due waits)."""
        fwd = StepForward(PackedBatch(self.device, self.runner.layer_attention))
        for group in groups:
            r = 0
            while r < group.rows:
                seq = self._seq(group, r)
                start = group.length(r)
                if start < seq.prompt_len:
                    if seq.chunk_end > start:
                        seg = fwd.batch.add_row(group, r, seq.token_ids[start:seq.chunk_end],
                                                start)
                        final = seq.chunk_end == seq.prompt_len
                        fwd.prefills.append(Prefill(seq, seg, final))
                        if final and not seq.contrastive:
                            last = seg.token_start + seg.num_tokens - 1
                            fwd.sampled.append(SampledRow(seq, last))
                    r += 1
                    continue
                if seq.contrastive:
                    fwd.trees.append(self.contrastive.add_candidates(fwd.batch, group, r, seq,
                                                                     result))
                    r += 1
                    continue
                end = r
                while end < group.rows and self._decodes_plainly(group, end):
                    end += 1
                seqs = [self._seq(group, x) for x in range(r, end)]
                seg = fwd.batch.add_decode(group, r, end, [s.next_input for s in seqs])
                fwd.sampled += [SampledRow(s, seg.token_start + i) for i, s in enumerate(seqs)]
                fwd.decodes.append(seg)
                r = end
        return fwd

    def _seq(self, group: KVGroup, row: int) -> SequenceState:
        return self.sequences[group.seq_ids[row]]

    def _decodes_plainly(self, group: KVGroup, row: int) -> bool:
        """Whether the row decodes one greedy or sampled token (its prompt is in its KV)."""
        seq = self._seq(group, row)
        return not seq.contrastive and group.length(row) >= seq.prompt_len

    def _reserve(self, groups: list[KVGroup]) -> None:
        """Grow buffers for this step's writes before any segment takes views of them (a
        prefilling row gets room for its whole prompt at once)."""
        for group in groups:
            need = 0
            for r in range(group.rows):
                seq = self._seq(group, r)
                extra = max(seq.params.top_k, 1) if seq.contrastive else 1
                need = max(need, max(group.length(r), seq.prompt_len) + extra + 1)
            group.ensure_capacity(group.rows, need)

    def _reuse_prefix(self, group: KVGroup, row: int, seq: SequenceState) -> None:
        """Copy the longest cached prefix into a new row, which then holds it: its prefill
        (whole or chunked) starts after it."""
        # Contrastive search needs the hidden state of every context token, which the
        # cache does not keep, so those sequences prefill in full.
        if self.prefix_cache is None or seq.contrastive:
            return
        blocks, reuse = self.prefix_cache.match(seq.token_ids)
        self.prefix_cache.copy_into(blocks, reuse, group, row)
        group.fill(row, reuse)
        seq.cached_tokens = reuse

    def _emit(self, seqs: list[SequenceState], logits: torch.Tensor, result: StepResult) -> None:
        """Greedy and sampled sequences: choose from their logits rows [len(seqs), V]."""
        t = time.perf_counter()
        seqs, logits = self.beams.take(seqs, logits)
        chosen = sampling.choose_tokens(logits, seqs)
        for s, token in zip(seqs, chosen):
            s.accept(token.token_id)
            s.next_input = token.token_id
            token.cached_tokens = s.cached_tokens
            result.tokens.append(token)
        result.sampling_seconds += time.perf_counter() - t
