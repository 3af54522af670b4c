"""The worker's packed forward step in process (no gRPC, no scheduler): its time per step
against the floor's, and an A/B of fused sibling linears (kernels/fused_linears.py).

    python -m bench.worker_step MODEL_DIR [--ab] [--rounds 7] [--threads N]

Decoding steps of 1, 8, 32 and 64 rows at contexts of 200-300 tokens and a 512-token
prefill, each a forward plus the output layer of the rows that yield a token. Without
--ab: the median step time, and the floor of the same step (bench/floor.py, the GEMM
rates and bandwidth measured first). With --ab: two runners of the model, without and with
the fused products, checked to give the same logits bits, timed alternately `rounds`
times; the ratio new / old per round, and its median (the machine is shared: ratios of
neighbouring runs, not absolute times).
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
    from worker_service.kernels import fused_linears
    from worker_service.model_runner import ModelRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ab", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--prefill", default="512")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(x) for x in a.rows.split(",") if x]
    prefill = [int(x) for x in a.prefill.split(",") if x]
    new = ModelRunner(a.model, dtype="bfloat16")
    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    if not a.ab:
        shape = ModelShape.from_config(json.loads((Path(a.model) / "config.json").read_text()))
        rates = machine_rates.measure_model(shape, ms=(1, 8, 32, 64, 256, 1024, 2048))
        for name, make, tokens, logit_rows, kv in _cases(new, rows, prefill):
            reps = 20 if tokens <= 64 else 5
            _timed(new, make, logit_rows, 2)
            t = statistics.median(_timed(new, make, logit_rows, 1) for _ in range(reps))
            f = step_floor(shape, rates, tokens, logit_rows, kv)
            print(f"{name:20s} {t * 1e3:8.2f} ms; floor {f.seconds * 1e3:7.2f} ms (GEMMs "
                  f"{f.compute_s * 1e3:.2f}, bytes {f.memory_s * 1e3:.2f}): {f.seconds / t:.0%}")
    else:
        real = fused_linears.fuse_siblings
        fused_linears.fuse_siblings = lambda *args, **kw: 0
        try:
            old = ModelRunner(a.model, dtype="bfloat16")
        finally:
            fused_linears.fuse_siblings = real
        for name, make, tokens, logit_rows, kv in _cases(new, rows, prefill):
            same = torch.equal(_step(old, make, logit_rows), _step(new, make, logit_rows))
            reps = 5 if tokens <= 64 else 1
            times, ratios = {"old": [], "new": []}, []
            for _ in range(a.rounds):
                t_old = _timed(old, make, logit_rows, reps)
                t_new = _timed(new, make, logit_rows, reps)
                times["old"].append(t_old)
                times["new"].append(t_new)
                ratios.append(t_new / t_old)
            print(f"{name:20s} same bits {same}; old {statistics.median(times['old']) * 1e3:8.2f}"
                  f" ms, new {statistics.median(times['new']) * 1e3:8.2f} ms; new / old median "
                  f"{statistics.median(ratios):.3f} (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
