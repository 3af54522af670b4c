"""`python -m bench all`: every figure of docs/benchmarks.md, on one set of prepared
requests where the figures share them."""

from __future__ import annotations

from bench.commands import partition, peers, prefix, serve, sweep
from bench.commands.common import prepare


def run(args) -> dict:
    """Peers (which also writes the throughput table), the sweep, partition timing, the
    prefix cache, and the Poisson rate sweep with vLLM."""
    prepared = prepare(args)
    out = {"peers": peers.run(args, prepared), "sweep": sweep.run(args, prepared),
           "partition": partition.run(args), "prefix": prefix.run(args)}
    if args.rates is None:
        args.rates = []  # auto rates
    args.arrival = "poisson"
    out["serve"] = serve.run(args, prepared)
    return out
