"""The forward-pass ceiling: how fast the model itself runs the batch shapes a run used, with
no serving around it (no scheduler, no RPC, no sampling, no detokenization, no regrouping).

Method (docs/benchmarks.md):
- decode: a plain `model(...)` forward of `batch` new tokens (one per row) over a
  preallocated `StaticCache` holding `context` tokens per row, timed over `steps` consecutive
  decode positions, the fastest of `repeats` (a ceiling: the least disturbed repeat); `batch`
  is the run's mean sequences per step (seqserve_batch_size) rounded, `context` the
  output-token-weighted mean context of its decode steps. Decode ceiling = batch / step time.
- prefill: a forward of `prefill_batch` prompts of the run's mean prompt length (logits at the
  last position only, as the worker computes them; prefill_batch = batch, at most 4096 tokens
  in all), fastest of `repeats`: prompt tokens/s.
- the run's ceiling: output tokens / (prompt tokens / prefill rate + decode tokens / decode
  rate), where decode tokens = output tokens - requests (the first token of each request comes
  out of its prefill). seqserve's output tokens/s divided by this is its fraction of the ceiling.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

from bench.env import model_dtype, resolve_device
from bench.peer_systems import _load_model, _Threads
from bench.stats import percentile
from bench.workload import BenchRequest

logger = logging.getLogger("seqserve.bench")


def decode_shape(requests: Sequence[BenchRequest]) -> tuple[int, float]:
    """(decode tokens, their mean context): decode step j (1 <= j < output_len) of a request
    attends to prompt_len + j tokens."""
    n = ctx = 0
    for r in requests:
        for j in range(1, r.output_len):
            n += 1
            ctx += r.prompt_len + j
    return n, (ctx / n if n else 0.0)


def forward_ceiling(model_dir: Path, *, batch: int, context: int, prompt_len: int,
                    prefill_batch: int | None = None, device: str = "auto",
                    threads: int | None = None, steps: int = 16, repeats: int = 7,
                    seed: int = 0) -> dict:
    """Decode and prefill forward throughput of the model at the given shapes."""
    prefill_batch = prefill_batch or max(1, min(batch, 4096 // max(1, prompt_len)))
    import torch
    from transformers import StaticCache

    device = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    with _Threads(threads) as th, torch.inference_mode():
        model, dtype = _load_model(model_dir, device)
        vocab = model.config.vocab_size

        def ids(b: int, n: int):
            return torch.randint(3, vocab, (b, n), generator=gen).to(device)

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        # Decode: fill a preallocated cache with `context` tokens per row (not timed).
        cache = StaticCache(config=model.config, max_cache_len=context + steps)
        pos = torch.arange(context, device=device)
        model(input_ids=ids(batch, context), past_key_values=cache, cache_position=pos,
              position_ids=pos.expand(batch, -1), logits_to_keep=1, use_cache=True)
        step_tokens = ids(batch, steps)

        def rewind() -> None:
            # StaticCache layers write at their own running length: back to `context`.
            for layer in getattr(cache, "layers", ()):
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length.fill_(context)

        def decode_steps() -> float:
            rewind()
            sync()
            t0 = time.perf_counter()
            for i in range(steps):
                p = torch.tensor([context + i], device=device)
                model(input_ids=step_tokens[:, i:i + 1], past_key_values=cache,
                      cache_position=p, position_ids=p.expand(batch, 1), use_cache=True)
            sync()
            return (time.perf_counter() - t0) / steps

        decode_steps()  # warm-up
        step_times = [decode_steps() for _ in range(repeats)]

        prompt = ids(prefill_batch, prompt_len)

        def prefill() -> float:
            sync()
            t0 = time.perf_counter()
            model(input_ids=prompt, logits_to_keep=1, use_cache=True)
            sync()
            return time.perf_counter() - t0

        prefill()  # warm-up
        prefill_times = [prefill() for _ in range(repeats)]
    step_s, prefill_s = min(step_times), min(prefill_times)
    out = {"batch": batch, "context": context, "prompt_len": prompt_len,
           "prefill_batch": prefill_batch, "steps": steps, "repeats": repeats, "dtype": dtype,
           "device": device, "torch_threads": th.n,
           "attn_implementation": model.config._attn_implementation,
           "decode_step_ms": 1000 * step_s,
           "decode_step_ms_median": 1000 * percentile(step_times, 50),
           "decode_tokens_per_s": batch / step_s,
           "prefill_ms": 1000 * prefill_s,
           "prefill_ms_median": 1000 * percentile(prefill_times, 50),
           "prefill_tokens_per_s": prefill_batch * prompt_len / prefill_s}
    logger.info("forward ceiling: decode batch %d at context %d: %.1f ms/step (%.0f tokens/s); "
                "prefill %d x %d tokens: %.1f ms (%.0f tokens/s)", batch, context,
                out["decode_step_ms"], out["decode_tokens_per_s"], prefill_batch, prompt_len,
                out["prefill_ms"], out["prefill_tokens_per_s"])
    return out


def run_ceiling(model_dir: Path, requests: Sequence[BenchRequest], mean_batch_size: float,
                output_throughput: float, *, device: str = "auto",
                threads: int | None = None) -> dict:
    """The ceiling of a run with these requests and this observed mean batch size, and the
    run's output tokens/s as a fraction of it."""
    batch = max(1, min(len(requests), round(mean_batch_size)))
    decode_tokens, mean_ctx = decode_shape(requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    mean_prompt = max(1, round(prompt_tokens / len(requests)))
    m = forward_ceiling(model_dir, batch=batch, context=max(1, round(mean_ctx)),
                        prompt_len=mean_prompt, device=device, threads=threads)
    prefill_s = prompt_tokens / m["prefill_tokens_per_s"]
    decode_s = decode_tokens / m["decode_tokens_per_s"]
    ceiling = out_tokens / (prefill_s + decode_s)
    return {"method": "plain HF forward at the run's mean batch and context (see "
                      "bench/ceiling.py)",
            "observed_mean_batch_size": mean_batch_size, "forward": m,
            "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
            "output_tokens": out_tokens, "mean_decode_context": mean_ctx,
            "prefill_s": prefill_s, "decode_s": decode_s,
            "ceiling_output_throughput": ceiling,
            "seqserve_output_throughput": output_throughput,
            "fraction_of_ceiling": output_throughput / ceiling if ceiling else float("nan"),
            "model_dtype": model_dtype(model_dir)}
