"""`python -m bench scheduler-cost`: the scheduler's own CPU time per step as the number of
workers grows, against fake workers whose Steps take a fixed time (bench/fake_workers.py).

For each worker count N: one process serves N fake workers; the real scheduler process
drives them; the harness streams N x --per-worker requests at once (distinct prompts, so
placement spreads them by load) and records

- scheduler CPU per step: the scheduler process's CPU seconds (user + system, from
  /proc) over the run / the Steps all workers ran; its share of the step time is the
  figure that must stay under 5%. With --frontend-processes N >= 1 the scheduler process
  is the core, and the front-end processes' CPU (tokenizing, detokenizing, streaming to
  clients) is reported beside it, per output token;
- scheduler utilization: its CPU seconds / wall seconds (one core = 100%);
- worker idle: the share of a fake worker's time between answering a Step and taking
  up the next, i.e. the time the scheduler made it wait.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from bench.commands.common import command_line
from bench.deployment import flags
from bench.env import environment
from bench.loadgen import send_requests
from bench.metrics import scrape
from bench.processes import spawn
from bench.profiling import find_py_spy
from bench.report import write
from bench.workload import BenchRequest, make_prompt, round_trip_tokens

logger = logging.getLogger("seqserve.bench")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def make_requests(tokenizer, n: int, prompt_len: int, output_len: int,
                  seed: int) -> list[BenchRequest]:
    rng, safe = random.Random(seed), round_trip_tokens(tokenizer)
    out = []
    for i in range(n):
        text, ids = make_prompt(tokenizer, prompt_len, rng, safe)
        out.append(BenchRequest(i, text, ids, output_len))
    return out


def step_counts(metrics: dict[str, float]) -> tuple[float, float, float]:
    """(Steps, plan seconds, postprocess seconds) over all workers so far."""
    get = metrics.get
    return (get("seqserve_step_seconds_count{phase=worker}", 0.0),
            get("seqserve_step_seconds_sum{phase=plan}", 0.0),
            get("seqserve_step_seconds_sum{phase=postprocess}", 0.0))


def children(pid: int) -> list[int]:
    """Child processes of `pid` (the core's front ends)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def run_one(args, tokenizer, n_workers: int, frontends: int, steps_over: str,
            logdir: Path) -> dict:
    eos = sorted({tokenizer.eos_token_id} - {None})
    fake = spawn("fake-workers", "bench.fake_workers",
                 ["--workers", str(n_workers), "--step-ms", str(args.step_ms),
                  "--vocab-size", str(len(tokenizer)), "--kv-tokens", str(args.kv_tokens),
                  "--stats-file", str(logdir / "fake-workers.stats.json"),
                  *[f"--eos={e}" for e in eos],
                  *(["--no-steps-link"] if steps_over == "grpc" else [])],
                 logdir, wait_ready=False)
    sched = None
    try:
        addresses = ",".join(f"127.0.0.1:{p}" for p in fake.ports["grpc"])
        opts = {"model_id": args.model, "host": "127.0.0.1", "port": 0, "metrics_port": 0,
                "http_port": -1, "openai_port": -1, "worker_addresses": addresses,
                "max_rolling_batch_size": args.per_worker, "max_queue": 100_000,
                "frontend_processes": frontends}
        sched = spawn("scheduler", "scheduler_service.main", flags(opts), logdir,
                      timeout=120)
        address = f"127.0.0.1:{sched.ports['grpc']}"
        metrics_url = f"http://127.0.0.1:{sched.ports['metrics']}/metrics"
        warm = make_requests(tokenizer, n_workers, args.prompt_len, 4, seed=-1)
        asyncio.run(send_requests(address, warm))
        requests = make_requests(tokenizer, n_workers * args.per_worker, args.prompt_len,
                                 args.output_len, seed=args.seed)
        spy = None
        if args.profile:  # samples only while the scheduler holds the GIL: its CPU
            spy = subprocess.Popen([find_py_spy(), "record", "-p", str(sched.proc.pid), "-g",
                                    "-r", "250", "-f", "raw", "-o", str(logdir / "scheduler.spy")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            time.sleep(1)
        fe_pids = children(sched.proc.pid)
        before, cpu0, t0 = step_counts(scrape(metrics_url)), cpu_seconds(sched.proc.pid), \
            time.perf_counter()
        fe0 = sum(cpu_seconds(p) for p in fe_pids)
        asyncio.run(send_requests(address, requests))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(sched.proc.pid) - cpu0
        fe_cpu = sum(cpu_seconds(p) for p in fe_pids) - fe0
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        after = step_counts(scrape(metrics_url))
    finally:
        if sched is not None:
            sched.stop()
        fake.stop(signal.SIGTERM)
    stats = json.loads((logdir / "fake-workers.stats.json").read_text())
    steps = after[0] - before[0]
    step_s = args.step_ms / 1000
    per_step = cpu / steps
    tokens = len(requests) * args.output_len
    return {
        "workers": n_workers, "frontend_processes": frontends, "steps_over": steps_over,
        "frontend_cpu_s": fe_cpu,
        "frontend_cpu_per_token_us": fe_cpu / tokens * 1e6,
        "requests": len(requests), "steps": steps,
        "wall_s": wall, "scheduler_cpu_s": cpu,
        "scheduler_cpu_per_step_ms": per_step * 1000,
        "sequences_per_step": len(requests) * args.output_len / steps,
        "scheduler_cpu_per_token_us": cpu / (len(requests) * args.output_len) * 1e6,
        "share_of_step": per_step / step_s,
        "scheduler_utilization": cpu / wall,
        "plan_ms_per_step": (after[1] - before[1]) / steps * 1000,
        "postprocess_ms_per_step": (after[2] - before[2]) / steps * 1000,
        "steps_per_worker_per_s": steps / n_workers / wall,
        "ideal_steps_per_worker_per_s": 1 / step_s,
        # Whole life of the fake workers, warm-up included.
        "worker_idle_share": stats["idle_s"] / max(stats["idle_s"] + stats["busy_s"], 1e-9),
        "output_tokens_per_s": len(requests) * args.output_len / wall,
    }


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"### Scheduler cost per step, fake workers of {a['step_ms']:g} ms per Step",
             "", f"{a['per_worker']} requests per worker at once ({a['prompt_len']} prompt "
             f"tokens, {a['output_len']} output each), `max_rolling_batch_size` "
             f"{a['per_worker']}; load average {result['env']['load_average']} at start.",
             "", "Front ends 0: clients served by the scheduler process; N: by N front-end "
             "processes, and the scheduler columns are the core's.",
             "Steps over: link, the workers' direct Steps link; grpc, the Steps call.",
             "", "| workers | front ends | Steps over | Steps | sequences per Step "
             "| scheduler CPU per Step ms "
             "| share of the Step | scheduler CPU per token us | front ends' CPU per token us "
             "| scheduler CPU / wall | Steps per worker per s (ideal) | worker idle "
             "| output tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['workers']} | {r['frontend_processes']} | {r['steps_over']} | "
            f"{r['steps']:.0f} | "
            f"{r['sequences_per_step']:.1f} | "
            f"{r['scheduler_cpu_per_step_ms']:.2f} | {r['share_of_step']:.1%} | "
            f"{r['scheduler_cpu_per_token_us']:.0f} | {r['frontend_cpu_per_token_us']:.0f} | "
            f"{r['scheduler_utilization']:.0%} | "
            f"{r['steps_per_worker_per_s']:.1f} ({r['ideal_steps_per_worker_per_s']:.0f}) | "
            f"{r['worker_idle_share']:.0%} | {r['output_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def run(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out = Path(args.out)
    env = environment()
    runs = []
    for n in args.workers:
        # alternated, so a change of load hits every variant
        for fe, over in itertools.product(args.frontend_processes, args.steps_over):
            logdir = out / "logs" / f"scheduler-cost-{n}-fe{fe}-{over}"
            logdir.mkdir(parents=True, exist_ok=True)
            r = run_one(args, tokenizer, n, fe, over, logdir)
            logger.info("%d workers, %d front ends, Steps over %s: %.2f ms scheduler CPU per "
                        "Step (%.1f%% of %g ms), utilization %.0f%%, worker idle %.0f%%", n, fe,
                        over, r["scheduler_cpu_per_step_ms"], 100 * r["share_of_step"],
                        args.step_ms, 100 * r["scheduler_utilization"],
                        100 * r["worker_idle_share"])
            runs.append(r)
    result = {"benchmark": "scheduler-cost", "command": command_line(), "env": env,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k in ("step_ms", "per_worker", "prompt_len", "output_len", "model",
                                "workers", "seed", "kv_tokens", "frontend_processes",
                                "steps_over")},
              "runs": runs}
    md = markdown(result)
    write(out, "scheduler-cost", result, md)
    print(md, flush=True)
    return result
