"""Accuracy of the length-aware policy's response-length predictor on the real traces, as
the Response Length Perception paper reports it: mean absolute error (tokens), Acc-50 and
Acc-100 (share of predictions within 50 / 100 tokens of the real length).

Replayed online in arrival order, as the scheduler meets the requests: each request is
predicted from what finished before it, then learned from. The traces hold lengths only,
no text, so the Azure traces give the predictor only the prompt length; Mooncake's
hash_ids (512-token prefix blocks) stand in for the prompt's prefix keys.

    python -m bench.length_prediction [--data /work/shared/data] [--lag 64]

`python -m bench length-prediction` also measures, on real instructions to SmolLM2-135M-
Instruct with their true greedy lengths (bench/length_prompts.py), the worker's
hidden-state probe (worker_service/length_probe.py, in process) against the prompt-id
predictor on the same sequence: each request predicted, then learned, in arrival order,
and the probe's cost per Step.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import deque
from pathlib import Path

from scheduler_service.policies.length_predictor import Accuracy, LengthPredictor, prefix_keys

DATA = Path("/work/shared/data")
MAX_NEW_TOKENS = 4096  # the fallback before any data (the server's max_new_tokens_limit)


def azure(path: Path) -> list[tuple[int, list[int], int]]:
    with open(path) as f:
        return [(int(r["ContextTokens"]), [], int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]


def mooncake(path: Path) -> list[tuple[int, list[int], int]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["input_length"], list(r["hash_ids"]), r["output_length"]) for r in rows]


def replay(rows: list[tuple[int, list[int], int]], lag: int) -> dict[str, float]:
    """Predict each row, learn it `lag` rows later (requests finish after others arrive)."""
    predictor, acc, done = LengthPredictor(), Accuracy(), deque()
    for prompt, keys, real in rows:
        acc.add(predictor.predict(prompt, keys, MAX_NEW_TOKENS), real)
        done.append((prompt, keys, real))
        if len(done) > lag:
            predictor.learn(*done.popleft())
    return acc.summary()


def traces_table(data: Path, lag: int) -> None:
    traces = {"Azure conv": azure(data / "AzureLLMInferenceTrace_conv.csv"),
              "Azure code": azure(data / "AzureLLMInferenceTrace_code.csv"),
              "Mooncake conv": mooncake(data / "mooncake_conversation_trace.jsonl")}
    print("| trace | requests | error (tokens) | Acc-50 | Acc-100 |")
    print("|---|---|---|---|---|")
    for name, rows in traces.items():
        s = replay(rows, lag)
        print(f"| {name} | {s['n']} | {s['error']:.0f} | {s['acc50']:.0%} | {s['acc100']:.0%} |")


def hidden_state_table(model: Path, cache: Path) -> None:
    """Both predictors on the same real sequences, each predicted before it is learned;
    scored from the request where the probe first predicts (before it, the worker sends
    none and the prompt-id prediction stands)."""
    import torch

    from bench.length_prompts import MAX_NEW_TOKENS, generate
    from worker_service.length_probe import LengthProbe

    rows = generate(model, cache)
    probe = LengthProbe(len(rows[0].hidden))
    prompt = LengthPredictor()
    acc = {"hidden-state probe (worker)": Accuracy(), "prompt-id predictor (scheduler)": Accuracy()}
    observe_s, train_s, trains = [], [], 0
    for i, r in enumerate(rows):
        keys = prefix_keys(r.prompt_ids, prompt.cfg.block_tokens)
        t = time.perf_counter()
        h = probe.observe(i, torch.tensor(r.hidden))
        observe_s.append(time.perf_counter() - t)
        p = prompt.predict(len(r.prompt_ids), keys, MAX_NEW_TOKENS)
        if h is not None:
            acc["hidden-state probe (worker)"].add(min(h, MAX_NEW_TOKENS), r.length)
            acc["prompt-id predictor (scheduler)"].add(p, r.length)
        probe.finished(i, r.length, exact=not r.cut)
        prompt.learn(len(r.prompt_ids), keys, r.length)
        while True:  # every minibatch owed (the worker runs one a Step)
            t = time.perf_counter()
            ran = probe.train(1)
            if not ran:
                break
            train_s.append(time.perf_counter() - t)
            trains += 1
    ridge = _ridge_log_length(rows, len(rows) - acc["hidden-state probe (worker)"].n)
    acc.update(ridge)
    n = acc["hidden-state probe (worker)"].n
    print(f"\n{len(rows)} instructions, {sum(r.cut for r in rows)} cut at {MAX_NEW_TOKENS} "
          f"tokens; scored from request {len(rows) - n + 1} (the probe's first prediction)\n")
    print("| predictor | requests | error (tokens) | Acc-50 | Acc-100 |")
    print("|---|---|---|---|---|")
    for name, a in acc.items():
        s = a.summary()
        print(f"| {name} | {s['n']} | {s['error']:.0f} | {s['acc50']:.0%} | {s['acc100']:.0%} |")
    ms = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731 - median, in ms
    print(f"\nprobe cost: observe {ms(observe_s):.3f} ms a new sequence, one training "
          f"minibatch {ms(train_s):.3f} ms (median of {trains}; torch threads "
          f"{torch.get_num_threads()})")


def _ridge_log_length(rows, start: int) -> dict[str, Accuracy]:
    """The alternative the probe was chosen against: ridge regression of log length on the
    standardized hidden state, refit in closed form on everything before each request
    (cut answers at their cut), at a few penalties."""
    import torch

    from bench.length_prompts import MAX_NEW_TOKENS

    x = torch.tensor([r.hidden for r in rows], dtype=torch.float64)
    y = torch.tensor([r.length for r in rows], dtype=torch.float64).log()
    out = {}
    for alpha in (10.0, 100.0, 1000.0):
        acc = Accuracy()
        for i in range(start, len(rows)):
            mean, std = x[:i].mean(0), x[:i].std(0).clamp_min(1e-3)
            a = (x[:i] - mean) / std
            w = torch.linalg.solve(a.T @ a + alpha * torch.eye(a.shape[1], dtype=a.dtype),
                                   a.T @ (y[:i] - y[:i].mean()))
            pred = float((((x[i] - mean) / std) @ w + y[:i].mean()).exp())
            acc.add(max(1, min(round(pred), MAX_NEW_TOKENS)), rows[i].length)
        out[f"ridge on log length, alpha {alpha:g} (bench only)"] = acc
    return out


def run(args: argparse.Namespace) -> None:
    """`python -m bench length-prediction`."""
    if not args.skip_traces:
        traces_table(args.data, args.lag)
    model = args.model
    if model is None:
        from bench.matrix_models import smollm2_bf16
        model = smollm2_bf16(Path("models"))
    hidden_state_table(model, args.out / "length-prompts.pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--lag", type=int, default=64,
                    help="requests that arrive before one finishes and is learned")
    args = ap.parse_args()
    traces_table(args.data, args.lag)


if __name__ == "__main__":
    main()
