"""The worker's step with and without one of its CPU fast paths, in one process.

    python -m bench.step_ab MODEL_DIR [--change silu|stack|dpbf16|layers] [--threads 1]
                            [--rounds 5] [--rows 1,8,32,64]
                            [--prefills 1x2000,4x500,16x128]

--change silu: the one-pass SiLU gate product (kernels/fused_layers.py) against
transformers' eager `act_fn(gate) * up`, on one runner. --change stack: the stacked q/k/v
and gate/up products (kernels/fused_projections.py) against separate products, on two
runners of the same model. --change dpbf16: the C bfloat16 product over pair-packed
weights (kernels/dpbf16_linear.py) against oneDNN's prepacked one, on two runners.
--change layers: a step's layers in one C call (kernels/step_layers.py)
against the layer loop's calls from Python, on one runner. Each round times every step
once with the fast path and once without, which
goes first alternating between rounds; prints the median ms of each and the median and
range of the per-round ratios (without / with: above 1 means the fast path is faster),
with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

from bench.worker_step import CONTEXT, _cases, _step


def _prefills(runner, spec: str):
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    vocab = runner.facts.vocab_size
    cases = []
    for item in spec.split(","):
        count, tokens = (int(x) for x in item.split("x"))
        group = KVGroup(runner.kv_shape)
        for i in range(count):
            group.add_empty_row(i, tokens + 1)

        def make(r, g=group, count=count, tokens=tokens):
            b = PackedBatch(r.device, r.layer_attention)
            for i in range(count):
                b.add_row(g, i, [(i * 131 + j * 7919 + 11) % vocab for j in range(tokens)], 0)
            return b
        cases.append((f"prefill {item}", make, count))
    return cases


def _silu_variants(model: str):
    """One runner; the MLPs' forward switched between the C product and eager code."""
    from worker_service.kernels import fused_layers
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(model, dtype="bfloat16")
    mlps = [m for m in runner.model.modules()
            if getattr(m.forward, "__func__", None) is fused_layers._silu_mul]
    assert mlps, "no MLP runs the C product on this model"

    def use(fast: bool):
        for m in mlps:
            m.forward = types.MethodType(fused_layers._silu_mul if fast
                                         else type(m).forward, m)
        return runner
    return use, f"{len(mlps)} MLPs"


def _stack_variants(model: str):
    """Two runners of the model, with and without the stacked products."""
    from worker_service.kernels import fused_projections
    from worker_service.model_runner import ModelRunner

    fast = ModelRunner(model, dtype="bfloat16")
    stacked = sum(isinstance(m, fused_projections.SharedProduct) for m in fast.model.modules())
    assert stacked, "no layer takes a stacked product on this model"
    names = ("fuse_qkv", "fuse_gate_up")
    saved = {n: getattr(fused_projections, n) for n in names}
    for n in names:
        setattr(fused_projections, n, lambda m, make: 0)
    try:
        plain = ModelRunner(model, dtype="bfloat16")
    finally:
        for n, fn in saved.items():
            setattr(fused_projections, n, fn)
    return (lambda on: fast if on else plain), f"{stacked} stacked products"


def _dpbf16_variants(model: str):
    """Two runners of the model, its linear layers on the C product and on oneDNN."""
    from worker_service.kernels import dpbf16_linear, linear_prepack
    from worker_service.model_runner import ModelRunner

    fast = ModelRunner(model, dtype="bfloat16")
    in_c = sum(isinstance(m, linear_prepack.PrepackedLinear) and m.c_product
               for m in fast.model.modules())
    assert in_c, "no layer takes the C product here (no AVX512-BF16, or switched off)"
    library = dpbf16_linear.library
    dpbf16_linear.library = lambda: None
    try:
        onednn = ModelRunner(model, dtype="bfloat16")
    finally:
        dpbf16_linear.library = library
    return (lambda on: fast if on else onednn), f"{in_c} products in C against oneDNN"


def _layers_variants(model: str):
    """One runner; steps through the one C call over all layers, or layer by layer from
    Python."""
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(model, dtype="bfloat16")
    loop = runner.layer_loop
    call = loop.step_layers if loop is not None else None
    assert call is not None, "this model's steps do not take the C call"

    def use(fast: bool):
        loop.step_layers = call if fast else None
        return runner
    return use, f"{len(loop.layers)} layers in one C call against Python"


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--change", choices=tuple(VARIANTS), default="silu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--prefills", default="1x2000,4x500,16x128")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    use, what = VARIANTS[a.change](a.model)
    runner = use(True)
    rows = [int(x) for x in a.rows.split(",") if x]
    cases = [(n, mk, lr) for n, mk, _, lr, _ in _cases(runner, rows, [])]
    cases += _prefills(runner, a.prefills) if a.prefills else []
    print(f"{a.model}: {what}, {a.threads} threads, decode contexts "
          f"{CONTEXT - 99}-{CONTEXT}, load average {os.getloadavg()[0]:.2f}")
    for name, make, logit_rows in cases:
        for fast in (True, False):
            _step(use(fast), make, logit_rows)
        times = {True: [], False: []}
        reps = 10 if "decode" in name else 1
        for r in range(a.rounds):
            for fast in ((True, False) if r % 2 else (False, True)):
                runner = use(fast)
                t0 = time.perf_counter()
                for _ in range(reps):
                    _step(runner, make, logit_rows)
                times[fast].append((time.perf_counter() - t0) / reps)
        ratios = sorted(e / c for e, c in zip(times[False], times[True]))
        print(f"{name:18s} without {statistics.median(times[False]) * 1e3:8.2f} ms  with "
              f"{statistics.median(times[True]) * 1e3:8.2f} ms  without/with "
              f"{statistics.median(ratios):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})  "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


VARIANTS = {"silu": _silu_variants, "stack": _stack_variants, "dpbf16": _dpbf16_variants,
            "layers": _layers_variants}

if __name__ == "__main__":
    main()
