"""The vLLM peer of `python -m bench`, run in .bench-peers-venv (`make bench-peers`).

    .bench-peers-venv/bin/python bench/peers/vllm_peer.py SPEC.json RESULT.json

SPEC: {"model": dir, "dtype": "bfloat16", "mode": "offline" | "serve", "max_num_seqs": 64,
       "max_model_len": 2048, "seed": 0, "enforce_eager": false, "probe_bandwidth": false,
       "runs": [{"name": str, "max_concurrency": int | null,
                 "requests": [{"prompt_ids": [int], "output_len": int, "arrival_s": float}]}]}

offline: `vllm.LLM.generate` on every request of a run at once (token-id prompts, greedy,
SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)); the run's time is
the call's. serve: `AsyncLLM.generate` per request, each sent at its arrival_s (at most
max_concurrency in flight), streaming deltas; every token's arrival time is recorded, so the
harness computes TTFT / TPOT / ITL with the same code as for seqserve. A short request warms
the engine up first. KV memory is $VLLM_CPU_KVCACHE_SPACE GiB (the harness sets it).
With probe_bandwidth, the memory's bandwidth is probed just before and after each run, the
engine idle (the run's "bandwidth_probes", bytes/s: the harness's floor of the run).

RESULT: {"vllm": version, "torch": version, "mode", "load_s", "env": {...},
         "runs": [{"name", "duration_s", "output_tokens", "bandwidth_probes" (if asked),
                   "requests": [{"send": s, "token_times": [s], "end": s}]}]}
(times are seconds from time.perf_counter in this process; offline runs have no per-token times)
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import sys
import time


def _params(n: int, delta: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=kind)


def _engine_kwargs(spec: dict) -> dict:
    kw = dict(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
              seed=spec.get("seed", 0), max_num_seqs=spec.get("max_num_seqs", 64),
              enforce_eager=bool(spec.get("enforce_eager", False)))
    if spec.get("max_model_len"):
        kw["max_model_len"] = spec["max_model_len"]
    return kw


def run_offline(spec: dict) -> dict:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(**_engine_kwargs(spec), disable_log_stats=True)
    load_s = time.perf_counter() - t
    first = spec["runs"][0]["requests"][0]["prompt_ids"][:16]
    llm.generate([TokensPrompt(prompt_token_ids=first)], _params(4), use_tqdm=False)  # warm-up
    _freeze_objects()
    runs = []
    for run in spec["runs"]:
        reqs = run["requests"]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
        params = [_params(r["output_len"]) for r in reqs]
        before = _bandwidth() if spec.get("probe_bandwidth") else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
        got = [len(o.outputs[0].token_ids) for o in outs]
        want = [r["output_len"] for r in reqs]
        if got != want:
            raise SystemExit(f"vLLM generated {got}, expected {want}")
        runs.append({"name": run["name"], "duration_s": t1 - t0, "output_tokens": sum(got),
                     "requests": [{"send": t0, "token_times": [], "end": t1} for _ in reqs]})
        if before is not None:
            runs[-1]["bandwidth_probes"] = [before, _bandwidth()]
    return {"load_s": load_s, "runs": runs}


@functools.cache
def _probe_module():
    """bench/bandwidth_probe.py, loaded by its path: the bench package needs seqserve's own
    dependencies, which this Python lacks."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bandwidth_probe.py"
    spec = importlib.util.spec_from_file_location("seqserve_bandwidth_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bandwidth() -> float:
    """The memory's bandwidth now, bytes/s, probed as the harness probes it around its own
    runs."""
    return _probe_module().bandwidth_now()


def _freeze_objects() -> None:
    """As the seqserve driver does before its clock starts (bench/loadgen.py): what start-up
    made leaves the collector's passes, so that no full collection walking it runs on the
    shared cores during a measured run."""
    gc.collect()
    gc.freeze()


async def _serve(spec: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(spec),
                                                       disable_log_stats=True))
    load_s = time.perf_counter() - t
    counter = iter(range(1 << 62))

    async def one(ids: list[int], n: int) -> dict:
        send, times = time.perf_counter(), []
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), _params(n, True),
                                         request_id=f"r{next(counter)}"):
            now = time.perf_counter()
            times += [now] * len(out.outputs[0].token_ids)
        if len(times) != n:
            raise RuntimeError(f"vLLM streamed {len(times)} tokens, expected {n}")
        return {"send": send, "token_times": times, "end": time.perf_counter()}

    try:
        await one(spec["runs"][0]["requests"][0]["prompt_ids"][:16], 4)  # warm-up
        _freeze_objects()
        runs = []
        for run in spec["runs"]:
            cap = run.get("max_concurrency")
            sem = asyncio.Semaphore(cap) if cap else None
            before = _bandwidth() if spec.get("probe_bandwidth") else None
            t0 = time.perf_counter()

            async def timed(r: dict) -> dict:
                delay = t0 + r.get("arrival_s", 0.0) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is None:
                    return await one(r["prompt_ids"], r["output_len"])
                async with sem:
                    return await one(r["prompt_ids"], r["output_len"])

            rows = await asyncio.gather(*(timed(r) for r in run["requests"]))
            runs.append({"name": run["name"],
                         "duration_s": max(x["end"] for x in rows) - min(x["send"] for x in rows),
                         "output_tokens": sum(len(x["token_times"]) for x in rows),
                         "requests": rows})
            if before is not None:
                runs[-1]["bandwidth_probes"] = [before, _bandwidth()]
    finally:
        engine.shutdown()
    return {"load_s": load_s, "runs": runs}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import vllm

    result = run_offline(spec) if spec["mode"] == "offline" else asyncio.run(_serve(spec))
    result.update(vllm=vllm.__version__, torch=torch.__version__, mode=spec["mode"],
                  env={k: v for k, v in os.environ.items() if k.startswith("VLLM_")})
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    raise SystemExit(main(sys.argv[1:]))
