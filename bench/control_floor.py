"""What one Step's control round trip costs the scheduler's CPU, with nothing of ours in it.

    python -m bench.control_floor [--step-ms 20] [--steps 300] [--rounds 3]

A server in a subprocess answers each message after --step-ms (a worker computing a
Step); the client in this process writes a 200-byte message and awaits its answer, again
and again, and its CPU (user + system) per round trip is the least a scheduler spends per
Step on that transport. Two transports, alternated round by round: a gRPC aio
bidirectional stream (what the scheduler drives workers over) and a bare asyncio TCP
stream (one syscall each way: the kernel's and the event loop's share alone). The gap is
gRPC's own: its completion queue and poller threads hand every finished operation to the
event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

MESSAGE = b"x" * 200
WARMUP = 10


async def _serve(step_s: float) -> None:
    import grpc
    from grpc import aio

    async def echo(messages, context):
        async for message in messages:
            await asyncio.sleep(step_s)
            yield message

    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor.Floor", {"Steps": grpc.stream_stream_rpc_method_handler(echo)}),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def raw(reader, writer):
        try:
            while True:
                message = await reader.readexactly(len(MESSAGE))
                await asyncio.sleep(step_s)
                writer.write(message)
        except asyncio.IncompleteReadError:
            writer.close()

    tcp = await asyncio.start_server(raw, "127.0.0.1", 0)
    print(json.dumps({"grpc": grpc_port, "tcp": tcp.sockets[0].getsockname()[1]}), flush=True)
    await server.wait_for_termination()


async def _grpc_round_trips(port: int, steps: int) -> float:
    from grpc import aio

    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/floor.Floor/Steps")()
        for i in range(WARMUP + steps):
            if i == WARMUP:
                t0 = time.process_time()
            await call.write(MESSAGE)
            await call.read()
        cpu = time.process_time() - t0
        call.cancel()
    return cpu / steps


async def _tcp_round_trips(port: int, steps: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i in range(WARMUP + steps):
        if i == WARMUP:
            t0 = time.process_time()
        writer.write(MESSAGE)
        await reader.readexactly(len(MESSAGE))
    cpu = time.process_time() - t0
    writer.close()
    return cpu / steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.control_floor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=300, help="round trips per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per transport")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.step_ms / 1000))
        return {}
    server = subprocess.Popen([sys.executable, "-m", "bench.control_floor", "--serve",
                               "--step-ms", str(args.step_ms)], stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(server.stdout.readline())
        us: dict[str, list[float]] = {"grpc": [], "tcp": []}
        for _ in range(args.rounds):
            us["grpc"].append(round(asyncio.run(_grpc_round_trips(ports["grpc"], args.steps)) * 1e6, 1))
            us["tcp"].append(round(asyncio.run(_tcp_round_trips(ports["tcp"], args.steps)) * 1e6, 1))
    finally:
        server.terminate()
        server.wait(10)
    result = {"step_ms": args.step_ms, "steps": args.steps, "cpu_us_per_round_trip": us,
              "median_us": {k: statistics.median(v) for k, v in us.items()}}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
