"""Urgent Steps (worker_service/urgent_steps.py): a new request's prefill that runs
between two layers of the Step in progress, ahead of the Steps queued, with every
output's bits unchanged."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests import reference
from tests.background import Background
from tests.conftest import tiny_model
from worker_service.engine import Engine, StepError
from worker_service.model_runner import ModelRunner
from worker_service.sequence import DecodingParams
from worker_service.step import PrefillSpec

LONG = [(i * 7919 + 11) % 900 + 3 for i in range(150)]  # a prompt: a Step of many layers
SHORT = [(i * 104729 + 5) % 900 + 3 for i in range(9)]
URGENT = [(i * 31 + 7) % 900 + 3 for i in range(23)]


def _runner(tmp_path, dtype: str, size: str = "tiny") -> ModelRunner:
    if dtype == "float32":
        return ModelRunner(str(tiny_model("llama")))
    from worker_service.fixtures import make_model

    model = make_model(tmp_path / f"llama-bf16-{size}", arch="llama", size=size,
                       dtype="bfloat16", seed=3)
    return ModelRunner(str(model), dtype="bfloat16")


def _run(engine: Engine, nested: bool, steps: int = 6) -> dict[int, list[int]]:
    """Sequence 1 decodes while sequence 2's long prompt is prefilled; the urgent sequence
    3 is posted during that Step (`nested`: it runs between two of its layers) or run on
    its own just before it. The Step after it is planned without 3, as the scheduler
    planned it before 3 was sent; the ones after place 3 beside the others."""
    got: dict[int, list[int]] = {1: [], 2: [], 3: []}

    def take(result):
        for t in result.tokens:
            got[t.seq_id].append(t.token_id)

    take(engine.step([], [PrefillSpec(1, SHORT, 0, DecodingParams())], [[1]]))
    urgent = [PrefillSpec(3, URGENT, 0, DecodingParams())]
    if nested:
        forward = engine.runner.forward
        posted = []

        def posting_forward(batch, rows=None, between=None):
            if not posted:  # the first forward of the Step: post once its layers began
                posted.append(engine.urgent.post(urgent, [[3]]))
            return forward(batch, rows, between)
        engine.runner.forward = posting_forward
        take(engine.step([], [PrefillSpec(2, LONG, 0, DecodingParams())], [[1], [2]]))
        engine.runner.forward = forward
        assert posted[0].done(), "the urgent Step should have run inside the Step's forward"
        assert engine.runner.layer_loop is None or engine.urgent.nested_seconds > 0
        take(posted[0].result())
    else:
        take(engine.urgent.step(urgent, [[3]]))
        take(engine.step([], [PrefillSpec(2, LONG, 0, DecodingParams())], [[1], [2]]))
    take(engine.step([], [], [[1, 2]]))  # planned before 3 was sent: 3 waits
    for i in range(steps):
        # 1 joins 3's group (3 holds more KV, so its group is kept and 1 copied in), later
        # all three share one.
        take(engine.step([], [], [[2], [1, 3]] if i < steps // 2 else [[1, 2, 3]]))
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_urgent_step_between_layers_leaves_every_output_unchanged(tmp_path, dtype):
    nested = _run(Engine(_runner(tmp_path, dtype)), nested=True)
    alone = _run(Engine(_runner(tmp_path, dtype)), nested=False)
    assert nested == alone
    assert len(nested[3]) == 7 and len(nested[1]) == 9
    if dtype == "float32":
        _, model = reference.load(str(tiny_model("llama")))
        for ids, sid in ((SHORT, 1), (LONG, 2), (URGENT, 3)):
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=len(nested[sid]), pad_token_id=1)
            want = out[0, len(ids):].tolist()
            assert reference.same_until_eos(nested[sid], want, model.config.eos_token_id), sid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_shorter_urgent_step_runs_inside_a_longer_one(tmp_path, dtype):
    """Posted while a longer urgent Step's forward runs, a shorter urgent Step runs between
    its layers and ends first; one as long waits for it. Every token is the one each
    Step gives alone."""
    longer = [PrefillSpec(1, LONG, 0, DecodingParams())]
    shorter = [PrefillSpec(2, SHORT, 0, DecodingParams())]
    same = [PrefillSpec(3, LONG[::-1], 0, DecodingParams())]

    def tokens(result):
        return [(t.seq_id, t.token_id) for t in result.tokens]

    alone = Engine(_runner(tmp_path, dtype))
    want = {sid: tokens(alone.urgent.step(spec, [[sid]]))
            for sid, spec in ((1, longer), (2, shorter), (3, same))}

    engine = Engine(_runner(tmp_path, dtype))
    if engine.runner.layer_loop is None:
        pytest.skip("this model's forward does not stop between layers")
    (first, *later), ended = _posted_during_one(engine, (1, longer), [(2, shorter), (3, same)])
    assert ended == [2, 1, 3]
    assert later[0].result().between_layers and not later[1].result().between_layers
    got = {1: tokens(first.result()), 2: tokens(later[0].result()),
           3: tokens(later[1].result())}
    assert got == want


def _posted_during_one(engine: Engine, first, later):
    """Post urgent Step `first`, a (sequence id, prefill) pair, and run it; the `later`
    ones are posted once its forward has begun. Their futures, first's first, and the
    sequence ids in the order their Steps ended."""
    forward, futures, ended = engine.runner.forward, [], []

    def post(sid, prefill):
        future = engine.urgent.post(prefill, [[sid]])
        future.add_done_callback(lambda _: ended.append(sid))
        futures.append(future)

    def posting_forward(batch, rows=None, between=None):
        if len(futures) == 1:  # first's forward: the others come while it runs
            for sid, prefill in later:
                post(sid, prefill)
        return forward(batch, rows, between)
    engine.runner.forward = posting_forward
    post(*first)
    engine.urgent.run()
    engine.runner.forward = forward
    return futures, ended


def test_a_shorter_urgent_step_waiting_behind_one_stops_the_next_longer_one(tmp_path):
    """B (150 tokens) and C (120) are posted while A (100) runs: neither is shorter than A,
    so both wait; then B starts, and C, shorter than B, runs between B's layers although A
    had cleared the pause flag."""
    engine = Engine(_runner(tmp_path, "bfloat16", "odd"))
    if engine.runner.layer_loop is None:
        pytest.skip("this model's forward does not stop between layers")
    a = [PrefillSpec(1, LONG[:100], 0, DecodingParams())]
    b = [PrefillSpec(2, LONG, 0, DecodingParams())]
    c = [PrefillSpec(3, LONG[:120][::-1], 0, DecodingParams())]
    (_, _, later_c), ended = _posted_during_one(engine, (1, a), [(2, b), (3, c)])
    assert ended == [1, 3, 2]
    assert later_c.result().between_layers


def test_clearing_cancels_the_urgent_steps_not_run(tmp_path):
    engine = Engine(_runner(tmp_path, "float32"))
    posted = engine.urgent.post([PrefillSpec(1, SHORT, 0, DecodingParams())], [[1]])
    engine.urgent.clear()
    assert posted.cancelled()
    engine.urgent.run()  # nothing left to run
    assert 1 not in engine.sequences


def test_the_c_layers_stop_where_asked_and_go_on_with_the_same_bits(tmp_path):
    """The pause flag stops the C call at a layer boundary; `between` runs there (twice in
    three layers)."""
    runner = _runner(tmp_path, "bfloat16", "odd")
    loop = runner.layer_loop
    if loop is None or loop.step_layers is None:
        pytest.skip("no C step layers here")
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    def forward(between=None):
        group = KVGroup(runner.kv_shape)
        group.add_empty_row(0, len(LONG) + 1)
        batch = PackedBatch(runner.device, runner.layer_attention)
        batch.add_row(group, 0, LONG, 0)
        return runner.forward(batch, [len(LONG) - 1], between)

    plain = forward()
    calls = []

    def between():
        calls.append(1)
        if len(calls) < 2:
            loop.pause.value = 1  # stop again before the next layer
        else:
            loop.pause.value = 0

    loop.pause.value = 1
    stopped = forward(between)
    assert len(calls) == 2
    assert torch.equal(plain, stopped)


def test_an_urgent_step_takes_only_new_greedy_or_sampled_sequences(tmp_path):
    engine = Engine(_runner(tmp_path, "float32"))
    engine.step([], [PrefillSpec(1, SHORT, 0, DecodingParams())], [[1]])
    with pytest.raises(StepError, match="already exists"):
        engine.urgent.step([PrefillSpec(1, SHORT, 0, DecodingParams())], [[1]])
    with pytest.raises(StepError, match="unknown"):
        engine.urgent.step([PrefillSpec(4, SHORT, 0, DecodingParams())], [[4, 1]])
    from seqserve_common.decoding import DecodingStrategy
    with pytest.raises(StepError, match="greedy or sampled"):
        engine.urgent.step([PrefillSpec(5, SHORT, 0, DecodingParams(
            strategy=DecodingStrategy.CONTRASTIVE, top_k=4))], [[5]])
    # A Step that names neither keeps the earlier sequences exactly as before.
    assert len(engine.step([], [], [[1]]).tokens) == 1


@pytest.mark.parametrize("urgent_steps", [True, False], ids=["urgent-steps", "off"])
def test_an_urgent_request_goes_ahead_of_the_steps_in_flight(llama_dir, deploy, urgent_steps):
    """On the real processes: an urgent request that finds a free slot while less urgent
    work decodes is prefilled in an urgent Step (none with the option off); every greedy
    reply equals model.generate."""
    import asyncio
    import random

    from transformers import AutoTokenizer

    from bench.metrics import scrape
    from client import AsyncClient

    d = deploy(llama_dir, max_rolling_batch_size=4, scheduling_policy="priority",
               priority_urgent_steps=str(urgent_steps).lower())
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(8)
    lows = [reference.prompt_of_tokens(tok, n, rng) for n in (120, 80)]
    urgent_prompts = [reference.prompt_of_tokens(tok, n, rng) for n in (12, 30)]

    async def scenario():
        async with AsyncClient(d.address) as c:
            background = Background(c, 2)

            def low(i):
                return background.stream(i, lows[i], max_new_tokens=80, ignore_eos=True,
                                         priority=5)

            async def urgent(prompt, delay):
                await background.started.wait()
                await asyncio.sleep(delay)
                reply = await c.generate(prompt, max_new_tokens=6, priority=-5)
                return reply.token_ids

            return await asyncio.gather(low(0), low(1), urgent(urgent_prompts[0], 0),
                                        urgent(urgent_prompts[1], 0.01))

    *low_ids, u0, u1 = asyncio.run(scenario())
    sent = scrape(d.metrics_url)["seqserve_urgent_steps_total"]
    assert sent >= 1 if urgent_steps else sent == 0
    assert u0 == reference.greedy(llama_dir, urgent_prompts[0], 6)
    assert u1 == reference.greedy(llama_dir, urgent_prompts[1], 6)
    for prompt, ids in zip(lows, low_ids):
        assert reference.same_until_eos(ids, reference.greedy(llama_dir, prompt, 80),
                                         tok.eos_token_id)


def _stepping_servicer(tmp_path):
    """A worker servicer with its own compute thread over the 3-layer bfloat16 model,
    whose forwards can be held: `gate` is set while the held forward waits, which goes on
    once `release` is set."""
    import threading

    from worker_service.metrics import WorkerMetrics
    from worker_service.servicer import WorkerServicer

    engine = Engine(_runner(tmp_path, "bfloat16", "odd"))
    servicer = WorkerServicer(kv_cache_bytes=64 << 20, metrics=WorkerMetrics())
    servicer.attach(engine)
    gate, release = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def held_forward(batch, rows=None, between=None):
        if between is not None and not gate.is_set():  # a Step's, not an urgent one's
            gate.set()
            assert release.wait(30)
        return forward(batch, rows, between)
    engine.runner.forward = held_forward
    return servicer, gate, release


def _step_request(step_id: int, seq_id: int, prompt: list[int], urgent: bool = False):
    from seqserve.worker.v1 import worker_pb2

    return worker_pb2.StepRequest(
        step_id=step_id, urgent=urgent,
        prefill=[worker_pb2.NewSequence(sequence_id=seq_id, token_ids=prompt,
                                        params=worker_pb2.SamplingParams())],
        groups=[worker_pb2.Group(sequence_ids=[seq_id])])


def test_the_steps_stream_answers_an_urgent_step_first(tmp_path):
    """Through the servicer's Steps stream: an urgent Step read while a Step's forward
    runs is answered first, having run between that forward's layers."""
    servicer, gate, release = _stepping_servicer(tmp_path)

    def requests():
        yield _step_request(1, 1, LONG)
        assert gate.wait(30)
        yield _step_request(2, 2, URGENT, urgent=True)
        release.set()

    answers = list(servicer.run_steps(requests()))
    assert [a.step_id for a in answers] == [2, 1]
    assert [t.sequence_id for a in answers for t in a.tokens] == [2, 1]
    metrics = servicer.metrics.urgent_between_layers._value.get()
    if servicer.engine.runner.layer_loop is not None:
        assert metrics == 1


