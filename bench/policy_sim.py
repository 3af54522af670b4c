"""A discrete-event simulation of one worker's iteration loop under a batch limit, driven by
the scheduler's real planning code: the admission policies (`admit`, `preempt` through
`scheduler_service.preemption.preempt`, `prefill_order`), the WaitingQueue and its Step
clock, the Budget, chunked prefill (`chunking.StepBudget`) and the Sequence bookkeeping.
No processes, no model: a Step takes the time `StepModel` gives it.

What it leaves out of the real loop (scheduler_service/loop.py): Steps run one at a time
(steps_in_flight 1; the reservation margin is still that of the default 2 in flight), the
scheduler's and gRPC's own time, and worker failures. Every request generates exactly its
trace output length, as `bench policies` sends them (max_new_tokens = the output length,
ignore_eos), so max_new_tokens is the true length there too.

The step-time model and the results are in docs/benchmarks.md ("A simulation of the
policies with the real planning code"); the command is `python -m bench policy-sim`
(bench/policy_sim_report.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field, replace

from scheduler_service.admission import AdmissionPolicy, Budget, FCFSAdmission, WaitingQueue
from scheduler_service.chunking import StepBudget
from scheduler_service.params import DecodingConfig
from scheduler_service.policies.length_aware import LengthAwareAdmission, grow_margin
from scheduler_service.policies.length_predictor import (LengthPredictor, PredictorConfig,
                                                         prefix_keys)
from scheduler_service.preemption import preempt
from scheduler_service.sequence import FinishReason, Sequence, Status
from seqserve_common.decoding import DecodingStrategy


@dataclass(frozen=True)
class StepModel:
    """Seconds of one Step = base + per_row x decoding rows + per_prefill x prompt tokens +
    attention x sum over the Step's prompt chunks of chunk tokens x their mean context.

    Fitted to SmolLM2-135M bfloat16 on this 2-core machine (docs/benchmarks.md, "Where the
    time goes": decode 1/8/32/64 rows = 25.4/30.1/55.5/90.5 ms, least squares 22.9 +
    1.048 ms a row; "Prefill: where its time goes": 1 x 2000 / 4 x 500 / 16 x 128 tokens =
    2146/1370/1230 ms before the tiled attention, divided by its 2-thread gains 1.10/1.07/
    1.09, solved for 0.511 ms a token and 4.535e-4 ms a token x context on 16 x 128 and
    1 x 2000; 4 x 500 is then 1271 ms against 1280)."""

    base_ms: float = 22.9
    row_ms: float = 1.048
    prefill_token_ms: float = 0.5106
    attention_ms: float = 4.535e-4

    def seconds(self, rows: int, chunks: Seq[tuple[int, int]]) -> float:
        tokens = sum(e - s for s, e in chunks)
        pairs = sum((e - s) * (s + e) / 2 for s, e in chunks)
        return (self.base_ms + self.row_ms * rows + self.prefill_token_ms * tokens
                + self.attention_ms * pairs) / 1000


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives, its prompt (token ids: equal blocks are a shared
    prefix, which the prompt-id predictor keys on) and how many tokens it generates."""

    index: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_len: int


@dataclass
class Result:
    index: int
    prompt_len: int
    output_len: int
    arrival_s: float
    ttft_s: float
    e2e_s: float
    preemptions: int
    waited_steps: int  # Steps it spent in the waiting queue, all waits together


@dataclass
class SimConfig:
    batch_limit: int = 16  # bench policies' --max-rolling-batch-size
    max_num_batched_tokens: int = 2048  # ServingConfig's default
    # SmolLM2's KV at the default 4 GiB kv_cache_bytes: 30 layers x 2 x 3 heads x 64 x 2 B
    # = 23,040 B a token.
    kv_tokens: int = 186_413
    max_queue: int = 1 << 30
    model: StepModel = field(default_factory=StepModel)


