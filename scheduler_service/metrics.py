"""Prometheus metrics of the scheduler (namespace seqserve_); see docs/metrics.md."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from scheduler_service.batch_plan import StepPlan
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import StepAnswer, StepToken

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SPARSITY = (0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.33, 0.5, 0.6, 0.75, 0.9, 1.0)
_SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
_BATCH = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)
_LEARNED = (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)
_PREFILL = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerMetrics:
    """Everything the scheduler exports, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests_received = Counter("seqserve_requests_received_total",
                                         "Requests accepted into the waiting queue", registry=r)
        self.requests_finished = Counter("seqserve_requests_finished_total",
                                         "Requests finished, by reason", ["reason"], registry=r)
        self.requests_failed = Counter("seqserve_requests_failed_total",
                                       "Requests refused or failed, by gRPC status code",
                                       ["code"], registry=r)
        self.queue_size = Gauge("seqserve_num_requests_waiting", "Requests in the waiting queue",
                                registry=r)
        self.running = Gauge("seqserve_num_requests_running", "Sequences in the running batch",
                             registry=r)
        self.swapped = Gauge("seqserve_num_requests_swapped",
                             "Preempted sequences whose KV waits in a worker's swap space",
                             registry=r)
        self.batch_size = Histogram("seqserve_batch_size", "Sequences run per step",
                                    buckets=_BATCH, registry=r)
        self.splits = Histogram("seqserve_batch_splits", "Groups (attention calls per layer) per step",
                                buckets=_SPLITS, registry=r)
        self.sparsity = Histogram("seqserve_batch_sparsity",
                                  "Padding fraction of the step's partition",
                                  buckets=_SPARSITY, registry=r)
        self.padded_slots = Gauge("seqserve_kv_padded_slots",
                                  "KV slots of the current partition, padding included",
                                  registry=r)
        self.real_tokens = Gauge("seqserve_kv_tokens", "KV tokens of running sequences",
                                 registry=r)
        self.regroup_bytes = Counter("seqserve_regroup_bytes_total",
                                     "KV bytes workers copied to follow partition changes",
                                     registry=r)
        self.regroups = Counter("seqserve_regroups_total",
                                "Steps whose partition was recomputed", registry=r)
        self.kv_budget_used = Gauge("seqserve_kv_budget_used_ratio",
                                    "Share of the KV token budget reserved by running requests",
                                    registry=r)
        self.ttft = Histogram("seqserve_time_to_first_token_seconds",
                              "Arrival to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("seqserve_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request",
                             buckets=_STEP + (10.0,), registry=r)
        self.e2e = Histogram("seqserve_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("seqserve_request_queue_time_seconds",
                                    "Arrival to admission", buckets=_LATENCY, registry=r)
        self.step_time = Histogram("seqserve_step_seconds",
                                   "Step time by phase: plan, rpc (control round trip minus "
                                   "worker time), worker, postprocess", ["phase"],
                                   buckets=_STEP, registry=r)
        # The children observed every Step, looked up once.
        self._step_phase = {p: self.step_time.labels(p)
                            for p in ("plan", "worker", "rpc", "postprocess")}
        self.prompt_tokens = Counter("seqserve_prompt_tokens_total", "Prompt tokens prefilled",
                                     registry=r)
        self.step_prefill_tokens = Histogram(
            "seqserve_step_prefill_tokens", "Prompt tokens a step prefills (whole prompts and "
            "chunks; a prefix-cache hit makes the worker compute fewer)",
            buckets=_PREFILL, registry=r)
        self.partial_chunks = Counter(
            "seqserve_prefill_partial_chunks_total", "Prompt chunks that left part of their "
            "prompt for later steps (chunked prefill)", registry=r)
        self.generation_tokens = Counter("seqserve_generation_tokens_total",
                                         "Tokens generated", registry=r)
        self.prefix_hit_tokens = Counter("seqserve_prefix_cache_hit_tokens_total",
                                         "Prompt tokens whose KV the worker reused from its "
                                         "prefix cache", registry=r)
        self.prefix_cache_bytes = Gauge("seqserve_prefix_cache_bytes",
                                        "Bytes the worker's prefix cache holds", registry=r)
        self.worker_up = Gauge("seqserve_workers_ready", "Workers connected and serving",
                               registry=r)
        # Per worker (data parallel): the totals above are their sums.
        self.worker_ready = Gauge("seqserve_worker_ready", "Whether the worker serves (1) or "
                                  "not (0)", ["worker"], registry=r)
        self.worker_running = Gauge("seqserve_worker_num_requests_running",
                                    "Sequences in the worker's running batch", ["worker"],
                                    registry=r)
        self.worker_waiting = Gauge("seqserve_worker_num_requests_waiting",
                                    "Requests placed on the worker, waiting", ["worker"],
                                    registry=r)
        self.worker_kv_used = Gauge("seqserve_worker_kv_budget_used_ratio",
                                    "Share of the worker's KV token budget reserved by its "
                                    "running requests", ["worker"], registry=r)
        self.preemptions = Counter("seqserve_num_preemptions_total",
                                   "Running sequences preempted for more urgent ones (their KV "
                                   "dropped and recomputed at re-admission, or swapped)",
                                   registry=r)
        self.urgent_steps = Counter(
            "seqserve_urgent_steps_total", "Urgent Steps sent: prefills of requests more "
            "urgent than running work, run by the worker ahead of the Steps in flight "
            "(option.priority_urgent_steps)", registry=r)
        self.swapped_preemptions = Counter(
            "seqserve_num_swapped_preemptions_total", "Preemptions whose KV the worker moved "
            "to host memory and back (option.preemption_mode) instead of recomputing it",
            registry=r)
        self.length_predictions = Counter(
            "seqserve_length_predictions_total", "Finished requests (EOS, stop or length) "
            "that had a predicted output length (length-aware, length-batched)", registry=r)
        self.length_prediction_error = Counter(
            "seqserve_length_prediction_error_tokens_total", "Sum of |predicted - real| "
            "output tokens over those requests", registry=r)
        self.length_predictions_within = Counter(
            "seqserve_length_predictions_within_total", "Those whose prediction was within "
            "`tokens` of the real length (the paper's Acc-50, Acc-100)", ["tokens"], registry=r)
        self.placed = Counter("seqserve_requests_placed_total",
                              "Requests placed on each worker (moves after a failure count "
                              "again)", ["worker"], registry=r)
        self.frontend_requests = Counter(
            "seqserve_frontend_requests_total", "Sequences each front-end process submitted "
            "(option.frontend_processes >= 1)", ["frontend"], registry=r)
        self._tokens = 0  # generated tokens not yet added to generation_tokens
        self._waiting: dict[str, int] = {}
        self._load: dict[str, tuple[int, int, int]] = {}  # worker -> running, reserved, budget
        self._swapped: dict[str, int] = {}  # worker -> sequences swapped out there
        self._ready: dict[str, bool] = {}
        self._kv: dict[str, tuple[int, int, int]] = {}  # prefix-cache bytes, slots, tokens

    # --- observations, one per event of the iteration loop ----------------------------------

    def observe_admission(self, seq: Sequence, now: float) -> None:
        self.queue_time.observe(now - seq.arrival_time)

    def observe_token(self, seq: Sequence, tok: StepToken, now: float) -> None:
        """Before the sequence records the token's time: TTFT or the gap since its last."""
        if seq.first_token_time is None:
            self.ttft.observe(now - seq.arrival_time)
            self.prompt_tokens.inc(len(seq.prompt_ids))
            self.prefix_hit_tokens.inc(tok.cached_tokens)
        elif seq.last_token_time is not None:
            self.itl.observe(now - seq.last_token_time)
        self._tokens += 1  # counted once per Step (observe_step): a lock each is CPU

    def observe_finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.requests_finished.labels(reason.value).inc()
        if seq.predicted_tokens is not None and reason in _LEARNED:
            # The paper's measures of the length prediction: error, Acc-50, Acc-100.
            err = abs(seq.predicted_tokens - seq.generated)
            self.length_predictions.inc()
            self.length_prediction_error.inc(err)
            for within in (50, 100):
                if err <= within:
                    self.length_predictions_within.labels(str(within)).inc()
        if seq.first_token_time is not None:
            self.e2e.observe(now - seq.arrival_time)

    def set_waiting(self, worker: str, n: int) -> None:
        self._waiting[worker] = n
        self.worker_waiting.labels(worker).set(n)
        self.queue_size.set(sum(self._waiting.values()))

    def set_load(self, worker: str, running: int, reserved: int, budget: int,
                 swapped: int = 0) -> None:
        self._load[worker] = (running, reserved, budget)
        self._swapped[worker] = swapped
        self.swapped.set(sum(self._swapped.values()))
        self.worker_running.labels(worker).set(running)
        self.worker_kv_used.labels(worker).set(reserved / budget if budget else 0.0)
        self.running.set(sum(r for r, _, _ in self._load.values()))
        total = sum(b for _, _, b in self._load.values())
        self.kv_budget_used.set(sum(k for _, k, _ in self._load.values()) / total if total else 0.0)

    def set_worker_up(self, worker: str, up: bool) -> None:
        self._ready[worker] = up
        self.worker_ready.labels(worker).set(int(up))
        self.worker_up.set(sum(self._ready.values()))

    def remove_worker(self, worker: str) -> None:
        """A drained worker left: drop its gauges from the sums and the export (its
        placement counter stays, so totals never go down)."""
        for d in (self._waiting, self._load, self._ready, self._kv, self._swapped):
            d.pop(worker, None)
        for g in (self.worker_ready, self.worker_running, self.worker_waiting,
                  self.worker_kv_used):
            try:
                g.remove(worker)
            except KeyError:
                pass
        self.worker_up.set(sum(self._ready.values()))
        self.queue_size.set(sum(self._waiting.values()))
        self.running.set(sum(r for r, _, _ in self._load.values()))
        self.swapped.set(sum(self._swapped.values()))

    def observe_step(self, worker: str, plan: StepPlan, answer: StepAnswer, plan_s: float,
                     rpc_s: float, post_s: float) -> None:
        """`rpc_s`: the loop's wait for the answer; what the worker did not spend of it is
        the control round trip."""
        worker_s = answer.worker_seconds
        phase = self._step_phase
        phase["plan"].observe(plan_s)
        phase["worker"].observe(worker_s)
        phase["rpc"].observe(max(rpc_s - worker_s, 0.0))
        phase["postprocess"].observe(post_s)
        if self._tokens:
            self.generation_tokens.inc(self._tokens)
            self._tokens = 0
        if plan.groups:
            self.batch_size.observe(sum(len(g) for g in plan.groups))
            self.splits.observe(len(plan.groups))
            self.sparsity.observe(plan.partition.sparsity)
        if plan.regrouped:
            self.regroups.inc()
        if plan.chunks:
            self.step_prefill_tokens.observe(plan.prefill_tokens)
            self.partial_chunks.inc(plan.partial_chunks)
        self._kv[worker] = (answer.prefix_cache_bytes, answer.kv_slots, answer.kv_tokens)
        self.prefix_cache_bytes.set(sum(v[0] for v in self._kv.values()))
        self.padded_slots.set(sum(v[1] for v in self._kv.values()))
        self.real_tokens.set(sum(v[2] for v in self._kv.values()))
        self.regroup_bytes.inc(answer.regroup_bytes)


def metrics_route(registry: CollectorRegistry):
    """An aiohttp handler serving `registry` in Prometheus' text format: an inference
    gateway's endpoint picker reads the gauges on the port it routes to."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
    return handler