def test_a_reset_while_a_step_runs_returns(tmp_path):
    """Reset waits for the compute thread outside the servicer's lock: the Step running
    meanwhile takes that lock when it ends, so waiting under it would hang both."""
    import threading

    servicer, gate, release = _stepping_servicer(tmp_path)
    stream = threading.Thread(target=lambda: list(servicer.run_steps(
        iter([_step_request(1, 1, LONG)]))), daemon=True)
    stream.start()
    assert gate.wait(30)
    reset = threading.Thread(target=servicer.Reset, args=(None, None), daemon=True)
    reset.start()
    release.set()
    reset.join(20)
    assert not reset.is_alive(), "Reset hung"
    assert not servicer.engine.sequences


class _ServicerStream:
    """The loop's Steps stream over the real servicer's `run_steps`, in process: the
    requests go to it through a queue, its answers come back on the event loop."""

    def __init__(self, worker):
        import queue
        import threading

        self.worker = worker
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def serve():
            for answer in worker.servicer.run_steps(iter(self.requests.get, None)):
                loop.call_soon_threadsafe(self.answers.put_nowait, answer)
        threading.Thread(target=serve, daemon=True).start()

    async def send(self, step_id, plan):
        from scheduler_service.worker_client import encode_step

        self.requests.put(encode_step(step_id, plan))
        self.worker.sent.append(plan.urgent)
        in_flight = self.worker.in_flight = self.worker.in_flight + (not plan.urgent)
        self.worker.most_regular = max(self.worker.most_regular, in_flight)

    async def receive(self):
        from scheduler_service.worker_client import StepAnswer

        answer = StepAnswer.from_proto(await self.answers.get())
        self.worker.in_flight -= answer.step_id not in self.worker.urgent_ids()
        self.worker.answered.append(answer.step_id)
        return answer

    def close(self):
        self.requests.put(None)


