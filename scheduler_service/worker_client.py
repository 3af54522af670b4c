"""The scheduler's connection to one worker (seqserve.worker.v1: gRPC, and the Steps
over the worker's direct link where it has one and this scheduler reaches it).

This is the scheduler's only edge with the worker: a StepPlan goes out as a StepRequest,
a StepResponse comes back as a StepAnswer, and Info as WorkerInfo. Nothing else in the
scheduler touches worker protos.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc

from scheduler_service.batch_plan import StepPlan
from scheduler_service.params import DecodingConfig
from scheduler_service.preemption import SwapFacts
from seqserve_common.control_auth import call_metadata
from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS
from seqserve_common.decoding import DecodingStrategy
from seqserve_common.steps_link import FrameError, frame, link_host, read_frame_async

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """The model and memory facts the scheduler plans with."""

    model_id: str
    architecture: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    dtype: str
    device: str
    kv_capacity_tokens: int  # KV tokens, padding included, the worker's budget holds
    # What a preempted sequence costs to swap or recompute (preemption.SwapChoice).
    swap: SwapFacts = field(default_factory=SwapFacts)
    urgent_steps: bool = False  # it takes urgent Steps (StepPlan.urgent)

    def to_proto(self) -> worker_pb2.InfoResponse:
        return worker_pb2.InfoResponse(
            model_id=self.model_id, architecture=self.architecture, vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            max_position_embeddings=self.max_position_embeddings, dtype=self.dtype,
            device=self.device, kv_capacity_tokens=self.kv_capacity_tokens,
            kv_bytes_per_token=self.swap.kv_bytes_per_token,
            swap_capacity_bytes=self.swap.capacity_bytes,
            swap_bytes_per_second=self.swap.copy_bytes_per_second,
            prefill_tokens_per_second=self.swap.prefill_tokens_per_second,
            urgent_steps=self.urgent_steps)

    @classmethod
    def from_proto(cls, info: worker_pb2.InfoResponse) -> "WorkerInfo":
        return cls(info.model_id, info.architecture, info.vocab_size,
                   frozenset(info.eos_token_ids), info.max_position_embeddings, info.dtype,
                   info.device, info.kv_capacity_tokens,
                   SwapFacts(info.kv_bytes_per_token, info.swap_capacity_bytes,
                             info.swap_bytes_per_second, info.prefill_tokens_per_second),
                   info.urgent_steps)


@dataclass(slots=True)  # one per token and Step: a frozen one's __init__ costs twice as much
class StepToken:
    """The token one sequence produced in a Step."""

    seq_id: int
    token_id: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (first token)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # Beam search: advanced a step and goes on (no token yet); or, when it ended, its
    # best hypotheses as (token ids, score), best first.
    beam_running: bool = False
    beams: tuple[tuple[tuple[int, ...], float], ...] = ()
    # The worker's length probe's predicted output tokens (first token only; None: none).
    predicted_tokens: int | None = None


@dataclass(frozen=True)
class StepAnswer:
    """The worker's answer to one Step."""

    step_id: int
    tokens: list[StepToken]
    worker_seconds: float
    regroup_bytes: int = 0
    kv_slots: int = 0  # KV slots of every group, padding included
    kv_tokens: int = 0  # KV tokens of live sequences
    prefix_cache_bytes: int = 0

    @classmethod
    def from_proto(cls, r: worker_pb2.StepResponse) -> "StepAnswer":
        tokens = [StepToken(t.sequence_id, t.token_id, t.cached_tokens,
                            t.logprob if t.HasField("logprob") else None,
                            tuple((a.id, a.logprob) for a in t.top_logprobs),
                            t.beam_running,
                            tuple((tuple(b.token_ids), b.score) for b in t.beams),
                            t.predicted_output_tokens
                            if t.HasField("predicted_output_tokens") else None)
                  if t.top_logprobs or t.beams or t.HasField("logprob")
                  or t.HasField("predicted_output_tokens")
                  # the common token, built without the empty tuples' generators: this
                  # runs for every token of every Step
                  else StepToken(t.sequence_id, t.token_id, t.cached_tokens, None, (),
                                 t.beam_running)
                  for t in r.tokens]
        return cls(r.step_id, tokens, r.worker_seconds, r.regroup_bytes, r.kv_slots,
                   r.kv_tokens, r.prefix_cache_bytes)


