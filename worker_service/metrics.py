"""Prometheus metrics of a worker (namespace seqserve_worker_)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    """What one worker exports; a registry of its own so tests can run several in-process."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.steps = Counter("seqserve_worker_steps_total", "Steps executed", registry=r)
        self.urgent_between_layers = Counter(
            "seqserve_worker_urgent_steps_between_layers_total", "Urgent Steps run between "
            "two layers of another Step's forward (the others ran before a Step began)",
            registry=r)
        self.forward = Histogram("seqserve_worker_forward_seconds",
                                 "Model forward time per step", buckets=_STEP_BUCKETS, registry=r)
        self.sampling = Histogram("seqserve_worker_sampling_seconds",
                                  "Token selection time per step", buckets=_STEP_BUCKETS, registry=r)
        self.regroup = Histogram("seqserve_worker_regroup_seconds",
                                 "KV regrouping time per step", buckets=_STEP_BUCKETS, registry=r)
        self.prefix_cache = Histogram("seqserve_worker_prefix_cache_seconds",
                                      "Prefix-cache look-up, copy and insert time per step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.regroup_bytes = Counter("seqserve_worker_regroup_bytes_total",
                                     "KV bytes copied when groups changed", registry=r)
        self.tokens = Counter("seqserve_worker_generated_tokens_total",
                              "Tokens produced", registry=r)
        self.sequences = Gauge("seqserve_worker_sequences", "Sequences held", registry=r)
        self.groups = Gauge("seqserve_worker_groups", "KV groups held", registry=r)
        self.kv_slots = Gauge("seqserve_worker_kv_padded_slots",
                              "KV slots read per step, padding included", registry=r)
        self.kv_tokens = Gauge("seqserve_worker_kv_tokens", "KV tokens of sequences", registry=r)
        self.prefix_queries = Counter("seqserve_worker_prefix_cache_queries_total",
                                      "New sequences looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("seqserve_worker_prefix_cache_hits_total",
                                   "Look-ups that reused at least one cached block", registry=r)
        self.prefix_hit_tokens = Counter("seqserve_worker_prefix_cache_hit_tokens_total",
                                         "Prompt tokens whose KV came from the prefix cache",
                                         registry=r)
        self.prefix_evictions = Counter("seqserve_worker_prefix_cache_evictions_total",
                                        "Blocks evicted from the prefix cache", registry=r)
        self.prefix_bytes = Gauge("seqserve_worker_prefix_cache_bytes",
                                  "Bytes held by the prefix cache", registry=r)
        self.swapped = Gauge("seqserve_worker_swapped_sequences",
                             "Sequences swapped out to host memory", registry=r)
        self.swap_bytes = Gauge("seqserve_worker_swap_bytes",
                                "Bytes of KV the swap space holds", registry=r)
        self.prefetched = Gauge("seqserve_worker_prefetched_sequences",
                                "Swapped-out sequences whose KV has been copied back to the "
                                "device ahead of their swap-in", registry=r)
        self.prefetched_swap_ins = Counter(
            "seqserve_worker_prefetched_swap_ins_total",
            "Swap-ins whose KV was on the device already (prefetched)", registry=r)
        self._last_stats = None
        self.kv_allocated = Gauge("seqserve_worker_kv_allocated_bytes",
                                  "Bytes allocated for group KV buffers", registry=r)
        self.arena_compactions = Counter("seqserve_worker_kv_arena_compactions_total",
                                         "Times the KV arena moved its buffers to close holes",
                                         registry=r)
        self.arena_misses = Counter("seqserve_worker_kv_arena_misses_total",
                                    "Group buffers larger than the KV arena's free bytes, "
                                    "taken from the heap", registry=r)
        self._last_arena = (0, 0)

    def dropped_all(self) -> None:
        """The engine dropped every sequence (a Reset, or the lease ran out)."""
        for gauge in (self.sequences, self.kv_tokens, self.swapped, self.swap_bytes,
                      self.prefetched):
            gauge.set(0)

    def observe_step(self, result, num_groups: int) -> None:
        """`result`: the engine's StepResult, which also carries its state after the step."""
        self.steps.inc()
        if result.between_layers:
            self.urgent_between_layers.inc()
        self.forward.observe(result.forward_seconds)
        self.sampling.observe(result.sampling_seconds)
        self.regroup.observe(result.regroup_seconds)
        self.prefix_cache.observe(result.prefix_cache_seconds)
        self.regroup_bytes.inc(result.regroup_bytes)
        self.tokens.inc(len(result.tokens))
        self.sequences.set(result.sequences)
        self.groups.set(num_groups)
        self.kv_slots.set(result.kv_slots)
        self.kv_tokens.set(result.kv_tokens)
        self.kv_allocated.set(result.kv_allocated_bytes)
        self.swapped.set(result.swapped_sequences)
        self.swap_bytes.set(result.swap_bytes)
        self.prefetched.set(result.prefetched_sequences)
        self.prefetched_swap_ins.inc(result.prefetched_swap_ins)
        if result.arena_stats is not None:
            # The arena lives as long as the worker: its counts only grow.
            self.arena_compactions.inc(result.arena_stats[0] - self._last_arena[0])
            self.arena_misses.inc(result.arena_stats[1] - self._last_arena[1])
            self._last_arena = result.arena_stats
        if result.prefix_stats is not None:
            last = self._last_stats or (0, 0, 0, 0)
            now = result.prefix_stats
            # Stats are cumulative in the cache (and reset with it); export the growth.
            deltas = [max(n - o, 0) if n >= o else n for n, o in zip(now, last)]
            self.prefix_queries.inc(deltas[0])
            self.prefix_hits.inc(deltas[1])
            self.prefix_hit_tokens.inc(deltas[2])
            self.prefix_evictions.inc(deltas[3])
            self._last_stats = now
            self.prefix_bytes.set(result.prefix_cache_bytes)
