"""Fake workers for measuring the scheduler alone: one process serving the Worker protocol
(seqserve.worker.v1) on N ports, one fake worker per port. A Step takes a fixed time
(asyncio.sleep: no CPU, as an accelerator's forward costs the host little) and answers one
token per sequence in its groups; no model, no KV. The scheduler sees N workers of the
given step time, so its own cost per step can be told apart from the model's.

    python -m bench.fake_workers --workers 8 --step-ms 20 --vocab-size 32000 --eos 2 \\
        --port-file ports.json

Each fake worker records how long it sat with no Step to run between answering one and
taking up the next (the time the scheduler made it wait); `--stats-file` gets the totals
when the process gets SIGTERM. Each also serves the direct Steps link (worker.proto's
StepsLinkFrame; no token check: it holds nothing) unless `--no-steps-link`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc

from seqserve_common.control_channel import GRPC_MESSAGE_OPTIONS
from seqserve_common.steps_link import MAX_HELLO_BYTES, frame, read_frame_async


@dataclass
class Stats:
    """Totals over every fake worker of the process."""

    steps: int = 0
    idle_s: float = 0.0  # answered, and the next Step not there yet (all streams)
    busy_s: float = 0.0


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, step_s: float, vocab_size: int, eos: list[int], kv_tokens: int,
                 stats: Stats):
        self.step_s = step_s
        self.vocab_size, self.eos, self.kv_tokens = vocab_size, set(eos), kv_tokens
        self.stats = stats
        self.steps_link_port = 0

    async def Info(self, request, context):
        return worker_pb2.InfoResponse(
            model_id="fake", architecture="FakeForCausalLM", vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos), max_position_embeddings=1 << 20, dtype="none",
            device="fake", kv_capacity_tokens=self.kv_tokens,
            steps_link_port=self.steps_link_port)

    async def Reset(self, request, context):
        return worker_pb2.ResetResponse()

    def _token(self, seq_id: int, step_id: int) -> int:
        t = (seq_id * 7919 + step_id * 104729) % (self.vocab_size - 3) + 3
        while t in self.eos:
            t = t % (self.vocab_size - 3) + 3 + 1
        return t

    async def Steps(self, request_iterator, context):
        answered = None
        async for request in request_iterator:
            response = await self._answer(request, answered)
            answered = time.perf_counter()
            yield response

    async def serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One direct Steps link: a hello, then Steps answered in order."""
        answered = None
        try:
            await read_frame_async(reader, MAX_HELLO_BYTES)
            while True:
                request = worker_pb2.StepRequest.FromString(await read_frame_async(reader))
                response = await self._answer(request, answered)
                answered = time.perf_counter()
                writer.write(frame(worker_pb2.StepsLinkFrame(
                    response=response).SerializeToString()))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the scheduler closed the stream (or probed the port)
        finally:
            writer.close()

    async def _answer(self, request, answered: float | None) -> worker_pb2.StepResponse:
        t0 = time.perf_counter()
        if answered is not None:
            self.stats.idle_s += t0 - answered
        await asyncio.sleep(self.step_s)
        tokens = [worker_pb2.SequenceToken(sequence_id=sid,
                                           token_id=self._token(sid, request.step_id))
                  for g in request.groups for sid in g.sequence_ids]
        self.stats.steps += 1
        done = time.perf_counter()
        self.stats.busy_s += done - t0
        return worker_pb2.StepResponse(step_id=request.step_id, tokens=tokens,
                                       worker_seconds=done - t0)


async def serve(args) -> None:
    stats = Stats()
    servers, links, ports = [], [], []
    for _ in range(args.workers):
        worker = FakeWorker(args.step_ms / 1000, args.vocab_size, args.eos, args.kv_tokens,
                            stats)
        if args.steps_link:
            link = await asyncio.start_server(worker.serve_link, "127.0.0.1", 0)
            worker.steps_link_port = link.sockets[0].getsockname()[1]
            links.append(link)
        # A server per worker, as separate processes would be: each has its own streams.
        server = grpc.aio.server(options=list(GRPC_MESSAGE_OPTIONS))
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        servers.append(server)
    tmp = Path(f"{args.port_file}.tmp")
    tmp.write_text(json.dumps({"grpc": ports}))
    tmp.rename(args.port_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    if args.stats_file:
        Path(args.stats_file).write_text(json.dumps(
            {"steps": stats.steps, "idle_s": stats.idle_s, "busy_s": stats.busy_s}))
    for link in links:
        link.close()
    await asyncio.gather(*(s.stop(0) for s in servers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fake_workers", description=__doc__)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--step-ms", type=float, required=True, help="time of every Step")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--eos", type=int, action="append", default=[])
    p.add_argument("--kv-tokens", type=int, default=1 << 20, help="KV capacity to report")
    p.add_argument("--port-file", required=True)
    p.add_argument("--stats-file", default=None)
    p.add_argument("--no-steps-link", dest="steps_link", action="store_false",
                   help="offer no direct Steps link: the scheduler sends Steps over gRPC")
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
