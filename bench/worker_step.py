"""The worker's packed forward step in process (no gRPC, no scheduler) against the floor.

    python -m bench.worker_step MODEL_DIR [--threads N] [--rows 1,8,32,64] [--prefill 512]

Decoding steps of 1, 8, 32 and 64 rows at contexts of 200-300 tokens and a 512-token
prefill, each a forward plus the output layer of the rows that yield a token: the median
step time, and the floor of the same step (bench/floor.py; the GEMM rates and bandwidth
are measured first, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CONTEXT = 300


def _cases(runner, decode_rows, prefill_tokens):
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    vocab = runner.facts.vocab_size
    cases = []
    for rows in decode_rows:
        group = KVGroup(runner.kv_shape)
        for i in range(rows):
            group.add_empty_row(i, CONTEXT + 1)
        for layer in range(runner.kv_shape.num_layers):
            group.keys[layer].zero_()
            group.values[layer].zero_()
        lengths = [CONTEXT - (i * 37) % 100 for i in range(rows)]
        for i, n in enumerate(lengths):
            group.fill(i, n)

        def make(r, g=group, n=rows):
            b = PackedBatch(r.device, r.layer_attention)
            b.add_decode(g, 0, n, [(i * 7919 + 11) % vocab for i in range(n)])
            return b
        cases.append((f"decode {rows} rows", make, rows, rows, sum(lengths)))
    for n in prefill_tokens:
        group = KVGroup(runner.kv_shape)
        group.add_empty_row(0, n + 1)

        def make(r, g=group, n=n):
            b = PackedBatch(r.device, r.layer_attention)
            b.add_row(g, 0, [(i * 7919 + 11) % vocab for i in range(n)], 0)
            return b
        cases.append((f"prefill {n} tokens", make, n, 1, 0))
    return cases


def _step(runner, make, logit_rows):
    return runner.logits(runner.forward(make(runner))[-logit_rows:])


def _timed(runner, make, logit_rows, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        _step(runner, make, logit_rows)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    import torch

    from bench import machine_rates
    from bench.floor import ModelShape, step_floor
    from worker_service.model_runner import ModelRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--prefill", default="512")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(x) for x in a.rows.split(",") if x]
    prefill = [int(x) for x in a.prefill.split(",") if x]
    runner = ModelRunner(a.model, dtype="bfloat16")
    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    shape = ModelShape.from_config(json.loads((Path(a.model) / "config.json").read_text()))
    rates = machine_rates.measure_model(shape, ms=(1, 8, 32, 64, 256, 1024, 2048))
    for name, make, tokens, logit_rows, kv in _cases(runner, rows, prefill):
        reps = 20 if tokens <= 64 else 5
        _timed(runner, make, logit_rows, 2)
        t = statistics.median(_timed(runner, make, logit_rows, 1) for _ in range(reps))
        f = step_floor(shape, rates, tokens, logit_rows, kv)
        print(f"{name:20s} {t * 1e3:8.2f} ms; floor {f.seconds * 1e3:7.2f} ms (GEMMs "
              f"{f.compute_s * 1e3:.2f}, bytes {f.memory_s * 1e3:.2f}): {f.seconds / t:.0%}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