def encode_step(step_id: int, plan: StepPlan) -> worker_pb2.StepRequest:
    """The Step message of a plan. A prefilled sequence sends its prompt and the tokens it
    generated before (a re-admission after a worker failure resumes where it was), all at
    once even when its first chunk prefills only part of them."""
    prefill = []
    for s in plan.prefill:
        if s.seq_id in plan.swap_in:
            continue  # its KV comes back from host memory
        p = s.params
        token_ids = s.prompt_ids + s.output_ids
        end = plan.chunks[s.seq_id].end if s.seq_id in plan.chunks else len(token_ids)
        prefill.append(worker_pb2.NewSequence(
            sequence_id=s.seq_id, token_ids=token_ids, num_generated=len(s.output_ids),
            pin_tokens=s.pin_tokens, prefill_end=0 if end == len(token_ids) else end,
            params=worker_pb2.SamplingParams(
                strategy=p.strategy.to_proto(), temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
                seed=s.sampling_seed, penalty_alpha=p.penalty_alpha, logprobs=p.logprobs,
                beam=_beam_params(p))))
    new = {s.seq_id for s in plan.prefill}
    return worker_pb2.StepRequest(
        step_id=step_id, release=plan.release, prefill=prefill,
        swap_out=plan.swap_out, swap_in=plan.swap_in, prefetch=plan.prefetch,
        unprefetch=plan.unprefetch,
        groups=[worker_pb2.Group(sequence_ids=g) for g in plan.groups],
        chunks=[worker_pb2.PrefillChunk(sequence_id=sid, end=c.end)
                for sid, c in plan.chunks.items() if sid not in new],
        finished=[worker_pb2.FinishedSequence(sequence_id=sid, generated_tokens=n, exact=exact)
                  for sid, n, exact in plan.finished],
        urgent=plan.urgent)


_EARLY_STOPPING = {False: worker_pb2.EARLY_STOPPING_FALSE, True: worker_pb2.EARLY_STOPPING_TRUE,
                   "never": worker_pb2.EARLY_STOPPING_NEVER}


def _beam_params(p: DecodingConfig) -> worker_pb2.BeamParams | None:
    if p.strategy is not DecodingStrategy.BEAM:
        return None
    return worker_pb2.BeamParams(
        num_beams=p.num_beams, length_penalty=p.length_penalty,
        early_stopping=_EARLY_STOPPING[p.early_stopping],
        num_return_sequences=p.num_return_sequences, max_new_tokens=p.max_new_tokens)


class WorkerUnavailable(RuntimeError):
    """No worker answered within the configured time."""


class StepFailed(RuntimeError):
    """A Step (or the stream carrying it) failed; `code` is the gRPC status name."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class StepStream:
    """One `Steps` call: Steps go out in order and their answers come back in that order,
    so several may be in flight. Every failure surfaces as StepFailed."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, metadata):
        self._call = stub.Steps(metadata=metadata)

    async def send(self, step_id: int, plan: StepPlan) -> None:
        try:
            await self._call.write(encode_step(step_id, plan))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # A write that meets a call the worker already ended fails as INTERNAL; the
            # call's own status says why it ended.
            raise await self._ended() from None

    async def receive(self) -> StepAnswer:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise StepFailed(exc.code().name, exc.details() or "") from None
        if response is grpc.aio.EOF:
            raise await self._ended()
        return StepAnswer.from_proto(response)

    async def _ended(self) -> StepFailed:
        code = await self._call.code()
        return StepFailed(code.name, await self._call.details() or "the worker ended the stream")

    def close(self) -> None:
        self._call.cancel()


LINK_PROBE_TIMEOUT_S = 2.0


