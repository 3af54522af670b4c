"""The iteration loop with Steps in flight, against a worker stream that keeps the real
worker's rules: a Step may release only live sequences, and every live sequence must be in
exactly one group. No gRPC: the stream is the loop's only view of a worker."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from scheduler_service.loop import IterationLoop
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.sequence import FinishReason
from scheduler_service.worker_client import (
    StepAnswer,
    StepFailed,
    StepToken,
    WorkerInfo,
)
from tests.conftest import tiny_model
from tests.loop_driver import greedy_sequence, run_to_the_end

EOS = 0
TOKEN = 5


class RuleKeepingStream:
    """Answers Steps in order; sequence `eos_seq` samples EOS as its `eos_at`-th token. A
    prompt's chunks must follow one another, and only a wholly prefilled one gets tokens."""

    def __init__(self, worker):
        self.worker = worker
        self.queued: list = []

    async def send(self, step_id, plan):
        self.queued.append((step_id, plan))
        self.worker.max_outstanding = max(self.worker.max_outstanding, len(self.queued))

    async def receive(self):
        await asyncio.sleep(0)  # let the loop's other tasks run, as a real round trip would
        w = self.worker
        step_id, plan = self.queued.pop(0)
        for sid in plan.release:
            if sid not in w.live:
                raise StepFailed("FAILED_PRECONDITION", f"release of unknown sequence {sid}")
            w.live.discard(sid)
        w.live |= {s.seq_id for s in plan.prefill}
        for s in plan.prefill:
            w.prompt[s.seq_id] = w.prefilled[s.seq_id] = len(s.prompt_ids) + len(s.output_ids)
            if s.seq_id in plan.chunks:
                w.prefilled[s.seq_id] = 0
        for sid, chunk in plan.chunks.items():
            if chunk.start != w.prefilled[sid] or not chunk.start < chunk.end <= w.prompt[sid]:
                raise StepFailed("FAILED_PRECONDITION", f"chunk {chunk} of {sid} does not "
                                 f"follow its {w.prefilled[sid]} prefilled tokens")
            w.prefilled[sid] = chunk.end
            w.chunks[sid] = w.chunks.get(sid, 0) + 1
        grouped = [sid for g in plan.groups for sid in g]
        if sorted(grouped) != sorted(w.live):
            raise StepFailed("FAILED_PRECONDITION", f"groups {grouped} != live {sorted(w.live)}")
        tokens = []
        for sid in grouped:
            if (w.prefilled[sid] < w.prompt[sid]) != (sid in plan.no_token):
                raise StepFailed("INTERNAL", f"plan expects a token of {sid} wrongly")
            if sid in plan.no_token:
                continue
            w.forwards[sid] = w.forwards.get(sid, 0) + 1
            token = EOS if (sid == w.eos_seq and w.forwards[sid] == w.eos_at) else TOKEN
            tokens.append(StepToken(sid, token, cached_tokens=0))
        return StepAnswer(step_id, tokens, worker_seconds=0.0)

    def close(self):
        pass


class RuleKeepingWorker:
    address = "fake-worker"

    def __init__(self, eos_seq: int, eos_at: int):
        self.info = WorkerInfo("fake", "FakeForCausalLM", vocab_size=1000,
                               eos_token_ids=frozenset([EOS]), max_position_embeddings=2048,
                               dtype="float32", device="cpu", kv_capacity_tokens=100000)
        self.live: set[int] = set()
        self.prompt: dict[int, int] = {}  # tokens to prefill per sequence
        self.prefilled: dict[int, int] = {}
        self.chunks: dict[int, int] = {}  # chunks each sequence was prefilled in
        self.forwards: dict[int, int] = {}
        self.max_outstanding = 0
        self.eos_seq, self.eos_at = eos_seq, eos_at

    def open_steps(self):
        return RuleKeepingStream(self)

    async def wait_ready(self, timeout):
        self.live.clear()  # the real client's wait_ready ends with Reset
        return self.info


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_steps_in_flight_release_at_the_length_limit_and_drop_tokens_past_eos(in_flight,
                                                                             chunked):
    """Length-bound sequences run exactly max_new_tokens forwards, even with the next Step
    sent before the last one is answered; a sequence that samples EOS gets one wasted
    forward per extra Step in flight, and its client sees nothing past EOS. With chunked
    prefill, prompts longer than the 8-token budget are prefilled over several Steps, in
    order, and get no token before their last chunk."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    limits = [1, 2, 3, 5, 8, 13, 4, 9]
    worker = RuleKeepingWorker(eos_seq=4, eos_at=3)  # seq 4 (max 5) ends on EOS at token 3

    async def scenario():
        loop = IterationLoop(worker, max_rolling_batch_size=4, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=5, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=8, steps_in_flight=in_flight,
                             enable_chunked_prefill=chunked)
        seqs = [greedy_sequence(loop, tok, f"request {i} " + "word " * i, n)
                for i, n in enumerate(limits)]
        task, ends = await run_to_the_end(loop, seqs)
        for _ in range(500):  # the last releases go out after the answers
            if loop.idle() and not worker.live:
                break
            await asyncio.sleep(0.01)
        loop.stop()
        await task
        return seqs, ends

    seqs, ends = asyncio.run(scenario())
    assert worker.max_outstanding == in_flight
    most_chunks = max(worker.chunks.values())
    assert most_chunks > 2 if chunked else most_chunks == 1
    assert not worker.live, "every sequence was released from the worker"
    for s, ev, n in zip(seqs, ends, limits):
        if s.seq_id == worker.eos_seq:
            assert ev.reason == FinishReason.EOS and s.output_ids == [TOKEN, TOKEN, EOS]
            assert worker.forwards[s.seq_id] == 3 + (in_flight - 1)
        else:
            assert ev.reason == FinishReason.LENGTH and s.output_ids == [TOKEN] * n
            assert worker.forwards[s.seq_id] == n
