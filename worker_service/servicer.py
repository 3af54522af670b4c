"""gRPC face of the worker: converts seqserve.worker.v1 messages to engine calls.

The one place where protos meet the worker's own dataclasses: requests become
`PrefillSpec`s and `DecodingParams`, step results become `StepResponse`s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future

import grpc
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc

from seqserve_common.decoding import DecodingStrategy
from worker_service.compute import compute_thread
from worker_service.engine import Engine, StepError
from worker_service.kv_swap import SwapRates
from worker_service.metrics import WorkerMetrics
from worker_service.sequence import BeamParams, DecodingParams
from worker_service.step import GeneratedToken, PrefillSpec, StepResult

logger = logging.getLogger(__name__)


_EARLY_STOPPING = {worker_pb2.EARLY_STOPPING_FALSE: False, worker_pb2.EARLY_STOPPING_TRUE: True,
                   worker_pb2.EARLY_STOPPING_NEVER: "never"}


def params_from_proto(p: worker_pb2.SamplingParams) -> DecodingParams:
    strategy = DecodingStrategy.from_proto(p.strategy)
    beam = None
    if strategy == DecodingStrategy.BEAM:
        b = p.beam
        beam = BeamParams(num_beams=b.num_beams, max_new_tokens=b.max_new_tokens,
                          length_penalty=b.length_penalty,
                          early_stopping=_EARLY_STOPPING[b.early_stopping],
                          num_return_sequences=b.num_return_sequences or 1)
    return DecodingParams(
        strategy=strategy, temperature=p.temperature or 1.0,
        top_k=p.top_k, top_p=p.top_p or 1.0, typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0, seed=p.seed,
        penalty_alpha=p.penalty_alpha, logprobs=p.logprobs, beam=beam)


def prefill_from_proto(ns: worker_pb2.NewSequence) -> PrefillSpec:
    return PrefillSpec(ns.sequence_id, list(ns.token_ids), ns.num_generated,
                       params_from_proto(ns.params), ns.pin_tokens, ns.prefill_end)


def token_to_proto(t: GeneratedToken) -> worker_pb2.SequenceToken:
    msg = worker_pb2.SequenceToken(sequence_id=t.seq_id, token_id=t.token_id,
                                   cached_tokens=t.cached_tokens)
    if t.predicted_tokens is not None:
        msg.predicted_output_tokens = t.predicted_tokens
    if t.beam_running:
        msg.beam_running = True
    for tokens, score in t.beams or ():
        msg.beams.append(worker_pb2.BeamHypothesis(token_ids=tokens, score=score))
    if t.logprob is not None:
        msg.logprob = t.logprob
        msg.top_logprobs.extend(worker_pb2.TopLogprob(id=i, logprob=lp)
                                for i, lp in (t.top or []))
    return msg


def _failed(reason: str) -> Future:
    """A Step refused before it is queued: its future holds the StepError."""
    failed: Future = Future()
    failed.set_exception(StepError(reason))
    return failed


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serializes Steps: the engine runs one iteration at a time."""

    def __init__(self, kv_cache_bytes: int, metrics: WorkerMetrics | None = None,
                 compute: Executor | None = None, lease_seconds: float = 30.0):
        # The server answers (liveness) while the model loads; until `attach` the model
        # RPCs say UNAVAILABLE and health says NOT_SERVING.
        self.engine: Engine | None = None
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_capacity_tokens = 0
        self.metrics = metrics
        self._lock = threading.Lock()
        # Bumped by Reset: a Steps stream opened before it takes no more Steps, so a Step
        # of the old stream that was still on its way cannot run after the Reset.
        self._generation = 0
        # The one thread that runs every torch operation (see compute.py).
        self._compute = compute or compute_thread()
        # The scheduler's lease on the sequences: every call renews it; past it, with no
        # Step running, the sequences of a scheduler that died without a word are dropped.
        self.lease_seconds = lease_seconds
        self._last_contact = time.monotonic()
        self._steps_pending = 0
        self.steps_link_port = 0  # the direct Steps link's, once it listens (0: none)
        self.swap_rates = SwapRates()

    def _renew(self) -> None:
        self._last_contact = time.monotonic()

    def _step_done(self, future: Future) -> None:
        with self._lock:
            self._steps_pending -= 1
            self._renew()  # the lease runs from the end of the last Step, not its start

    def watch_lease(self, stop: threading.Event) -> None:
        """Run until `stop`: drop the sequences once the lease has run out."""
        while not stop.wait(min(1.0, self.lease_seconds / 4)):
            engine = self.engine
            with self._lock:
                held = engine is not None and (engine.sequences or engine.swap and len(engine.swap))
                expired = (held and not self._steps_pending
                           and time.monotonic() - self._last_contact > self.lease_seconds)
                if not expired:
                    continue
                self._generation += 1  # the silent scheduler's stream takes no more Steps
                dropped = self._compute.submit(engine.drop_sequences)
            # Waited for outside the lock: a Step ending meanwhile takes it (_step_done)
            # on the compute thread, which would then never run the drop.
            dropped.result()
            logger.warning("no word from the scheduler for %.0f s (option.worker_lease): "
                           "dropped its sequences", self.lease_seconds)
            if self.metrics is not None:
                self.metrics.dropped_all()

    def attach(self, engine: Engine, swap_rates: SwapRates | None = None) -> None:
        self.kv_capacity_tokens = self.kv_cache_bytes // engine.runner.kv_shape.bytes_per_token
        self.swap_rates = swap_rates or SwapRates()
        self.engine = engine

    def _ready(self, context) -> Engine:
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model; retry")
        return self.engine

    def Info(self, request, context):
        engine = self._ready(context)
        self._renew()
        f = engine.runner.facts
        return worker_pb2.InfoResponse(
            model_id=f.model_id, architecture=f.architecture, vocab_size=f.vocab_size,
            eos_token_ids=list(f.eos_token_ids), max_position_embeddings=f.max_position_embeddings,
            dtype=f.dtype, device=f.device,
            kv_capacity_tokens=self.kv_capacity_tokens, steps_link_port=self.steps_link_port,
            kv_bytes_per_token=engine.runner.kv_shape.bytes_per_token,
            urgent_steps=engine.urgent_steps,
            swap_capacity_bytes=engine.swap.capacity_bytes if engine.swap is not None else 0,
            swap_bytes_per_second=self.swap_rates.copy_bytes_per_second,
            prefill_tokens_per_second=self.swap_rates.prefill_tokens_per_second)

    def Reset(self, request, context):
        engine = self._ready(context)
        self._renew()
        with self._lock:
            self._generation += 1
            done = self._compute.submit(engine.reset)
        done.result()  # outside the lock, as in watch_lease
        if self.metrics is not None:
            self.metrics.dropped_all()
        logger.info("reset: all sequences dropped")
        return worker_pb2.ResetResponse()

    def Steps(self, request_iterator, context):
        self._ready(context)
        try:
            yield from self.run_steps(request_iterator)
        except StepError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def run_steps(self, request_iterator: Iterator) -> Iterator[worker_pb2.StepResponse]:
        """One Steps stream, whatever carries it (the gRPC call or the direct link): Steps
        in the order they arrive, each queued for the compute thread as soon as it is read,
        so the next one is waiting there when the current one ends; an urgent Step goes
        ahead of those queued (urgent_steps.py). Answers go in the order the Steps end.
        Raises StepError when the stream must end (a Step failed, or a Reset came after
        the stream opened)."""
        engine = self.engine
        if engine is None:
            raise StepError("worker is still loading its model; retry")
        done: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            generation = self._generation
        # Steps read and not yet answered, and whether the reader has finished: the last
        # of them to end closes the reply loop.
        open_steps = [0, False]
        count_lock = threading.Lock()

        def settle(change: int, reading_ended: bool = False) -> None:
            with count_lock:
                open_steps[0] += change
                open_steps[1] = open_steps[1] or reading_ended
                if open_steps[1] and not open_steps[0]:
                    done.put(None)

        def read() -> None:
            try:
                for request in request_iterator:
                    with self._lock:
                        if self._generation != generation:
                            done.put(StepError("the worker was reset; open a new stream"))
                            break
                        self._renew()
                        self._steps_pending += 1
                        settle(1)
                        try:
                            future = self._submit(engine, request)
                        except Exception as exc:  # noqa: BLE001 - this Step fails alone
                            future = _failed(f"the Step could not be queued: {exc}")
                    # Outside the lock: a Step refused at once is done already, and its
                    # callbacks, which take the lock, run right here.
                    future.add_done_callback(self._step_done)
                    future.add_done_callback(lambda f, r=request: (done.put((r, f)),
                                                                   settle(-1)))
            except Exception as exc:  # noqa: BLE001 - the stream broke; the reply loop ends
                logger.debug("step stream closed while reading: %s", exc)
            settle(0, reading_ended=True)

        threading.Thread(target=read, name="steps-reader", daemon=True).start()
        while (item := done.get()) is not None:
            if isinstance(item, StepError):
                raise item
            request, future = item
            if future.cancelled():
                raise StepError("the worker dropped its sequences; open a new stream")
            yield self._response(request, future.result())  # a failed Step raises StepError

    def _submit(self, engine: Engine, request) -> Future:
        prefill = [prefill_from_proto(ns) for ns in request.prefill]
        plan = [list(g.sequence_ids) for g in request.groups]
        if request.urgent:
            return self._submit_urgent(engine, request, prefill, plan)
        chunks = {c.sequence_id: c.end for c in request.chunks}
        if len(chunks) != len(request.chunks):
            return _failed("a sequence has two prefill chunks in one Step")
        finished = [(f.sequence_id, f.generated_tokens, f.exact) for f in request.finished]
        return self._compute.submit(engine.step, list(request.release), prefill, plan, chunks,
                                    finished, list(request.swap_out), list(request.swap_in),
                                    list(request.prefetch), list(request.unprefetch))

    def _submit_urgent(self, engine: Engine, request, prefill: list[PrefillSpec],
                       plan: list[list[int]]) -> Future:
        others = (request.release or request.chunks or request.finished or request.swap_out
                  or request.swap_in or request.prefetch or request.unprefetch)
        reason = ("this worker does not take urgent Steps (InfoResponse.urgent_steps)"
                  if not engine.urgent_steps else
                  "an urgent Step holds new sequences' prefills only" if others else None)
        if reason is not None:
            return _failed(reason)
        future = engine.urgent.post(prefill, plan)
        # Where no Step runs to take it between layers or before it starts, this does.
        self._compute.submit(engine.urgent.run)
        return future

    def _response(self, request, result: StepResult) -> worker_pb2.StepResponse:
        if self.metrics is not None:
            self.metrics.observe_step(result, len(request.groups))
        return worker_pb2.StepResponse(
            step_id=request.step_id, tokens=[token_to_proto(t) for t in result.tokens],
            regroup_bytes=result.regroup_bytes, kv_slots=result.kv_slots,
            kv_tokens=result.kv_tokens, prefix_cache_bytes=result.prefix_cache_bytes,
            worker_seconds=result.total_seconds)