async def link_reachable(host: str, port: int) -> str | None:
    """None when a connection to the link opens; else why not (then Steps use gRPC)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                           LINK_PROBE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    writer.close()  # the worker takes a close before the hello for a probe
    return None


class LinkStepStream:
    """One Steps stream over the link: Steps go out in order and their answers come back in
    that order, so several may be in flight. Every failure surfaces as StepFailed."""

    def __init__(self, host: str, port: int, token: str):
        self._where = f"{host}:{port}"
        # Connected on first use: opening the stream must not wait (as gRPC's call does not).
        self._connection = asyncio.ensure_future(self._connect(host, port, token))
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self, host: str, port: int, token: str):
        reader, writer = await asyncio.open_connection(host, port)  # TCP_NODELAY: asyncio's
        self._writer = writer
        writer.write(frame(worker_pb2.StepsLinkHello(control_token=token).SerializeToString()))
        return reader, writer

    async def _open(self):
        try:
            return await self._connection
        except OSError as exc:
            raise self._broken(exc) from None

    def _broken(self, exc: BaseException) -> StepFailed:
        return StepFailed("UNAVAILABLE", f"the Steps link to {self._where} broke "
                                         f"({type(exc).__name__}: {exc})")

    async def send(self, step_id: int, plan: StepPlan) -> None:
        _, writer = await self._open()
        if writer.is_closing():
            raise StepFailed("UNAVAILABLE", f"the Steps link to {self._where} is closed")
        writer.write(frame(encode_step(step_id, plan).SerializeToString()))
        try:
            await writer.drain()
        except OSError as exc:
            raise self._broken(exc) from None

    async def receive(self) -> StepAnswer:
        reader, _ = await self._open()
        try:
            payload = await read_frame_async(reader)
        except (asyncio.IncompleteReadError, OSError, FrameError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError):
                exc = ConnectionError("the worker closed it")
            raise self._broken(exc) from None
        message = worker_pb2.StepsLinkFrame.FromString(payload)
        if message.HasField("error"):
            raise StepFailed(message.error.code, message.error.details)
        return StepAnswer.from_proto(message.response)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        elif not self._connection.done():
            self._connection.cancel()
        elif not self._connection.cancelled():
            self._connection.exception()  # a failed connection, already reported or unused


class WorkerClient:
    def __init__(self, address: str, token: str,
                 credentials: grpc.ChannelCredentials | None = None):
        """`token`: the control-plane secret (seqserve_common.control_auth); `credentials`:
        mutual TLS (seqserve_common.tls.TlsFiles.channel_credentials()), None: plaintext."""
        self.address = address
        self._token = token
        self._metadata = call_metadata(token)
        self._tls = credentials is not None
        # The worker's direct Steps link as (host, port) once it proved reachable; None:
        # Steps go over gRPC (the worker has no link, or this scheduler cannot reach it).
        self.steps_link: tuple[str, int] | None = None
        options = [
            *GRPC_MESSAGE_OPTIONS,
            # Reconnect quickly to a restarted worker instead of gRPC's backoff of minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.info: WorkerInfo | None = None
        self._link_port = 0  # the worker's steps_link_port from its last Info

    def open_steps(self) -> StepStream | LinkStepStream:
        if self.steps_link is not None:
            return LinkStepStream(*self.steps_link, self._token)
        return StepStream(self.stub, self._metadata)

    async def reset(self) -> None:
        await self.stub.Reset(worker_pb2.ResetRequest(), timeout=30, metadata=self._metadata)

    async def fetch_info(self, timeout: float) -> WorkerInfo:
        """Info once; also renews this scheduler's lease on the worker's sequences."""
        info = await self.stub.Info(worker_pb2.InfoRequest(), timeout=timeout,
                                    metadata=self._metadata)
        self._link_port = info.steps_link_port
        return WorkerInfo.from_proto(info)

    async def _choose_steps_link(self) -> None:
        """Steps over the worker's direct link when it has one and it answers here; a
        worker behind a proxy or a Service that forwards its gRPC port alone keeps gRPC."""
        host = link_host(self.address)
        link = (host, self._link_port) if host and self._link_port and not self._tls else None
        problem = await link_reachable(*link) if link else None
        if problem is not None:
            logger.warning("worker %s offers its Steps link on port %d but it does not answer "
                           "here (%s): Steps go over gRPC, at about twice the scheduler's "
                           "CPU per Step; open the port (option.worker_steps_link_port) to "
                           "this scheduler", self.address, link[1], problem)
            link = None
        self.steps_link = link
        logger.info("worker %s: Steps over %s", self.address,
                    f"the direct link (port {link[1]})" if link else "gRPC")

    async def wait_ready(self, timeout: float | None) -> WorkerInfo:
        """Poll Info until the worker has its model loaded; then drop its old sequences."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_log = 0.0
        while True:
            try:
                info = await self.fetch_info(timeout=2)
                await self.reset()
                await self._choose_steps_link()
                self.info = info
                logger.info("worker %s ready: %s (%s, %s)", self.address,
                            info.model_id, info.dtype, info.device)
                return info
            except grpc.aio.AioRpcError as exc:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise WorkerUnavailable(
                        f"worker {self.address} did not answer within {timeout:g} s "
                        f"({exc.code().name}: {exc.details()})") from None
                if now - last_log > 10:
                    refused = exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    logger.log(logging.ERROR if refused else logging.INFO,
                               "waiting for worker %s (%s: %s)", self.address,
                               exc.code().name, exc.details())
                    last_log = now
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.channel.close()
