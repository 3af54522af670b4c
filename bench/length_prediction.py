"""Accuracy of the length-aware policy's response-length predictor on the real traces, as
the Response Length Perception paper reports it: mean absolute error (tokens), Acc-50 and
Acc-100 (share of predictions within 50 / 100 tokens of the real length).

Replayed online in arrival order, as the scheduler meets the requests: each request is
predicted from what finished before it, then learned from. The traces hold lengths only,
no text, so the Azure traces give the predictor only the prompt length; Mooncake's
hash_ids (512-token prefix blocks) stand in for the prompt's prefix keys.

    python -m bench.length_prediction [--data /work/shared/data] [--lag 64]
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import deque
from pathlib import Path

from scheduler_service.policies.length_predictor import Accuracy, LengthPredictor

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--lag", type=int, default=64,
                    help="requests that arrive before one finishes and is learned")
    args = ap.parse_args()
    traces = {"Azure conv": azure(args.data / "AzureLLMInferenceTrace_conv.csv"),
              "Azure code": azure(args.data / "AzureLLMInferenceTrace_code.csv"),
              "Mooncake conv": mooncake(args.data / "mooncake_conversation_trace.jsonl")}
    print("| trace | requests | error (tokens) | Acc-50 | Acc-100 |")
    print("|---|---|---|---|---|")
    for name, rows in traces.items():
        s = replay(rows, args.lag)
        print(f"| {name} | {s['n']} | {s['error']:.0f} | {s['acc50']:.0%} | {s['acc100']:.0%} |")


if __name__ == "__main__":
    main()