class _InProcessWorker:
    address = "in-process"

    def __init__(self, engine: Engine):
        from scheduler_service.worker_client import WorkerInfo
        from worker_service.metrics import WorkerMetrics
        from worker_service.servicer import WorkerServicer

        self.servicer = WorkerServicer(kv_cache_bytes=64 << 20, metrics=WorkerMetrics())
        self.servicer.attach(engine)
        self.info = WorkerInfo.from_proto(self.servicer.Info(None, None))
        self.sent: list[bool] = []  # whether each Step sent was urgent, in order
        self.answered: list[int] = []  # step ids, in the order their answers came
        self.in_flight = self.most_regular = 0

    def urgent_ids(self) -> set[int]:
        return {i + 1 for i, urgent in enumerate(self.sent) if urgent}

    def open_steps(self):
        return _ServicerStream(self)

    async def wait_ready(self, timeout):
        return self.info


def test_urgent_steps_keep_the_pipeline_as_deep_as_before():
    """The loop over the real worker (no gRPC): urgent requests sent while less urgent ones
    decode go in urgent Steps, whose answers come first; the regular Steps in flight never
    exceed steps_in_flight, and every reply equals model.generate."""
    from transformers import AutoTokenizer

    from scheduler_service.loop import IterationLoop
    from scheduler_service.metrics import SchedulerMetrics
    from scheduler_service.policies.priority import PriorityAdmission
    from tests.loop_driver import greedy_sequence, run_to_the_end

    model = tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(str(model))
    worker = _InProcessWorker(Engine(ModelRunner(str(model))))

    async def scenario():
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=30, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=64, steps_in_flight=2,
                             policy=PriorityAdmission(64, 16, urgent_steps=True))
        low = [greedy_sequence(loop, tok, "a long story " * n, 40) for n in (12, 20)]
        for s in low:
            s.priority = 5
        task = asyncio.create_task(run_to_the_end(loop, low, timeout=120))
        while min(len(s.output_ids) for s in low) < 3:
            await asyncio.sleep(0.001)
        urgent = []
        for text in ("now please", "and this one too"):
            s = greedy_sequence(loop, tok, text, 5)
            s.priority = -5
            urgent.append(s)
            loop.submit(s)
            await asyncio.sleep(0.003)
        loop_task, _ = await task
        while any(not s.finished for s in urgent):
            await asyncio.sleep(0.01)
        loop.stop()
        await loop_task
        return low + urgent

    seqs = asyncio.run(scenario())
    assert any(worker.sent), "no urgent Step was sent"
    assert worker.most_regular == 2
    for s in seqs:
        want = reference.greedy(model, tok.decode(s.prompt_ids, skip_special_tokens=True),
                                len(s.output_ids))
        assert reference.same_until_eos(s.output_ids, want, tok.eos_token_id)


