"""What a preempted sequence costs to bring back, by recompute or by KV swap.

`python -m bench.swap_cost MODEL [--lengths 128,512,2048] [--device cuda]` prints, for
each context length, the prefill time of one sequence of that length (what recompute
pays) and the time to copy its KV to pinned host memory and back (what a swap pays),
with the KV bytes and the copy rates. On CPU the KV already lives in host memory, so the
copy column there is a memory-to-memory copy and only shows what a swap would not save.
The worker's own choice uses the rates it measures at start (worker_service/kv_swap.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.floor import ModelShape


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model_dir: Path, lengths: list[int], device: torch.device, repeats: int) -> list[dict]:
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    shape = ModelShape.from_config(config.to_dict())
    per_token = replace(shape, dtype_bytes=model.dtype.itemsize).kv_bytes_per_token()
    rows = []
    for n in lengths:
        ids = torch.randint(0, config.vocab_size, (1, n), device=device)
        with torch.inference_mode():
            prefill = _median_ms(lambda: model(ids, use_cache=True), device, repeats)
        nbytes = per_token * n
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_device.random_(0, 255)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        out_ms = _median_ms(lambda: host.copy_(on_device, non_blocking=True), device, repeats)
        in_ms = _median_ms(lambda: on_device.copy_(host, non_blocking=True), device, repeats)
        rows.append({"tokens": n, "kv_bytes": nbytes, "prefill_ms": prefill,
                     "swap_out_ms": out_ms, "swap_in_ms": in_ms,
                     "out_gb_s": nbytes / out_ms / 1e6, "in_gb_s": nbytes / in_ms / 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.swap_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--lengths", default="128,512,2048,8192")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args(argv)
    rows = measure(a.model, [int(x) for x in a.lengths.split(",")], torch.device(a.device),
                   a.repeats)
    print(f"{a.model.name} on {a.device}: prefill (recompute) against KV copy out + in (swap)")
    print("| tokens | KV MiB | prefill ms | out ms | in ms | out GB/s | in GB/s | swap/recompute |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        swap = r["swap_out_ms"] + r["swap_in_ms"]
        print(f"| {r['tokens']} | {r['kv_bytes'] / 2**20:.1f} | {r['prefill_ms']:.2f} | "
              f"{r['swap_out_ms']:.3f} | {r['swap_in_ms']:.3f} | {r['out_gb_s']:.1f} | "
              f"{r['in_gb_s']:.1f} | {swap / r['prefill_ms']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