def simulate(requests: Seq[SimRequest], policy: AdmissionPolicy,
             cfg: SimConfig = SimConfig()) -> list[Result]:
    """Run `requests` through one worker's loop with `policy`; results in request order."""
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    waiting = WaitingQueue(cfg.max_queue)
    running: dict[int, Sequence] = {}
    seqs: dict[int, tuple[SimRequest, Sequence]] = {}
    results: dict[int, Result] = {}
    t, nxt = 0.0, 0
    while len(results) < len(pending):
        while nxt < len(pending) and pending[nxt].arrival_s <= t:
            r = pending[nxt]
            s = Sequence(seq_id=r.index + 1, request_id=str(r.index),
                         prompt_ids=list(r.prompt_ids),
                         params=DecodingConfig(max_new_tokens=r.output_len,
                                               strategy=DecodingStrategy.GREEDY),
                         detokenizer=None, stops=None, arrival_time=r.arrival_s)
            seqs[s.seq_id] = (r, s)
            waiting.push(s)
            nxt += 1
        advancing = [s for s in running.values() if s.advancing]
        if not advancing and not len(waiting):
            t = pending[nxt].arrival_s  # idle until the next arrival
            continue
        # As IterationLoop._send_next and _admit plan a Step.
        budget = StepBudget.for_decoding(cfg.max_num_batched_tokens, True, advancing)
        admitted = _admit(policy, waiting, running, budget, cfg)
        for s in admitted:
            s.start_running(t)  # its prefill_target, which the chunks are cut from
        advancing = [s for s in advancing if s.seq_id in running]
        decoding = [s for s in advancing if not s.prefilling]
        order = policy.prefill_order([s for s in advancing if s.prefilling], admitted, waiting)
        # Steps run one at a time, so none in flight pays capped chunks.
        budget.take(order, policy.chunk_limit(order, waiting, False))
        if not advancing and not admitted:
            raise RuntimeError("nothing runs and nothing can be admitted: a request's "
                               "reservation exceeds kv_tokens; raise --kv-tokens")
        for s in admitted:
            running[s.seq_id] = s
        waiting.tick()
        t += cfg.model.seconds(len(decoding), list(budget.chunks.values()))
        # A token for every decoding row and every prompt whose last chunk ran.
        for s in decoding + [s for s in running.values()
                             if s.seq_id in budget.chunks and not s.prefilling]:
            s.output_ids.append(0)
            if s.first_token_time is None:
                s.first_token_time = t
            if s.generated >= s.params.max_new_tokens:
                s.status, s.finish_reason = Status.FINISHED, FinishReason.LENGTH
                del running[s.seq_id]
                r = seqs[s.seq_id][0]
                results[r.index] = Result(r.index, len(r.prompt_ids), r.output_len,
                                          r.arrival_s, s.first_token_time - r.arrival_s,
                                          t - r.arrival_s, s.preemptions, s.aged_steps)
    return [results[r.index] for r in requests]


def _admit(policy: AdmissionPolicy, waiting: WaitingQueue, running: dict[int, Sequence],
           prefill: StepBudget, cfg: SimConfig) -> list[Sequence]:
    """IterationLoop._admit without its metrics and failure handling."""
    if not len(waiting) and not policy.watches_running:
        return []
    reserved = sum(s.reserved_tokens for s in running.values())
    budget = Budget(cfg.batch_limit - len(running), cfg.kv_tokens - reserved, prefill.left,
                    prefill.chunked)
    victims, budget = preempt(policy, waiting, running, budget)
    budget = replace(budget, started=tuple(s for s in running.values()
                                           if s.advancing and s.prefilling))
    admitted = policy.admit(waiting, budget)
    waiting.push_front(victims)
    return admitted


# --- the policies compared ------------------------------------------------------------------


class KnownLengthAdmission(LengthAwareAdmission):
    """Policy length-aware with its prompt-id prediction replaced by `guess(seq)`: the true
    length (oracle shortest-job-first, the bound of what better prediction can buy) or the
    true length with noise. Buckets, aging, reservations and the clip to max_new_tokens are
    length-aware's own."""

    def __init__(self, guess: Callable[[Sequence], int], aging_steps: int,
                 bucket_tokens: int):
        super().__init__(LengthPredictor(PredictorConfig(bucket_tokens=bucket_tokens)),
                         aging_steps, use_prompt=True, use_hidden=False,
                         margin=grow_margin(2))
        self.guess = guess

    def _predict(self, seq: Sequence) -> None:
        if seq.reserve_new_tokens is not None:
            return
        seq.predicted_tokens = max(1, min(self.guess(seq), seq.params.max_new_tokens))
        seq.reserve_new_tokens = min(seq.params.max_new_tokens,
                                     self.predictor.bucket(seq.predicted_tokens))


def laplace_noise(scale: float, seed: int) -> Callable[[Sequence], int]:
    """True length + Laplace(0, `scale`) tokens, one draw per request (by seq id)."""
    def guess(seq: Sequence) -> int:
        rng = random.Random(seed * 1_000_003 + seq.seq_id)
        e = rng.expovariate(1 / scale) * (1 if rng.random() < 0.5 else -1)
        return round(seq.params.max_new_tokens + e)
    return guess


def true_length(seq: Sequence) -> int:
    return seq.params.max_new_tokens


def length_aware(warm: Seq[SimRequest], aging_steps: int, bucket_tokens: int,
                 block_tokens: int = 64) -> LengthAwareAdmission:
    """The real policy with the real prompt-id predictor, taught the warm-up rows first (as
    `bench policies` warms each server with them). The worker's probe is left out: its
    prediction comes with the first token, after admission, and changes only reservations,
    which never bind at the bench's KV budget."""
    predictor = LengthPredictor(PredictorConfig(bucket_tokens=bucket_tokens,
                                                block_tokens=block_tokens))
    for r in warm:
        predictor.learn(len(r.prompt_ids), prefix_keys(r.prompt_ids, block_tokens), r.output_len)
    return LengthAwareAdmission(predictor, aging_steps, use_prompt=True, use_hidden=False,
                                margin=grow_margin(2))


def fcfs() -> AdmissionPolicy:
    return FCFSAdmission()