def test_a_shorter_urgent_prompt_goes_ahead_of_a_longer_one_with_nothing_else_running():
    """The loop over the real worker: a short urgent request that arrives while an equally
    urgent long prompt's Step runs, with nothing less urgent running, goes in an urgent
    Step between that Step's layers and ends first; both replies equal model.generate."""
    import threading

    from transformers import AutoTokenizer

    from scheduler_service.loop import IterationLoop
    from scheduler_service.metrics import SchedulerMetrics
    from scheduler_service.policies.priority import PriorityAdmission
    from tests.loop_driver import greedy_sequence

    model = tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(str(model))
    engine = Engine(ModelRunner(str(model)))
    if engine.runner.layer_loop is None:
        pytest.skip("this model's forward does not stop between layers")
    worker = _InProcessWorker(engine)
    gate, release = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def held_forward(batch, rows=None, between=None):
        if between is not None and not gate.is_set():  # the long prompt's Step
            gate.set()
            assert release.wait(30)
        return forward(batch, rows, between)
    engine.runner.forward = held_forward

    async def scenario():
        loop = IterationLoop(worker, max_rolling_batch_size=8, max_queue=16, max_sparsity=0.3,
                             max_splits=2, worker_timeout=30, metrics=SchedulerMetrics(),
                             max_num_batched_tokens=512, steps_in_flight=2,
                             policy=PriorityAdmission(64, 16, urgent_steps=True))
        long = greedy_sequence(loop, tok, "a long story " * 40, 4)
        short = greedy_sequence(loop, tok, "now please", 4)
        for s in (long, short):
            s.priority = -5
        loop.submit(long)
        task = asyncio.create_task(loop.run())
        while not gate.is_set():
            await asyncio.sleep(0.001)
        loop.submit(short)
        for _ in range(2000):
            if any(worker.sent):
                break
            await asyncio.sleep(0.001)
        release.set()
        for _ in range(6000):
            if long.finished and short.finished:
                break
            await asyncio.sleep(0.005)
        loop.stop()
        await asyncio.wait_for(task, 30)
        return long, short

    long, short = asyncio.run(scenario())
    assert True in worker.sent, "no urgent Step was sent"
    urgent_id = worker.sent.index(True) + 1
    # Its answer came before that of Step 1, the long prompt's, which it interrupted.
    assert worker.answered.index(urgent_id) < worker.answered.index(1), worker.answered
    for s in (long, short):
        want = reference.greedy(model, tok.decode(s.prompt_ids, skip_special_tokens=True),
                                len(s.output_ids))
        assert reference.same_until_eos(s.output_ids, want, tok.eos_token_id)


