"""The benchmark harness (bench/): workloads, arrivals, statistics, tiny end-to-end runs."""

from __future__ import annotations

import json
import random

import pytest

import bench
from bench.loadgen import check_results
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
    short.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n")
    with pytest.raises(ValueError, match="1 rows"):
        bench.load_trace(short, 2, bench.Scale())


def test_azure_traces_load_with_arrival_times():
    conv = bench.load_trace(bench.TRACE, 3, bench.Scale())
    # 18:15:46.6805900 and 18:15:50.9951690 in the trace.
    assert conv[0].arrival_s == 0.0
    assert conv[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    code = bench.load_workload("azure-code", 4, bench.Scale())
    assert [(i.trace_prompt, i.trace_output) for i in code] == [
        (4808, 10), (3180, 8), (110, 27), (7433, 14)]
    assert [(i.prompt_len, i.output_len) for i in code] == [(512, 5), (512, 4), (28, 14), (512, 7)]
    assert code[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(code, code[1:]))


def test_mooncake_trace_loads_and_scales_like_its_blocks():
    scale = bench.mooncake_scale(32, context=2048, max_output=32)
    assert scale == bench.Scale(1 / 16, 2016, 1 / 16, 32)
    items = bench.load_workload("mooncake", 12, scale)
    first = items[0]
    assert (first.trace_prompt, first.trace_output) == (6758, 500)
    assert first.prompt_len == 422 and first.output_len == 31  # 6758/16 = 422.4, 500/16 = 31.25
    assert first.hash_ids == tuple(range(14))
    assert items[10].arrival_s == 3.0  # timestamps are in ms
    assert items[11].prompt_len == 2016  # 87169 tokens, capped at the context minus the output
    for it in items:
        # Every scaled prompt is covered by the trace's own blocks (no invented block ids).
        assert len(bench.mooncake_blocks(it, 32)) <= len(it.hash_ids)


def test_mooncake_prompts_share_a_prefix_exactly_where_hash_ids_do(tokenizer):
    safe = bench.round_trip_tokens(tokenizer)
    mk = lambda i, n, hs: bench.TraceItem(i, 0, 0, n, 4, 0.0, tuple(hs))  # noqa: E731
    a, b, c = mk(0, 100, [7, 8, 9, 10]), mk(1, 70, [7, 8, 11]), mk(2, 40, [5, 8])
    ids = [bench.mooncake_prompt_ids(it, 32, safe, seed=1) for it in (a, b, c)]
    assert [len(x) for x in ids] == [100, 70, 40]

    def common(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    assert common(ids[0], ids[1]) == 64  # blocks 7 and 8 shared, block 9 vs 11 differ
    assert common(ids[0], ids[2]) == 0  # different first block
    # A partial last block is a prefix of that block's tokens; blocks are seed-determined.
    assert ids[0][96:] == bench.block_tokens_for(10, 32, safe, 1)[:4]
    assert bench.mooncake_prompt_ids(a, 32, safe, seed=1) == ids[0]
    assert bench.mooncake_prompt_ids(a, 32, safe, seed=2) != ids[0]
    reqs = bench.build_mooncake_requests(tokenizer, [a, b, c], 32, seed=1)
    for r, want in zip(reqs, ids):
        assert r.prompt_ids == want and tokenizer(r.prompt).input_ids == want
    # The ideal hit rate counts whole leading blocks already seen: b reuses 64 of 70 tokens.
    assert bench.ideal_prefix_hit_rate([a, b, c], 32) == pytest.approx(64 / 210)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = bench.poisson_arrivals(2000, rate=4.0, seed=3)
    assert a == bench.poisson_arrivals(2000, rate=4.0, seed=3)
    assert a != bench.poisson_arrivals(2000, rate=4.0, seed=4)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    assert 1999 / a[-1] == pytest.approx(4.0, rel=0.1)
    assert bench.poisson_arrivals(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]
    items = [bench.TraceItem(i, 1, 1, 1, 1, t) for i, t in enumerate([10.0, 11.0, 14.0])]
    assert bench.arrivals("all", items) == [0.0, 0.0, 0.0]
    assert bench.arrivals("trace", items, speedup=2.0) == [0.0, 0.5, 2.0]
    assert bench.arrivals("poisson", items, rate=4.0, seed=3) == a[:3]
    with pytest.raises(ValueError, match="rate"):
        bench.arrivals("poisson", items)


def test_goodput_counts_requests_meeting_every_limit():
    rows = [{"ttft_s": 0.1, "tpot_s": 0.02, "e2e_s": 1.0},
            {"ttft_s": 0.3, "tpot_s": 0.02, "e2e_s": 1.0},  # TTFT too slow
            {"ttft_s": 0.1, "tpot_s": 0.06, "e2e_s": 1.0},  # TPOT too slow
            {"ttft_s": 0.2, "tpot_s": None, "e2e_s": 0.2}]  # one token: TPOT counts as 0
    g = bench.goodput(rows, duration_s=2.0, slo=bench.Slo(ttft_ms=200, tpot_ms=50))
    assert g["good_requests"] == 2 and g["request_goodput"] == 1.0 and g["good_fraction"] == 0.5
    assert bench.goodput(rows, 2.0, bench.Slo(e2e_ms=500))["good_requests"] == 1
    assert bench.goodput(rows, 4.0, bench.Slo())["request_goodput"] == 1.0  # no limits
    assert not bench.Slo() and bench.Slo(tpot_ms=1)


def test_summary_uses_vllm_definitions():
    r = bench.RequestResult(0, 10, 3, send=1.0, token_times=[1.5, 1.7, 2.0], end=2.0)
    s = bench.summarize([r, bench.RequestResult(1, 5, 1, 1.0, [1.2], 1.2)],
                        slo=bench.Slo(ttft_ms=300))
    assert s["ttft"]["mean_ms"] == pytest.approx(350)
    assert s["tpot"]["mean_ms"] == pytest.approx(250)  # (1.0 - 0.5) / 2, one-token excluded
    assert s["itl"]["mean_ms"] == pytest.approx(250)  # gaps 0.2 and 0.3
    assert s["duration_s"] == 1.0 and s["output_throughput"] == 4.0
    assert s["goodput"]["good_requests"] == 1
    assert set(s["e2e"]) == {"mean_ms", "median_ms", "p90_ms", "p99_ms"}


def test_a_run_of_unary_calls_counts_returned_tokens_and_has_no_token_latencies():
    unary = [bench.RequestResult(0, 10, 3, 1.0, end=2.0, generated=3, prompt_tokens=10,
                                 streamed=False),
             bench.RequestResult(1, 5, 1, 1.0, end=1.5, generated=1, prompt_tokens=5,
                                 streamed=False)]
    s = bench.summarize(unary)
    assert s["output_tokens"] == 4 and s["output_throughput"] == 4.0
    assert not {"ttft", "tpot", "itl"} & set(s) and s["e2e"]["mean_ms"] == pytest.approx(750)
    assert s["per_request"][0]["ttft_s"] is None
    check_results(unary)
    unary[0].generated = 2  # a reply one token short
    with pytest.raises(RuntimeError, match="asked for 3 tokens after 10, got 2 returned"):
        check_results(unary)


def test_knee_is_the_last_rate_that_keeps_up():
    def pt(rate, achieved, p99):
        # 64 requests arriving over 64/rate s, mean e2e 0.5 s.
        return {"rate": rate, "arrival_span_s": 64 / rate,
                "summary": {"completed": 64, "request_throughput": achieved,
                            "e2e": {"p99_ms": p99, "mean_ms": 500.0}}}
    pts = [pt(1, 0.97, 1000), pt(2, 1.9, 1200), pt(4, 3.5, 1900), pt(8, 4.0, 9000)]
    assert bench.knee(pts) == 4  # at 8/s: 4.0 achieved < 0.9 x 64 / 8.5 s, p99 9x
    assert bench.knee([pt(1, 0.5, 1000)]) is None  # not even the lowest rate keeps up
    assert bench.knee(pts[:3] + [pt(8, 7.2, 2500)]) == 4  # keeps up, but p99 > 2x


def test_cached_prompt_requests_share_the_cached_tokens(tokenizer):
    reqs = bench.cached_prompt_requests(tokenizer, 64, 16, 4, output_len=3, seed=0)
    assert len(reqs) == 5 and len({r.cached_prompt for r in reqs}) == 1
    assert len({r.prompt for r in reqs}) == 5
    for r in reqs:
        assert r.prompt_len == 80
        assert tokenizer(r.cached_prompt + r.prompt).input_ids == r.prompt_ids
        assert r.prompt_ids[:64] == reqs[0].prompt_ids[:64]


def test_decode_shape_weights_context_by_tokens():
    reqs = [bench.BenchRequest(0, "", [1] * 10, 3), bench.BenchRequest(1, "", [1] * 4, 1)]
    assert bench.decode_shape(reqs) == (2, 11.5)  # contexts 11 and 12; a 1-token request has none


def test_conversation_selection_keeps_multi_turn_requests():
    scale = bench.mooncake_scale(32, context=2048, max_output=32)
    chosen = bench.select_conversations(bench.WORKLOADS["mooncake"].path, 64, scale)
    assert len(chosen) == 64 and [it.index for it in chosen] == list(range(64))
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(chosen, chosen[1:]))
    firsts = [it.hash_ids[1] for it in chosen]
    assert sum(firsts.count(h) > 1 for h in set(firsts)) >= len(set(firsts)) - 1
    first_rows = bench.load_mooncake(bench.WORKLOADS["mooncake"].path, 64, scale)
    assert bench.ideal_prefix_hit_rate(chosen, 32) > 2 * bench.ideal_prefix_hit_rate(
        first_rows, 32)


def test_py_spy_stacks_are_summarized_by_frame():
    text = ("main (a.py:1);step (worker_service/engine.py:10);forward (torch/linear.py:5) 30\n"
            "main (a.py:1);step (worker_service/engine.py:10) 10\n"
            "main (a.py:1);poll (selectors.py:3) 60\n")
    s = bench.summarize_collapsed(text)
    assert s["samples"] == 100
    assert s["self"][0] == ["poll (selectors.py)", 0.6]
    assert dict(s["self"])["forward (linear.py)"] == 0.3
    assert s["inclusive"] == [["step (engine.py)", 0.4]]  # seqserve frames only


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


@pytest.mark.slow
def test_serve_prefix_and_peers_end_to_end(tmp_path):
    model = str(tiny_model("llama"))
    out = tmp_path / "results"
    assert bench.main(["serve", "--model", model, "--num-requests", "6", "--arrival", "poisson",
                       "--rates", "20,40", "--peers", "none", "--goodput-ttft-ms", "5000",
                       "--out", str(out), "--plot-dir", str(tmp_path / "plots")]) == 0
    result = json.loads((out / "serve-azure-conv.json").read_text())
    assert [p["rate"] for p in result["seqserve"]] == [20.0, 40.0]
    assert all(p["summary"]["completed"] == 6 for p in result["seqserve"])
    assert (tmp_path / "plots" / "serve-azure-conv-sweep.png").stat().st_size > 0
    assert bench.main(["prefix", "--model", model, "--cached-tokens", "64", "--prefix-requests",
                       "3", "--mooncake-requests", "6", "--mooncake-arrival", "all",
                       "--mooncake-max-concurrency", "1",
                       "--out", str(out)]) == 0
    prefix = json.loads((out / "prefix.json").read_text())
    warm = prefix["cached_prompt"]["runs"]["cache_warm"]
    assert min(warm["cached_tokens"]) >= 48  # whole 16-token blocks of the 64-token prompt
    assert set(prefix["cached_prompt"]["runs"]["cache_off"]["cached_tokens"]) == {0}
    moon = prefix["mooncake"]["runs"]
    assert moon["cache_off"]["prefix_hit_rate_worker"] == 0
    assert moon["cache_on"]["prefix_hit_rate_worker"] > 0  # block 0 is shared by every row
    assert bench.main(["peers", "--model", model, "--num-requests", "4", "--peers", "hf,hf-cb",
                       "--out", str(out), "--plot-dir", ""]) == 0
    peers = json.loads((out / "peers.json").read_text())
    want = peers["seqserve"]["output_tokens"]
    assert peers["peers"]["hf"]["output_tokens"] == peers["peers"]["hf-cb"]["output_tokens"] == want
    assert 0 < peers["ceiling"]["fraction_of_ceiling"]
    assert peers["floor"]["output_tokens"] == want
    # the same requests as unary calls, each reply whole
    unary = peers["seqserve_not_streamed"]
    assert unary["output_tokens"] == want and "ttft" not in unary
    assert peers["ratios_not_streamed"]["hf"] == pytest.approx(
        unary["output_throughput"] / peers["peers"]["hf"]["output_throughput"])
    runs = {"seqserve", "seqserve_not_streamed", "hf", "hf-cb"}
    assert set(peers["floor"]["fraction"]) == runs
    # each run's own floor, at the bandwidth probed around it
    own = peers["floor"]["by_system"]
    assert set(own) == set(peers["floor"]["fraction_end_probe"]) == runs
    assert peers["seqserve"]["bandwidth_probes"] == own["seqserve"]["probes"]
    for name, floor in own.items():
        assert len(floor["probes"]) == 2 and min(floor["probes"]) > 0
        assert floor["bandwidth"] == pytest.approx(sum(floor["probes"]) / 2)
        measured = (peers[name] if name.startswith("seqserve") else peers["peers"][name]
                    )["duration_s"]
        assert peers["floor"]["fraction"][name] == pytest.approx(floor["duration_s"] / measured)


def test_vllm_peer_runs_float32_where_the_cpu_has_no_native_half_precision(tmp_path,
                                                                          monkeypatch):
    """vLLM runs at the dtype its user would pick: the model's, or float32 where oneDNN has
    no path for the model's half precision (there vLLM's bfloat16 ran 4-5x slower);
    --vllm-dtype wins."""
    import torch

    from bench.peer_systems import vllm_dtype
    from worker_service.kernels import linear_prepack

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setattr(linear_prepack, "runs", lambda dtype: True)
    assert vllm_dtype(tmp_path) == "bfloat16"
    monkeypatch.setattr(linear_prepack, "runs", lambda dtype: dtype == torch.float32)
    assert vllm_dtype(tmp_path) == "float32"
    assert vllm_dtype(tmp_path, "bfloat16") == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert vllm_dtype(tmp_path) == "float32"
