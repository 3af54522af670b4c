"""The command line of `python -m bench`: one subcommand per benchmark, options in groups
shared between them."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.commands.common import DEFAULT_MODEL
from bench.commands.matrix import MATRIX_FRACTIONS
from bench.commands.serve import RATE_FRACTIONS
from bench.commands.sweep import SWEEP_SPARSITIES, SWEEP_SPLITS
from bench.policy_plan import (DEFAULT_BATCH_LIMIT, DEFAULT_FRACTIONS, DEFAULT_POLICIES,
                               DEFAULT_REQUESTS, DEFAULT_URGENT_FRACTION, DEFAULT_WARMUP,
                               DEFAULT_WORKLOADS, URGENT_PRIORITY)
from bench import policy_sim_report
from bench.peer_systems import PEERS
from bench.workload import ARRIVALS, WORKLOADS

COMMANDS = ("throughput", "sweep", "partition", "prefix", "serve", "peers", "ceiling", "matrix",
            "matrix-median", "all", "scheduler-cost", "replicas", "policies", "offline-batch",
            "length-prediction", "policy-sim")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _choices(*allowed: str):
    def parse(text: str) -> list[str]:
        items = _list(text)
        if not items or any(x not in allowed for x in items):
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of "
                                             f"{', '.join(allowed)}")
        return items
    return parse


def _rates(text: str) -> list[float]:
    """'auto' (empty list: fractions of the offline request rate) or comma-separated rates."""
    return [] if text.strip() == "auto" else _floats(text)


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    bad = set(names) - set(PEERS)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {sorted(bad)}; choose from {PEERS}")
    return names


# The parent groups are functions: argparse shares a parent's argument objects with every
# subcommand built from it, so a subcommand that changes a default (policies) takes fresh ones.


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("workload and output")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help=f"model directory (default {DEFAULT_MODEL}; made if missing)")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default="azure-conv",
                   help="trace (azure-conv)")
    g.add_argument("--trace", type=Path, default=None,
                   help="trace file (default: the workload's copy in bench/data/)")
    g.add_argument("--num-requests", type=int, default=64, help="first N trace rows (64)")
    g.add_argument("--prompt-scale", type=float, default=0.25, help="Azure prompt scale (0.25)")
    g.add_argument("--max-prompt", type=int, default=512, help="Azure prompt cap (512)")
    g.add_argument("--output-scale", type=float, default=0.5, help="Azure output scale (0.5)")
    g.add_argument("--max-output", type=int, default=None,
                   help="output cap (128 for Azure, 32 for Mooncake)")
    g.add_argument("--mooncake-block", type=int, default=32,
                   help="tokens per Mooncake hash block (512 in the trace; lengths scale alike)")
    g.add_argument("--seed", type=int, default=0, help="prompt token and arrival seed")
    g.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="directory for JSON, markdown and server logs (bench-results/)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="worker and in-process peer device (auto: cuda when torch sees it)")
    g.add_argument("--max-rolling-batch-size", type=int, default=64,
                   help="seqserve's batch limit, and vLLM's max_num_seqs (64)")
    g.add_argument("--server-option", action="append", metavar="KEY=VALUE",
                   help="any seqserve serving option for both processes, e.g. "
                        "max_num_batched_tokens=2048 (repeatable)")
    g.add_argument("--log-level", default="INFO")
    return common


def _srv() -> argparse.ArgumentParser:
    srv = argparse.ArgumentParser(add_help=False)
    g = srv.add_argument_group("seqserve configuration")
    g.add_argument("--max-sparsity", type=float, default=0.33)
    g.add_argument("--max-splits", type=int, default=3)
    return srv


def _slo() -> argparse.ArgumentParser:
    slo = argparse.ArgumentParser(add_help=False)
    g = slo.add_argument_group("goodput (vLLM: a request is good when it meets every limit)")
    g.add_argument("--goodput-ttft-ms", type=float, default=None)
    g.add_argument("--goodput-tpot-ms", type=float, default=None)
    g.add_argument("--goodput-e2e-ms", type=float, default=None)
    return slo


def _peers() -> argparse.ArgumentParser:
    prs = argparse.ArgumentParser(add_help=False)
    g = prs.add_argument_group("peers and vLLM")
    g.add_argument("--peers", type=_names, default=list(PEERS),
                   help="comma-separated peers: hf, hf-cb, vllm, or none (all three); the "
                        "serve command runs vllm only")
    g.add_argument("--no-ceiling", action="store_true", help="skip the forward-pass ceiling")
    g.add_argument("--no-floor", action="store_true",
                   help="peers, matrix: skip the floor (bench/floor.py: measured bf16 GEMM rate "
                        "and memory bandwidth)")
    g.add_argument("--profile", action="store_true",
                   help="peers: after seqserve's measured run, sample the worker and scheduler "
                        "with py-spy during a second run (collapsed stacks in OUT/profile/, "
                        "top frames in the report)")
    g.add_argument("--no-throughput-report", action="store_true",
                   help="peers: do not also write throughput.json/md (the HF "
                        "comparison from the same run)")
    g.add_argument("--vllm-kv-gib", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE in GiB (4, as seqserve's kv_cache_bytes)")
    g.add_argument("--vllm-threads-bind", default="all",
                   help="'all' (OpenMP threads on every core, none reserved), 'auto' "
                        "(vLLM's default: reserves a core), or a VLLM_CPU_OMP_THREADS_BIND list")
    g.add_argument("--vllm-enforce-eager", action="store_true",
                   help="vLLM without torch.compile")
    g.add_argument("--vllm-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="vLLM's dtype (default: the model's, or float32 where this CPU "
                        "has no native path for the model's half precision, as vLLM's "
                        "user would pick there)")
    g.add_argument("--vllm-preload", action="store_true",
                   help="LD_PRELOAD libiomp5 (from the peer venv) and libtcmalloc (where "
                        "installed) for vLLM, as its CPU guide advises")
    g.add_argument("--plot-dir", default="docs", help="PNG directory ('' for none)")
    return prs


def build_parser(doc: str) -> argparse.ArgumentParser:
    common, srv, slo, prs = _common(), _srv(), _slo(), _peers()
    hf = argparse.ArgumentParser(add_help=False)
    g = hf.add_argument_group("HF peers")
    g.add_argument("--hf-batch-size", type=int, default=16)
    g.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads for the in-process peers and the ceiling (all cores)")
    g.add_argument("--no-hf", action="store_true", help="throughput: skip the HF baseline")

    load = argparse.ArgumentParser(add_help=False)
    g = load.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=ARRIVALS, default="all",
                   help="all at once, Poisson (--rate / --rates, seeded), or the trace's "
                        "timestamps / --speedup")
    g.add_argument("--rate", type=float, default=None, help="Poisson rate, requests/s")
    g.add_argument("--rates", type=_rates, default=None,
                   help="Poisson rate sweep: comma-separated requests/s, or 'auto' (fractions "
                        "of seqserve's offline request rate, --rate-fractions)")
    g.add_argument("--rate-fractions", type=_floats, default=list(RATE_FRACTIONS),
                   help="auto sweep fractions (0.25,0.5,0.75,0.9,1.1,1.5)")
    g.add_argument("--speedup", type=float, default=1.0, help="trace arrivals: time / speedup")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--address", default=None,
                   help="serve: load a running scheduler at host:port instead of starting one")
    g.add_argument("--metrics-url", default=None,
                   help="serve --address: its scheduler's /metrics URL, for server figures")

    swp = argparse.ArgumentParser(add_help=False)
    g = swp.add_argument_group("sweep")
    g.add_argument("--sparsities", type=_floats, default=list(SWEEP_SPARSITIES),
                   help="comma-separated max_sparsity values (0,0.1,0.33,0.6,0.9)")
    g.add_argument("--splits", type=_ints, default=list(SWEEP_SPLITS),
                   help="comma-separated max_splits values (1,2,3,4,8)")
    g.add_argument("--plot", default="docs/sweep.png", help="PNG path ('' for none)")

    prt = argparse.ArgumentParser(add_help=False)
    g = prt.add_argument_group("partition")
    g.add_argument("--repeats", type=int, default=201, help="timeit repeats (201)")

    pfx = argparse.ArgumentParser(add_help=False)
    g = pfx.add_argument_group("prefix cache")
    g.add_argument("--prefix-parts", type=lambda t: [x for x in t.split(",") if x],
                   default=["cached", "mooncake"], help="cached,mooncake (both)")
    g.add_argument("--cached-tokens", type=int, default=512, help="cached_prompt tokens (512)")
    g.add_argument("--input-tokens", type=int, default=16, help="input tokens (16)")
    g.add_argument("--prefix-requests", type=int, default=16,
                   help="measured cached_prompt requests, one at a time (16)")
    g.add_argument("--prefix-output", type=int, default=8, help="their output tokens (8)")
    g.add_argument("--mooncake-model", type=Path, default=None,
                   help="model of the Mooncake replay (default --model)")
    g.add_argument("--mooncake-requests", type=int, default=64, help="requests replayed (64)")
    g.add_argument("--mooncake-max-output", type=int, default=32, help="output cap (32)")
    g.add_argument("--mooncake-select", choices=("first", "conversations"), default="first",
                   help="first N rows, or N rows of multi-turn conversations")
    g.add_argument("--mooncake-arrival", choices=("trace", "all"), default="trace",
                   help="trace timestamps / --mooncake-speedup, or all at once")
    g.add_argument("--mooncake-speedup", type=float, default=1.0,
                   help="trace time / speedup (1: the first 64 rows arrive over 18 s)")
    g.add_argument("--mooncake-max-concurrency", type=int, default=None,
                   help="Mooncake requests in flight at most (no cap)")

    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("throughput", parents=[common, srv, hf],
                   help="seqserve vs HF generate tokens/s")
    sub.add_parser("sweep", parents=[common, swp], help="max_sparsity x max_splits grid")
    sub.add_parser("partition", parents=[common, prt], help="plan_partition timing")
    sub.add_parser("prefix", parents=[common, pfx], help="prefix cache figures")
    sub.add_parser("serve", parents=[common, srv, slo, load, prs],
                   help="load generator: arrivals, rate sweep, vLLM alongside")
    sub.add_parser("peers", parents=[common, srv, hf, slo, prs],
                   help="seqserve vs HF, transformers CB, vLLM; the ceiling")
    ce = sub.add_parser("ceiling", parents=[common, hf],
                        help="the model's own forward throughput at given shapes")
    ce.add_argument("--batch", type=int, required=True, help="decode rows")
    ce.add_argument("--context", type=int, required=True, help="cached tokens per row")
    ce.add_argument("--prompt-len", type=int, required=True, help="prefill prompt length")
    ce.add_argument("--prefill-batch", type=int, default=None,
                    help="prompts per prefill forward (default: batch, <= 4096 tokens)")
    ce.add_argument("--repeats", type=int, default=7, help="timed repeats; the fastest counts")
    mx = sub.add_parser("matrix", parents=[common, srv, hf, slo, prs],
                        help="seqserve vs vLLM and HF on models x traces x Poisson rates, "
                             "with the floor (make bench)")
    g = mx.add_argument_group("matrix")
    g.add_argument("--models", type=_list, default=None,
                   help="comma-separated: mid, smollm2, qwen2-gqa, tiny or model directories "
                        "(mid,smollm2,qwen2-gqa; tiny with --quick)")
    g.add_argument("--traces", type=_list, default=["azure-conv", "azure-code", "mooncake"],
                   help="comma-separated workloads (azure-conv,azure-code,mooncake)")
    g.add_argument("--rate-fractions", type=_floats, default=None,
                   help="Poisson rates as fractions of seqserve's all-at-once request rate "
                        "(0.5,0.75,0.9,1.1; 0.5,1.1 with --quick)")
    g.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, 4 requests of at most 64 + 8 tokens a trace, "
                        "two rates, a short GEMM grid, small KV memory")
    mm = sub.add_parser("matrix-median", help="the median of several `matrix` runs' "
                        "matrix.json, each run's ratio listed (markdown on stdout)")
    mm.add_argument("runs", type=Path, nargs="+", help="matrix.json of each run")
    mm.add_argument("--log-level", default="INFO")
    sc = sub.add_parser("scheduler-cost", help="the scheduler's CPU per Step against 1..N "
                        "fake workers")
    sc.add_argument("--model", type=Path, default=Path("models/test/tiny-llama"),
                    help="the scheduler's tokenizer (models/test/tiny-llama)")
    sc.add_argument("--workers", type=_ints, default=[1, 8, 32], help="worker counts (1,8,32)")
    sc.add_argument("--step-ms", type=float, default=20.0, help="fake Step time (20 ms)")
    sc.add_argument("--per-worker", type=int, default=16,
                    help="requests per worker, all at once; also the batch limit (16)")
    sc.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (64)")
    # 256: /proc counts CPU in 10 ms ticks, and at 64 tokens a 1-worker run used ~7 of them.
    sc.add_argument("--output-len", type=int, default=256, help="output tokens (256)")
    sc.add_argument("--kv-tokens", type=int, default=65536, help="fake KV capacity (65536)")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--frontend-processes", type=_ints, default=[0],
                    help="option.frontend_processes values to run each worker count with "
                         "(0: clients served by the scheduler process; e.g. 0,1)")
    sc.add_argument("--steps-over", type=_choices("link", "grpc"), default=["link"],
                    help="how Steps reach the fake workers, each run in turn: link (their "
                         "direct Steps link), grpc (none offered); e.g. link,grpc")
    sc.add_argument("--profile", action="store_true",
                    help="py-spy the scheduler during each measured run (logs/*/scheduler.spy)")
    sc.add_argument("--out", type=Path, default=Path("bench-results"))
    sc.add_argument("--log-level", default="INFO")
    rp = sub.add_parser("replicas", parents=[common, srv],
                        help="the same cores as 1 worker x N threads, N workers x 1 thread, TP")
    rp.add_argument("--configs", default="1x2,2x1",
                    help="WORKERSxTHREADS or tpDxTHREADS, comma-separated (1x2,2x1)")
    rp.add_argument("--repeats", type=int, default=1, help="runs of every config (1)")
    _policies_parser(sub, [_common(), _srv(), _slo(), _peers()])
    _offline_batch_parser(sub, [_common(), _srv()])
    lp = sub.add_parser("length-prediction", help="length predictors' error, Acc-50, Acc-100: "
                        "the prompt-id one on the traces; it and the worker's hidden-state "
                        "probe on real SmolLM2 answers")
    lp.add_argument("--data", type=Path, default=Path("/work/shared/data"), help="the traces")
    lp.add_argument("--lag", type=int, default=64,
                    help="trace requests that arrive before one finishes and is learned (64)")
    lp.add_argument("--skip-traces", action="store_true", help="only the SmolLM2 table")
    lp.add_argument("--model", type=Path, default=None,
                    help="SmolLM2-135M-Instruct directory (default: made under models/)")
    lp.add_argument("--out", type=Path, default=Path("bench-results"),
                    help="where the greedy answers are cached (bench-results)")
    lp.add_argument("--log-level", default="INFO")
    policy_sim_report.add_parser(sub)
    sub.add_parser("all", parents=[common, srv, hf, slo, prs, load, swp, prt, pfx],
                   help="every figure: peers, sweep, partition, prefix, Poisson sweep")
    return parser


def _policies_parser(sub, parents) -> None:
    pp = sub.add_parser("policies", parents=parents,
                        help="each scheduling policy against FCFS at fractions of FCFS's knee, "
                             "per trace (issue 19; make bench-policies)")
    # Defaults of this command, not of the shared groups: SmolLM2, no peer unless asked,
    # DEFAULT_REQUESTS measured rows and a batch limit of DEFAULT_BATCH_LIMIT, so that a
    # queue forms (see bench/policy_plan.py for why these).
    pp.set_defaults(model=None, peers=[], num_requests=None,
                    max_rolling_batch_size=DEFAULT_BATCH_LIMIT)
    g = pp.add_argument_group("policies")
    g.add_argument("--workloads", type=_list, default=list(DEFAULT_WORKLOADS),
                   help="comma-separated traces (azure-conv,azure-code,mooncake)")
    g.add_argument("--policies", type=_list, default=list(DEFAULT_POLICIES),
                   help="comma-separated: fcfs (required), fcfs-unchunked, priority, mlfq, "
                        "length-aware (all of these); by name only: priority-unshielded, "
                        "priority-shield32/64/256 (the urgent shield's cap), priority-swap, "
                        "mlfq-swap (victims swapped, not recomputed)")
    g.add_argument("--rate-fractions", type=_floats, default=list(DEFAULT_FRACTIONS),
                   help="Poisson rates as fractions of FCFS's knee (0.5,0.8,1.0)")
    g.add_argument("--knee-rate", type=float, default=None,
                   help="FCFS's knee in requests/s, from an earlier run, instead of the "
                        "probes (one trace only); the all-at-once probe still runs")
    g.add_argument("--knee-fractions", type=_floats, default=list(MATRIX_FRACTIONS),
                   help="the knee probes, fractions of FCFS's all-at-once request rate, as "
                        "the matrix's (0.5,0.75,0.9,1.1)")
    g.add_argument("--urgent-fraction", type=float, default=DEFAULT_URGENT_FRACTION,
                   help="fraction of requests sent as urgent, seeded (0.1)")
    g.add_argument("--urgent-priority", type=int, default=URGENT_PRIORITY,
                   help="their priority; the others send 0 (-10; lower is more urgent)")
    g.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help="trace rows before the measured ones, sent all at once to every "
                        f"server first and not measured ({DEFAULT_WARMUP})")
    counts = ", ".join(f"{k} {v}" for k, v in DEFAULT_REQUESTS.items())
    pp.epilog = ("--model defaults to smollm2 (bfloat16, bench/matrix_models.py), "
                 f"--max-rolling-batch-size to {DEFAULT_BATCH_LIMIT}, --num-requests (for every "
                 f"trace where given) to {counts}, each above the batch limit (refused "
                 "otherwise: no queue would form); lengths are scaled as the matrix's.")


def _offline_batch_parser(sub, parents) -> None:
    ob = sub.add_parser("offline-batch", parents=parents,
                        help="one offline batch job: FCFS vs length-batched (VBS + FCR) vs "
                             "the oracle (bench/commands/offline_batch.py)")
    # Defaults of this command only (fresh parents): SmolLM2, 128 rows, max_new_tokens 256.
    ob.set_defaults(model=Path("smollm2"), num_requests=128, max_output=256,
                    max_rolling_batch_size=128)
    ob.add_argument("--warmup-requests", type=int, default=64,
                    help="other trace rows every server learns from first (64)")
    ob.add_argument("--base-batch", type=int, default=16,
                    help="KV budget: this many sequences of mean prompt + max_new_tokens (16)")
    ob.add_argument("--bucket-tokens", type=int, default=50,
                    help="predicted-length bucket, option.length_bucket_tokens (50)")