def test_priority_names_the_waiting_requests_that_outrank_running_work():
    """Planning alone: `priority` with urgent Steps names, most urgent first, the waiting
    requests more urgent than some running sequence; urgent_admissions keeps the run of
    greedy or sampled ones that fits."""
    from dataclasses import replace

    from scheduler_service.admission import Budget, FCFSAdmission, WaitingQueue, \
        urgent_admissions
    from scheduler_service.policies.priority import PriorityAdmission
    from tests.test_policies import running, seq

    waiting = WaitingQueue(16)
    a, b, c = seq(1, priority=3), seq(2, priority=-5), seq(3, priority=-5)
    for s in (a, b, c):
        waiting.push(s)
    work = running(seq(10, priority=3), seq(11, priority=0))
    policy = PriorityAdmission(64, urgent_steps=True)
    assert policy.urgent(waiting, work) == [b, c]  # a ties the least urgent running one
    assert policy.urgent(waiting, work[1:]) == [b, c]
    assert policy.urgent(waiting, running(seq(12, priority=-5))) == []
    assert policy.urgent(waiting, []) == []
    assert PriorityAdmission(64).urgent(waiting, work) == []  # urgent Steps off
    assert FCFSAdmission().urgent(waiting, work) == []
    # Prompts being prefilled in Steps in flight (with the tokens they had left): none
    # goes ahead of a more urgent one's, nor of an equally urgent one's as short (b and c
    # have 10 tokens), and within an urgent class a shorter one goes ahead of a longer
    # one's even with nothing less urgent running (shortest first).
    d = seq(5, priority=-8)
    waiting.push(d)
    assert policy.urgent(waiting, work, [(seq(20, priority=3), 500)]) == [d, b, c]
    assert policy.urgent(waiting, work, [(seq(20, priority=-5), 11)]) == [d, b, c]
    assert policy.urgent(waiting, work, [(seq(20, priority=-5), 10)]) == [d]
    assert policy.urgent(waiting, work, [(seq(20, priority=-8), 11)]) == [d]
    assert policy.urgent(waiting, work, [(seq(20, priority=-9), 500)]) == []
    waiting.remove(d)
    urgent_only = running(seq(21, prompt_len=400, priority=-5))
    assert policy.urgent(waiting, urgent_only) == []  # nothing less urgent runs
    assert policy.urgent(waiting, urgent_only, [(urgent_only[0], 400)]) == [b, c]
    assert policy.urgent(waiting, urgent_only, [(urgent_only[0], 10)]) == []
    f = seq(7, prompt_len=300, priority=-5)  # before b and c in the order (same rank)
    f.arrival_time = 0.5
    waiting.push(f)
    assert policy.urgent(waiting, urgent_only, [(urgent_only[0], 200)]) == [b, c]
    waiting.remove(f)
    background_only = running(seq(22, prompt_len=400))
    waiting.remove(b)
    waiting.remove(c)
    e = seq(6)  # of the default priority: arrival order, no shortest first
    waiting.push(e)
    assert policy.urgent(waiting, background_only, [(background_only[0], 400)]) == []

    room = Budget(free_slots=4, free_kv_tokens=1000, prefill_tokens=64, chunked=True)
    assert urgent_admissions([b, c], room) == [b, c]
    assert urgent_admissions([b, c], replace(room, free_slots=1)) == [b]
    assert urgent_admissions([b, c], replace(room, free_kv_tokens=19)) == []
    from seqserve_common.decoding import DecodingStrategy
    beam = seq(4, priority=-5)
    beam.params = replace(beam.params, strategy=DecodingStrategy.BEAM)
    assert urgent_admissions([b, beam, c], room) == [b]  # the run stops at a beam search
    assert urgent_admissions([b, c], room, releasing={2}) == [c]  # b's release is pending
    c.swapped = True
    assert urgent_admissions([c, b], room) == []


