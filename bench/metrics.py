"""What a deployment's /metrics pages say: every sample of a page, the peak of a gauge during
a run, and the scheduler's and worker's counters over a run."""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Sequence

logger = logging.getLogger("seqserve.bench")


def scrape(url: str, timeout: float = 10.0,
           names: Sequence[str] | None = None) -> dict[str, float]:
    """The samples of a Prometheus text page: `name{label=value,...}` (labels sorted, values
    unquoted) -> value. With `names`, only those unlabelled samples, by a line scan instead
    of the full parser: the peak poller reads the page ten times a second during measured
    runs, and parsing every family there cost the load generator about 5 ms a poll, CPU
    taken from the system it measures."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    if names is not None:
        wanted = set(names)
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                out[name] = float(value)
        return out
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class GaugePeak:
    """Polls one gauge of a /metrics page every `interval` seconds in a thread; keeps the max.

    Only polls that see running sequences (`seqserve_num_requests_running` > 0) count, so a
    run too short to be seen gives nan rather than 0."""

    def __init__(self, url: str, name: str, interval: float = 0.1):
        self.url, self.name, self.interval = url, name, interval
        self.peak = float("nan")
        self.polls = self.active_polls = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                page = scrape(self.url, timeout=2.0,
                              names=(self.name, "seqserve_num_requests_running"))
                self.polls += 1
                value = page.get(self.name)
                if page.get("seqserve_num_requests_running", 0) > 0 and value is not None:
                    self.active_polls += 1
                    if not value <= self.peak:  # nan-safe max
                        self.peak = value
            except Exception as exc:  # noqa: BLE001 - a missed poll is not fatal
                self.errors += 1
                logger.debug("metrics poll failed: %s", exc)
            self._stop.wait(self.interval)

    def __enter__(self) -> GaugePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.active_polls < 20 and self.interval <= 0.2:  # a peak meant to be read
            logger.warning("peak %s from only %d polls during the run: too short a run for "
                           "a reliable peak", self.name, self.active_polls)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _hist_mean(before: dict[str, float], after: dict[str, float], hist: str) -> float:
    n = _delta(before, after, f"{hist}_count")
    return _delta(before, after, f"{hist}_sum") / n if n else float("nan")


STEP_PHASES = ("plan", "rpc", "worker", "postprocess")


def server_metrics(before: dict[str, float], after: dict[str, float],
                   peak: GaugePeak | None = None) -> dict:
    """What the scheduler says about the measured run (counters as deltas)."""
    def delta(name: str) -> float:
        return _delta(before, after, name)

    return {
        "peak_kv_padded_slots": peak.peak if peak else float("nan"),
        "metrics_polls": peak.polls if peak else 0,
        "metrics_polls_while_running": peak.active_polls if peak else 0,
        "metrics_poll_errors": peak.errors if peak else 0,
        "steps": delta("seqserve_batch_splits_count"),
        "mean_batch_sparsity": _hist_mean(before, after, "seqserve_batch_sparsity"),
        "mean_batch_splits": _hist_mean(before, after, "seqserve_batch_splits"),
        "mean_batch_size": _hist_mean(before, after, "seqserve_batch_size"),
        "regroup_bytes": delta("seqserve_regroup_bytes_total"),
        "regroups": delta("seqserve_regroups_total"),
        "prompt_tokens": delta("seqserve_prompt_tokens_total"),
        "generation_tokens": delta("seqserve_generation_tokens_total"),
        "prefix_cache_hit_tokens": delta("seqserve_prefix_cache_hit_tokens_total"),
        "preemptions": delta("seqserve_num_preemptions_total"),
        "swapped_preemptions": delta("seqserve_num_swapped_preemptions_total"),
        # Where a step's time goes, summed over the run (seconds).
        "step_seconds": {p: delta(f"seqserve_step_seconds_sum{{phase={p}}}")
                         for p in STEP_PHASES},
    }


def worker_metrics(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the worker says about the measured run (counters as deltas; seconds summed)."""
    def delta(name: str) -> float:
        return _delta(before, after, name)

    return {
        "steps": delta("seqserve_worker_steps_total"),
        "forward_s": delta("seqserve_worker_forward_seconds_sum"),
        "sampling_s": delta("seqserve_worker_sampling_seconds_sum"),
        "regroup_s": delta("seqserve_worker_regroup_seconds_sum"),
        "regroup_bytes": delta("seqserve_worker_regroup_bytes_total"),
        "prefix_cache_s": delta("seqserve_worker_prefix_cache_seconds_sum"),
        "generated_tokens": delta("seqserve_worker_generated_tokens_total"),
        "prefix_cache_queries": delta("seqserve_worker_prefix_cache_queries_total"),
        "prefix_cache_hits": delta("seqserve_worker_prefix_cache_hits_total"),
        "prefix_cache_hit_tokens": delta("seqserve_worker_prefix_cache_hit_tokens_total"),
        "prefix_cache_evictions": delta("seqserve_worker_prefix_cache_evictions_total"),
        "prefix_cache_bytes": after.get("seqserve_worker_prefix_cache_bytes", float("nan")),
        "kv_arena_compactions": delta("seqserve_worker_kv_arena_compactions_total"),
        "kv_arena_misses": delta("seqserve_worker_kv_arena_misses_total"),
    }
