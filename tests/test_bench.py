"""The benchmark harness (client/bench.py): workload construction, and a tiny end-to-end run."""

from __future__ import annotations

import json
import random

import pytest

from client import bench
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def test_round_trip_tokens_encode_to_themselves(tokenizer):
    safe = bench.round_trip_tokens(tokenizer)
    assert len(safe) > 20
    assert not set(safe) & set(tokenizer.all_special_ids)
    for tid in safe:
        text = tokenizer.decode([tid])
        assert text.startswith(" ") and text[1:].isascii() and text[1:].isalpha()
        assert tokenizer(text).input_ids == [tid]


@pytest.mark.parametrize("n", [1, 2, 7, 64, 333, 512])
def test_prompts_have_exact_token_length(tokenizer, n):
    safe = bench.round_trip_tokens(tokenizer)
    text, ids = bench.make_prompt(tokenizer, n, random.Random(n), safe)
    assert len(tokenizer(text).input_ids) == n
    assert tokenizer(text).input_ids == ids


def test_prompts_are_seeded(tokenizer):
    items = [bench.TraceItem(i, 0, 0, p, 3) for i, p in enumerate([5, 40, 17])]
    a = bench.build_requests(tokenizer, items, seed=3)
    b = bench.build_requests(tokenizer, items, seed=3)
    c = bench.build_requests(tokenizer, items, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
    assert [r.prompt_len for r in a] == [5, 40, 17]
    assert [r.output_len for r in a] == [3, 3, 3]


def test_scale_length_rounds_and_clips():
    assert bench.scale_length(374, 0.25, 512) == 94  # 93.5 rounds half up
    assert bench.scale_length(4000, 0.25, 512) == 512
    assert bench.scale_length(1, 0.25, 512) == 1  # 0.25 rounds to 0, clipped to 1
    assert bench.scale_length(0, 0.5, 128) == 1


def test_load_trace_takes_first_rows_scaled(tmp_path):
    items = bench.load_trace(bench.TRACE, 8, bench.Scale())
    assert len(items) == 8
    # The first rows of the Azure conversation trace.
    assert [(i.trace_prompt, i.trace_output) for i in items[:4]] == [
        (374, 44), (396, 109), (879, 55), (91, 16)]
    assert [(i.prompt_len, i.output_len) for i in items[:4]] == [
        (94, 22), (99, 55), (220, 28), (23, 8)]
    for it in bench.load_trace(bench.TRACE, 64, bench.Scale()):
        assert 1 <= it.prompt_len <= 512 and 1 <= it.output_len <= 128
    small = bench.load_trace(bench.TRACE, 3, bench.Scale(0.1, 30, 0.05, 4))
    assert [(i.prompt_len, i.output_len) for i in small] == [(30, 2), (30, 4), (30, 3)]
    short = tmp_path / "short.csv"
    short.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nx,10,5\n")
    with pytest.raises(ValueError, match="1 rows"):
        bench.load_trace(short, 2, bench.Scale())


def test_percentile_matches_linear_interpolation():
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench.percentile([5], 99) == 5
    assert bench.percentile([1, 2, 3, 4, 5], 100) == 5


@pytest.mark.slow
def test_throughput_end_to_end(tmp_path, capsys):
    model = tiny_model("llama")
    out = tmp_path / "results"
    assert bench.main(["throughput", "--model", str(model), "--num-requests", "4",
                       "--out", str(out)]) == 0
    result = json.loads((out / "throughput.json").read_text())
    seq, hf = result["seqserve"], result["hf"]
    want = sum(bench.load_trace(bench.TRACE, 4, bench.Scale())[i].output_len for i in range(4))
    assert seq["completed"] == hf["completed"] == 4
    assert seq["output_tokens"] == hf["output_tokens"] == want
    assert seq["server"]["generation_tokens"] == want
    assert result["ratio_seqserve_over_hf"] == pytest.approx(
        seq["output_throughput"] / hf["output_throughput"])
    assert seq["config"] == {"max_sparsity": 0.33, "max_splits": 3,
                             "max_rolling_batch_size": 64}
    assert "x0.25" in result["workload"]["scale_text"]
    printed = capsys.readouterr().out
    assert "seqserve / HF output tokens/s" in printed and "x0.25" in printed
    assert (out / "throughput.md").read_text().strip() == printed.strip()