def test_an_urgent_sequence_swapped_out_before_any_plan_named_it_comes_back():
    """Swapped out by the first Step after its urgent one (which no plan had named it
    in), the sequence is swapped in and decodes on, Step after Step, as one never
    swapped."""
    from worker_service.kv_swap import swap_space

    def run(swap: bool) -> list[int]:
        runner = ModelRunner(str(tiny_model("llama")))
        engine = Engine(runner, swap=swap_space(16 << 20, runner.device))
        engine.step([], [PrefillSpec(1, SHORT, 0, DecodingParams())], [[1]])
        got = [t.token_id for t in engine.urgent.step(
            [PrefillSpec(3, URGENT, 0, DecodingParams())], [[3]]).tokens]
        if swap:
            engine.step([], [], [[1]], swap_out=[3])
            engine.step([], [], [[1, 3]], swap_in=[3])
        else:
            engine.step([], [], [[1], [3]])
        for _ in range(3):
            got += [t.token_id for t in engine.step([], [], [[1, 3]]).tokens
                    if t.seq_id == 3]
        engine.release(3)
        assert not engine.urgent.side_groups()
        return got

    assert run(swap=True) == run(swap=False)


def test_a_step_that_cannot_be_queued_fails_the_stream_instead_of_hanging(tmp_path):
    """A Step the servicer cannot even convert (an unknown decoding strategy) ends the
    stream with StepError; the reply loop does not wait for it forever."""
    import threading

    servicer, _, release = _stepping_servicer(tmp_path)
    release.set()
    bad = _step_request(1, 1, SHORT)
    bad.prefill[0].params.strategy = 99
    outcome = []

    def serve():
        try:
            list(servicer.run_steps(iter([bad])))
        except StepError as exc:
            outcome.append(str(exc))
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the Steps stream hung"
    assert outcome and "could not be queued" in outcome[0]
