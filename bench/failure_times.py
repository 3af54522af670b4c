"""Time what the control plane promises on failures, on real processes (docs/reliability.md):
a killed worker to readiness NOT_SERVING, a request on a dead worker to UNAVAILABLE, a
restarted worker to SERVING, and a killed scheduler's sequences to their release by the
worker's lease.

    python -m bench.failure_times [--model DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.deployment import Deployment
from bench.metrics import scrape
from client import Client
from client.api import build_request


def _readiness(address: str) -> str:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as exc:
        return exc.code().name


def _until(predicate, poll: float = 0.02) -> float:
    t0 = time.monotonic()
    while not predicate():
        time.sleep(poll)
    return time.monotonic() - t0


def run_once(model: Path, workdir: Path, worker_timeout: float, lease: float) -> dict:
    out = {}
    with Deployment(model, workdir / "worker-death", {"worker_timeout": worker_timeout}) as d:
        port = d.worker.ports["grpc"]
        d.worker.proc.kill()
        d.worker.proc.wait()
        out["worker kill -9 -> readiness NOT_SERVING (s)"] = _until(
            lambda: _readiness(d.address) != "SERVING")
        t0 = time.monotonic()
        try:
            Client(d.address, timeout=10 * worker_timeout).generate("hello", max_new_tokens=4)
        except grpc.RpcError:
            pass
        out[f"request on a dead worker -> UNAVAILABLE (s, worker_timeout={worker_timeout:g})"] = (
            time.monotonic() - t0)
        t0 = time.monotonic()
        d.start_worker(port, wait_ready=False)
        _until(lambda: _readiness(d.address) == "SERVING", poll=0.05)
        out["worker restart -> readiness SERVING (s, model load included)"] = time.monotonic() - t0
    with Deployment(model, workdir / "lease", worker_options={"worker_lease": lease}) as d:
        with Client(d.address, timeout=120) as c:
            call = c.stub.Generate(build_request("the king rode to the castle",
                                                 max_new_tokens=900, ignore_eos=True))
            for _ in range(3):
                next(call)
            d.scheduler.proc.kill()
            d.scheduler.proc.wait()
            out[f"scheduler kill -9 -> worker holds no sequence (s, worker_lease={lease:g})"] = (
                _until(lambda: scrape(d.worker_metrics_url)["seqserve_worker_sequences"] == 0,
                       poll=0.05))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failure_times", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/test/tiny-llama"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker-timeout", type=float, default=3.0)
    parser.add_argument("--lease", type=float, default=2.0)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for key, value in run_once(args.model, Path(tmp) / str(i), args.worker_timeout,
                                       args.lease).items():
                results.setdefault(key, []).append(value)
    for key, values in results.items():
        print(f"{key}: {', '.join(f'{v:.2f}' for v in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
