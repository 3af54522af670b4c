"""The worker's packed forward step in process (no gRPC, no scheduler) against the floor.

    python -m bench.worker_step MODEL_DIR [--threads N] [--rows 1,8,32,64] [--prefill 512]
        [--device cuda] [--grow] [--cudnn-sdpa] [--profile N]

Decoding steps of 1, 8, 32 and 64 rows at contexts of 200-300 tokens and a 512-token
prefill, each a forward plus the output layer of the rows that yield a token: the median
step time, and on CPU the floor of the same step (bench/floor.py; the GEMM rates and
bandwidth are measured first, about a minute). On a GPU the floor is not computed (its
rates are the CPU's); `--profile N` prints torch.profiler's top N operators of each case
instead, to show host time against device time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CONTEXT = 300
GROW_ROOM = 128  # slots each row may grow by under --grow


def _cases(runner, decode_rows, prefill_tokens, grow: bool = False):
    """(name, make, tokens, logit rows, KV tokens read) of each case; with `grow`, every
    call of a case's `make` is one token longer than the last (each decoding row one slot
    on, each prompt one token more), as in serving, so kernels whose setup is cached by
    shape pay it at every step."""
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    vocab = runner.facts.vocab_size
    room = GROW_ROOM if grow else 0
    cases = []
    for rows in decode_rows:
        group = KVGroup(runner.kv_shape)
        for i in range(rows):
            group.add_empty_row(i, CONTEXT + 1 + room)
        for layer in range(runner.kv_shape.num_layers):
            group.keys[layer].zero_()
            group.values[layer].zero_()
        lengths = [CONTEXT - (i * 37) % 100 for i in range(rows)]
        for i, n in enumerate(lengths):
            group.fill(i, n)

        def make(r, g=group, n=rows):
            if grow:
                assert g.length(0) < CONTEXT + room - 1, "more calls than GROW_ROOM"
                for i in range(n):
                    g.fill(i, g.length(i) + 1)
            b = PackedBatch(r.device, r.layer_attention)
            b.add_decode(g, 0, n, [(i * 7919 + 11) % vocab for i in range(n)])
            return b
        cases.append((f"decode {rows} rows", make, rows, rows, sum(lengths)))
    for n in prefill_tokens:
        group = KVGroup(runner.kv_shape)
        group.add_empty_row(0, n + 1 + room)
        calls = [0]

        def make(r, g=group, n=n):
            extra = calls[0] % room if grow else 0
            calls[0] += 1
            b = PackedBatch(r.device, r.layer_attention)
            b.add_row(g, 0, [(i * 7919 + 11) % vocab for i in range(n + extra)], 0)
            return b
        cases.append((f"prefill {n} tokens", make, n, 1, 0))
    return cases


def _step(runner, make, logit_rows):
    return runner.logits(runner.forward(make(runner))[-logit_rows:])


def _sync(runner):
    if runner.device.type == "cuda":
        import torch
        torch.cuda.synchronize(runner.device)


def _timed(runner, make, logit_rows, reps):
    _sync(runner)
    t0 = time.perf_counter()
    for _ in range(reps):
        _step(runner, make, logit_rows)
    _sync(runner)
    return (time.perf_counter() - t0) / reps


def _profile(runner, make, logit_rows, top):
    """torch.profiler's table of one step, by self CPU time: on a GPU a step whose host
    time exceeds its kernels' time is bound by launching them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _step(runner, make, logit_rows)
        _sync(runner)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=top))
    cpu = sum(e.self_cpu_time_total for e in events) / 1e3
    # Kernels only: an operator's row repeats the time of the kernels it launched.
    dev = sum(e.self_device_time_total for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                        "cuLaunchKernel",
                                                        "cudaLaunchKernelExC"))
    print(f"host {cpu:.2f} ms, device kernels {dev:.2f} ms, kernel launches {launches}")


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
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--grow", action="store_true",
                   help="each step one token longer than the last, as in serving")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="let SDPA use cuDNN's attention on a GPU (the runner turns it off)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the profiler's top N operators of each case")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(x) for x in a.rows.split(",") if x]
    prefill = [int(x) for x in a.prefill.split(",") if x]
    runner = ModelRunner(a.model, dtype="bfloat16", device=a.device)
    if a.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(True)
    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    shape = ModelShape.from_config(json.loads((Path(a.model) / "config.json").read_text()))
    rates = None
    if runner.device.type == "cpu":
        rates = machine_rates.measure_model(shape, ms=(1, 8, 32, 64, 256, 1024, 2048))
    for name, make, tokens, logit_rows, kv in _cases(runner, rows, prefill, a.grow):
        reps = 20 if tokens <= 64 else 5
        _timed(runner, make, logit_rows, 2)
        t = statistics.median(_timed(runner, make, logit_rows, 1) for _ in range(reps))
        if rates is None:
            print(f"{name:20s} {t * 1e3:8.2f} ms")
        else:
            f = step_floor(shape, rates, tokens, logit_rows, kv)
            print(f"{name:20s} {t * 1e3:8.2f} ms; floor {f.seconds * 1e3:7.2f} ms (GEMMs "
                  f"{f.compute_s * 1e3:.2f}, bytes {f.memory_s * 1e3:.2f}): "
                  f"{f.seconds / t:.0%}")
        if a.profile:
            _profile(runner, make, logit_rows, a.profile)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
