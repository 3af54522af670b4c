"""A front-end process's view of the scheduler core (core_service.py): the frontend.Core
a Frontend submits to, over seqserve.core.v1. Tokens come back once per Step for all of
this front end's sequences; here they become text and events (output.py), and a stop
string that matches ends the sequence at once and cancels it in the core."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

import grpc
from seqserve.core.v1 import core_pb2, core_pb2_grpc

from scheduler_service import core_wire
from scheduler_service.admission import QueueFull, check_room
from scheduler_service.frontend import Unavailable
from scheduler_service.output import emit_beams, emit_finish, stream_token
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import StepToken, WorkerInfo
from seqserve_common.control_auth import call_metadata
from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS

logger = logging.getLogger(__name__)
ID_BITS = 40  # a front end numbers its sequences under its index << ID_BITS
CONNECT_RETRY_S = 0.2


class RemoteCore:
    def __init__(self, address: str, token: str, index: int, max_queue: int):
        self.name = f"frontend-{index}"
        self.max_queue = max_queue
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS)
        self._stub = core_pb2_grpc.CoreStub(self._channel)
        self._metadata = call_metadata(token)
        self._ids = itertools.count(((index + 1) << ID_BITS) + 1)
        self.seqs: dict[int, Sequence] = {}  # submitted and not yet ended here
        self.ready = False
        self.kv_budget = 0
        self.eos_ids: frozenset[int] = frozenset()
        self._waiting = 0
        self._tasks: set[asyncio.Task] = set()
        self.on_ready_change: Callable[[bool], None] = lambda ready: None
        self.lost = asyncio.Event()  # the core's stream ended: this front end must exit

    # --- connection ----------------------------------------------------------------------

    async def connect(self) -> WorkerInfo:
        """Wait for the core to have a worker, then open the output stream; returns the
        model's Info."""
        while True:
            try:
                info = await self._stub.Info(core_pb2.InfoRequest(), metadata=self._metadata)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE,):
                    raise
                await asyncio.sleep(CONNECT_RETRY_S)
        worker = WorkerInfo.from_proto(info.worker)
        self.eos_ids = worker.eos_token_ids
        self._set_state(info.state)
        call = self._stub.Outputs(core_pb2.OutputsRequest(frontend=self.name),
                                  metadata=self._metadata)
        self._set_state((await call.read()).state)
        self._spawn(self._read(call))
        return worker

    async def _read(self, call) -> None:
        try:
            while (event := await call.read()) is not grpc.aio.EOF:
                if event.HasField("outputs"):
                    self._apply(event.outputs)
                else:
                    self._set_state(event.state)
        except grpc.aio.AioRpcError as exc:
            logger.error("the scheduler core's output stream failed (%s: %s)",
                         exc.code().name, exc.details())
        for seq in list(self.seqs.values()):
            emit_finish(seq, FinishReason.ERROR, "the scheduler core went away")
        self.seqs.clear()
        self.ready = False
        self.on_ready_change(False)
        self.lost.set()

    def _set_state(self, state: core_pb2.CoreState) -> None:
        self.kv_budget = state.kv_budget_tokens
        if state.ready != self.ready:
            self.ready = state.ready
            self.on_ready_change(state.ready)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self._channel.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- frontend.Core ---------------------------------------------------------------------

    def new_seq_id(self) -> int:
        return next(self._ids)

    def check_room(self, n: int) -> None:
        """Refuse early by the queue length the core last reported; Submit decides. That
        length comes with this front end's own tokens only: with none of its sequences in
        the core no message tells it the queues emptied, so it is not used then."""
        check_room(self._waiting if self.seqs else 0, n, self.max_queue)

    async def submit_all(self, seqs: list[Sequence]) -> None:
        request = core_pb2.SubmitRequest(
            frontend=self.name, sequences=[core_wire.encode_sequence(s) for s in seqs])
        for seq in seqs:  # before the call: its first tokens may come before its answer
            self.seqs[seq.seq_id] = seq
        call = asyncio.ensure_future(self._stub.Submit(request, metadata=self._metadata))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            # The client went away (a deadline, a closed connection) during the call; the
            # core may queue them still, so they are cancelled there once it answers.
            for seq in seqs:
                self.seqs.pop(seq.seq_id, None)
            call.add_done_callback(lambda c: self._cancel_submitted(c, [s.seq_id for s in seqs]))
            raise
        except grpc.aio.AioRpcError as exc:
            for seq in seqs:
                self.seqs.pop(seq.seq_id, None)
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise QueueFull(exc.details()) from None
            raise Unavailable(f"the scheduler core refused the request ({exc.code().name}: "
                              f"{exc.details()})") from None

    def _cancel_submitted(self, call: asyncio.Future, ids: list[int]) -> None:
        if not call.cancelled() and call.exception() is None:
            self._spawn(self._cancel(ids, stopped=False))

    def cancel(self, seq: Sequence) -> None:
        if self.seqs.pop(seq.seq_id, None) is not None:
            self._spawn(self._cancel([seq.seq_id], stopped=False))

    def count_refusal(self, code: str) -> None:
        self._spawn(self._stub.CountRefusal(core_pb2.RefusalRequest(code=code),
                                            metadata=self._metadata))

    def metrics_route(self):
        """An aiohttp handler serving the core's /metrics (the registry is the core's)."""
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST

        async def handler(request: web.Request) -> web.Response:
            try:
                reply = await self._stub.Metrics(core_pb2.MetricsRequest(),
                                                 metadata=self._metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                raise web.HTTPServiceUnavailable(
                    text=f"the scheduler core did not answer ({exc.code().name})") from None
            return web.Response(body=reply.text, headers={"Content-Type": CONTENT_TYPE_LATEST})
        return handler

    async def _cancel(self, ids: list[int], stopped: bool) -> None:
        try:
            await self._stub.Cancel(core_pb2.CancelRequest(sequence_ids=ids, stopped=stopped),
                                    metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:  # the core gone: _read ends everything
            logger.warning("cancel of %d sequences failed (%s)", len(ids), exc.code().name)

    # --- tokens to text ----------------------------------------------------------------------

    def _apply(self, out: core_pb2.StepOutputs) -> None:
        self._waiting = out.waiting
        stopped: list[int] = []
        seqs = self.seqs

        def add(seq: Sequence, token_id: int, logprob=None, top=None) -> None:
            seq.output_ids.append(token_id)
            if stream_token(seq, token_id, logprob, top):
                del seqs[seq.seq_id]  # later tokens of it, here or in the core, are dropped
                emit_finish(seq, FinishReason.STOP)
                stopped.append(seq.seq_id)

        for sid, token_id in zip(out.sequence_ids, out.token_ids):
            seq = seqs.get(sid)
            if seq is not None:  # else it ended here already (stop string, client gone)
                add(seq, token_id)
        for scored in out.scored:
            seq = seqs.get(scored.sequence_id)
            if seq is not None:
                add(seq, *core_wire.scored_token(scored))
        for msg in out.finished:
            seq = seqs.pop(msg.sequence_id, None)
            if seq is None:
                continue
            seq.cached_tokens = msg.cached_tokens
            reason = core_wire.finish_reason(msg)
            if msg.beams:
                reason = emit_beams(seq, StepToken(seq.seq_id, 0, msg.cached_tokens,
                                                   beams=core_wire.beams(msg)), self.eos_ids)
            emit_finish(seq, reason, msg.error or None)
        if stopped:
            self._spawn(self._cancel(stopped, stopped=True))
