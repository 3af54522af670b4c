"""The benchmark matrix's pure parts: the floor's arithmetic and ideal engine, the ideal
prefix cache, GEMM rate interpolation, and the ratio table. No timing is asserted."""

from __future__ import annotations

import math

import pytest

from bench.commands import matrix
from bench.floor import (FloorRequest, MachineRates, ModelShape, fraction_of_floor,
                         ideal_cached_tokens, run_floor, simulate, step_floor)
from bench.matrix_report import (aim_point, aim_table, floor_fraction, knee_table,
                                 matrix_markdown, median_markdown, ratio_row)
from bench.parser import build_parser

# A Llama-style config with grouped heads and a head size that is not hidden / heads.
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "intermediate_size": 96, "vocab_size": 500, "dtype": "bfloat16",
          "tie_word_embeddings": True}


def shape() -> ModelShape:
    return ModelShape.from_config(CONFIG)


def flat_rates(flops: float = 1e9, bandwidth: float = 1e9) -> MachineRates:
    return MachineRates({g.key: [(1, flops), (4096, flops)] for g in shape().gemms()},
                        bandwidth)


def test_shape_fuses_products_and_counts_them_per_layer():
    s = shape()
    got = {g.name: (g.k, g.n, g.count) for g in s.gemms()}
    # q: 4 x 32 = 128 columns, k and v: 2 x 32 = 64 each.
    assert got == {"qkv": (64, 256, 3), "o": (128, 64, 3), "gate_up": (64, 192, 3),
                   "down": (96, 64, 3), "lm_head": (64, 500, 1)}
    per_layer = 64 * 256 + 128 * 64 + 64 * 192 + 96 * 64
    assert s.weight_bytes() == 2 * (3 * per_layer + 64 * 500)
    assert s.kv_bytes_per_token() == 2 * 3 * 2 * 32 * 2  # K and V, layers, kv heads, dim, bf16
    # Five rows, two of them yielding a token: the last layer's o, gate/up and down and the
    # LM head for those two only.
    rest = 128 * 64 + 64 * 192 + 96 * 64
    assert s.linear_flops(5, 2) == (5 * 2 * (3 * per_layer - rest) + 2 * 2 * rest
                                    + 2 * 2 * 64 * 500)
    assert s.linear_flops(5, 5) == 5 * 2 * (3 * per_layer + 64 * 500)


def test_shape_defaults_kv_heads_and_head_dim_and_rejects_other_layouts():
    cfg = {k: v for k, v in CONFIG.items() if k not in ("num_key_value_heads", "head_dim")}
    s = ModelShape.from_config(cfg)
    assert (s.kv_heads, s.head_dim) == (4, 16)
    with pytest.raises(ValueError, match="n_embd|hidden_size"):
        ModelShape.from_config({"model_type": "gpt2", "n_embd": 64})


def test_gemm_rate_interpolates_in_log_m_and_clamps_outside():
    g = shape().gemms()[0]
    rates = MachineRates({g.key: [(64, 300.0), (1, 100.0), (16, 200.0)]}, 1.0)
    assert rates.gemm_rate(g, 1) == 100.0
    assert rates.gemm_rate(g, 4) == pytest.approx(150.0)  # halfway from 1 to 16 in log2
    assert rates.gemm_rate(g, 32) == pytest.approx(250.0)
    assert rates.gemm_rate(g, 10_000) == 300.0
    assert rates.gemm_seconds(g, 0) == 0.0
    assert rates.gemm_seconds(g, 2) == pytest.approx(3 * 2 * 2 * g.k * g.n / rates.gemm_rate(g, 2))
    with pytest.raises(KeyError, match="measure"):
        rates.gemm_rate(shape().lm_head(), 1)


def test_step_floor_adds_compute_and_memory():
    s = shape()
    step = step_floor(s, flat_rates(1e9, 1e9), rows=10, logit_rows=4, kv_tokens=100)
    assert step.compute_s == pytest.approx(s.linear_flops(10, 4) / 1e9)
    assert step.memory_s == pytest.approx((s.weight_bytes() + 100 * s.kv_bytes_per_token()) / 1e9)
    assert step.seconds == pytest.approx(step.compute_s + step.memory_s)


def test_all_at_once_takes_one_prefill_step_then_one_step_per_token():
    s, rates = shape(), flat_rates()
    reqs = [FloorRequest(0.0, 10, 4), FloorRequest(0.0, 6, 2)]
    run = simulate(s, rates, reqs, max_batch=8)
    assert run.steps == 4 and run.prefill_steps == 1
    assert run.prompt_rows == 16 and run.decode_rows == 3 + 1
    assert run.output_tokens == 6
    # Step 1 reads both prompts' KV, step 2 both contexts, steps 3-4 the longer request only.
    kv = (10 + 6) + (10 + 1 + 6 + 1) + (10 + 2) + (10 + 3)
    assert run.bytes_read == pytest.approx(4 * s.weight_bytes() + kv * s.kv_bytes_per_token())
    want = sum(step_floor(s, rates, r, lr, k).seconds
               for r, lr, k in ((16, 2, 16), (2, 2, 18), (1, 1, 12), (1, 1, 13)))
    assert run.duration_s == pytest.approx(want)
    assert run.overlap_s <= run.duration_s


def test_the_batch_limit_queues_requests():
    run = simulate(shape(), flat_rates(), [FloorRequest(0.0, 4, 3)] * 3, max_batch=2)
    # Two run three steps; the third joins in step 4 and needs two more.
    assert (run.steps, run.prefill_steps, run.output_tokens) == (6, 2, 9)


def test_the_engine_idles_until_a_late_arrival():
    s, rates = shape(), flat_rates()
    alone = simulate(s, rates, [FloorRequest(0.0, 4, 2)], max_batch=4)
    late = simulate(s, rates, [FloorRequest(100.0, 4, 2)], max_batch=4)
    assert late.duration_s == pytest.approx(100.0 + alone.duration_s)
    assert late.steps == alone.steps  # no empty steps while it waits
    with pytest.raises(ValueError, match="max_batch"):
        simulate(s, rates, [], max_batch=0)


def test_ideal_prefix_cache_counts_whole_shared_blocks_of_earlier_prompts():
    a = list(range(40))
    b = list(range(35)) + [99] * 10  # shares 35 tokens: two whole blocks of 16
    c = [7] * 40
    d = list(range(16)) + [5] * 32  # the first block shared, the next two not
    assert ideal_cached_tokens([a, b, c, d], [0.0, 1.0, 2.0, 3.0]) == [0, 32, 0, 16]
    # Arrival order decides which prompt is first.
    assert ideal_cached_tokens([a, b], [5.0, 1.0]) == [32, 0]
    # A fully cached prompt still computes its last token in the floor.
    run = run_floor(shape(), flat_rates(), [a, a], [1, 1], None, 4)
    assert run.prompt_rows == 40 + (40 - 32)
    whole = a[:32]
    run = run_floor(shape(), flat_rates(), [whole, whole], [1, 1], None, 4)
    assert run.prompt_rows == 32 + 1


def test_fraction_of_floor():
    assert fraction_of_floor(2.0, 8.0) == 0.25
    assert math.isnan(fraction_of_floor(2.0, 0.0))
    assert math.isnan(fraction_of_floor(2.0, None))


def _summary(tput: float, duration: float, ttft: float, itl: float) -> dict:
    return {"output_throughput": tput, "duration_s": duration,
            "ttft": {"median_ms": ttft, "p99_ms": 2 * ttft},
            "itl": {"median_ms": itl, "p99_ms": 3 * itl}}


def _cell() -> dict:
    floor = {"duration_s": 1.0, "output_throughput": 1000.0}
    return {"model": "mid", "trace": "azure-conv", "offline_request_rate": 4.0,
            "knee": {"seqserve": 3.6, "vllm": None, "vllm_ran": True},
            "points": [{"label": "all at once", "floor": floor,
                        "seqserve": _summary(500.0, 2.0, 100, 20),
                        "vllm": _summary(250.0, 4.0, 300, 10),
                        "hf": {"output_throughput": 100.0},
                        "hf-cb": {"skipped": "failed"}},
                       {"label": "Poisson 2/s (0.5x)", "floor": floor,
                        "seqserve": _summary(400.0, 2.5, 50, 20),
                        "vllm": {"skipped": "no venv"}}]}


def test_ratio_rows_set_seqserve_against_each_system_and_the_floor():
    cell = _cell()
    row = dict(zip(["model", "trace", "arrivals", "seq", "vllm", "ratio", "ttft50", "ttft99",
                    "itl50", "itl99", "floor", "pct", "hf", "hfcb"],
                   ratio_row(cell, cell["points"][0])))
    assert row["ratio"] == "2.00"
    assert (row["ttft50"], row["ttft99"]) == ("100 / 300", "200 / 600")
    assert (row["itl50"], row["itl99"]) == ("20 / 10", "60 / 30")
    assert row["floor"] == "1000.0"
    assert row["pct"] == "50% / 25%"
    assert (row["hf"], row["hfcb"]) == ("5.00", "n/a")
    assert floor_fraction(cell["points"][0], "vllm") == 0.25
    # A point vLLM skipped: no ratio, no vLLM latencies, seqserve's own figures stay.
    row2 = ratio_row(cell, cell["points"][1])
    assert row2[4:7] == ["n/a", "n/a", "50 / n/a"]
    assert row2[11] == "40% / n/a"
    # a system whose run was probed is set against its own floor; the others the point's
    point = {**cell["points"][0], "floor": {
        "duration_s": 1.0, "output_throughput": 1000.0,
        "by_system": {"seqserve": {"duration_s": 1.5, "probes": [4e10, 6e10],
                                   "bandwidth": 5e10}}}}
    assert floor_fraction(point, "seqserve") == 0.75
    assert floor_fraction(point, "vllm") == 0.25
    assert ratio_row(cell, point)[11] == "75% / 25%"


def test_knee_table_and_markdown_carry_commit_load_and_skips():
    cell = _cell()
    assert "| mid | azure-conv | 4.00 | 3.6 | not reached |" in knee_table([cell])
    result = {"commit": "abc1234", "cores": 2, "uptime_start": "load average: 0.50",
              "uptime_end": "load average: 1.50", "num_requests": 64,
              "scales": {"azure-conv": "x0.25"}, "rate_fractions": [0.5, 1.1],
              "cells": [cell], "vllm_skipped": {"vLLM on tiny": "head_dim=16"},
              "machine": {"gemm": {"64x256": [(1, 2e9), (8, 16e9)]},
                          "names": {"64x256": "qkv"}, "bandwidth": 2e10, "threads": 2,
                          "memory": {"copy_bytes_per_s": 1.5e10, "read_bytes_per_s": 2e10}}}
    md = matrix_markdown(result)
    for text in ("abc1234", "load average: 0.50", "load average: 1.50", "head_dim=16",
                 "hf-cb on mid / azure-conv: failed", "| qkv 64x256 | 2 | 16 |",
                 "20.0 GB/s"):
        assert text in md, text


def test_the_latency_aim_is_read_at_the_point_nearest_80_percent_of_vllms_knee():
    cell = _cell()
    assert aim_point(cell) is None and aim_table([cell]) is None  # vLLM's knee unknown
    cell["knee"]["vllm"] = 5.0
    cell["points"] = [cell["points"][0]] + [
        {"label": f"Poisson {r}/s", "rate": r, "seqserve": _summary(100.0, 1.0, ttft, 20),
         "vllm": _summary(100.0, 1.0, 150, itl)}
        for r, ttft, itl in ((2.5, 100, 5), (3.75, 200, 10), (4.5, 50, 10), (5.2, 1, 99))]
    # 0.8 x 5 = 4: 3.75 is nearer than 4.5; 5.2 is past the knee; all at once has no rate.
    assert aim_point(cell)["rate"] == 3.75
    table = aim_table([cell])
    assert "| mid | azure-conv | 5 | 4 | 3.75 | 400 / 300 | 60 / 30 | no (TTFT, ITL) |" in table
    cell["points"][2]["seqserve"] = _summary(100.0, 1.0, 150, 10)  # level is no worse
    assert "| 300 / 300 | 30 / 30 | yes |" in aim_table([cell])
    assert aim_point(cell, fraction=0.5)["rate"] == 2.5
    # A point past the knee is never read, however near: 5.2 is nearer 4 than 2.5 is.
    del cell["points"][2:4]
    assert aim_point(cell)["rate"] == 2.5


def test_median_of_runs_lists_each_runs_ratio_and_takes_medians():
    runs = []
    for i, (seq, vllm) in enumerate(((500.0, 250.0), (300.0, 300.0), (450.0, 300.0))):
        cell = _cell()
        cell["points"][0]["seqserve"] = _summary(seq, 1000 / seq, 100 + i, 20)
        cell["points"][0]["vllm"] = _summary(vllm, 1000 / vllm, 300, 10 * (i + 1))
        cell["points"][1]["fraction"] = 0.5
        runs.append({"commit": f"c{i}", "uptime_start": f"start {i}", "uptime_end": f"end {i}",
                     "cells": [cell]})
    md = median_markdown(runs)
    assert "median of 3 runs" in md and "start 2" in md and "end 0" in md
    rows = [line for line in md.splitlines() if line.startswith("| mid")]
    # ratios 2.00, 1.00, 1.50 -> 1.50; tok/s medians 450 / 300; p99 TTFT 2 x 101 / 2 x 300;
    # p99 ITL 3 x 20 / 3 x 20; floor 1 s against 2.22 s (450 tok/s) and 3.33 s
    assert rows[0] == ("| mid | azure-conv | all at once | 1.50 (2.00, 1.00, 1.50) | 450.0 | 300.0 "
                       "| 202 / 600 | 60 / 60 | 45% / 30% |")
    # vLLM skipped the Poisson point in every run: no ratio, seqserve's own figures stay
    assert rows[1].startswith("| mid | azure-conv | Poisson 0.5x | n/a (n/a, n/a, n/a) | 400.0 | n/a |")


def test_peers_report_sets_each_system_against_the_floor():
    from bench.report import peers_markdown

    meta = {"trace_name": "Azure conv", "num_requests": 4, "arrival": "all at once",
            "scale_text": "x0.25", "prompt": {"sum": 40, "mean": 10, "max": 12},
            "output": {"sum": 8, "mean": 2, "max": 3}, "model": "m", "dtype": "bfloat16",
            "env": {"cores": 2, "load_average": [0.1]}, "seed": 0}
    seq = {**_summary(500.0, 2.0, 100, 20), "output_tokens": 1000,
           "tpot": {"mean_ms": 1, "median_ms": 1, "p99_ms": 1},
           "e2e": {"mean_ms": 1, "median_ms": 1, "p99_ms": 1}}
    for k in ("ttft", "itl"):
        seq[k]["mean_ms"] = 1
    result = {"workload": meta, "seqserve": seq, "ratios": {"vllm": 2.0},
              "peers": {"vllm": {"duration_s": 4.0, "output_tokens": 1000,
                                 "output_throughput": 250.0}},
              "floor": {"duration_s": 1.0, "output_throughput": 1000.0, "steps": 3,
                        "bandwidth": 2e10, "fraction": {"seqserve": 0.5, "vllm": 0.25}}}
    md = peers_markdown(result)
    assert "Fraction of the floor: seqserve 50%, vLLM CPU 25%" in md
    assert "20.0 GB/s" in md
    # each run's own floor, at the bandwidth probed around it
    result["floor"].update(
        by_system={"seqserve": {"probes": [5e10, 7e10], "bandwidth": 6e10, "duration_s": 0.9},
                   "vllm": {"probes": [2e10, 2e10], "bandwidth": 2e10, "duration_s": 1.0}},
        fraction={"seqserve": 0.45, "vllm": 0.25},
        fraction_end_probe={"seqserve": 0.5, "vllm": 0.25})
    md = peers_markdown(result)
    assert ("Fraction of the floor, each run at the bandwidth probed around it: seqserve 45%, "
            "vLLM CPU 25%") in md
    assert "| seqserve | 50.0 / 70.0 | 0.90 | 45% | 50% |" in md
    assert "| vLLM CPU | 20.0 / 20.0 | 1.00 | 25% | 25% |" in md


def test_peers_report_has_the_not_streamed_run_against_each_system():
    from bench.report import peers_markdown

    meta = {"trace_name": "Azure conv", "num_requests": 4, "arrival": "all at once",
            "scale_text": "x0.25", "prompt": {"sum": 40, "mean": 10, "max": 12},
            "output": {"sum": 8, "mean": 2, "max": 3}, "model": "m", "dtype": "bfloat16",
            "env": {"cores": 2, "load_average": [0.1]}, "seed": 0}
    seq = {"duration_s": 2.0, "output_tokens": 1000, "output_throughput": 500.0}
    unary = {"duration_s": 1.6, "output_tokens": 1000, "output_throughput": 625.0}
    result = {"workload": meta, "seqserve": seq, "seqserve_not_streamed": unary,
              "ratios": {"vllm": 2.0}, "ratios_not_streamed": {"vllm": 2.5},
              "peers": {"vllm": {"duration_s": 4.0, "output_tokens": 1000,
                                 "output_throughput": 250.0}},
              "floor": {"duration_s": 1.0, "output_throughput": 1000.0, "steps": 3,
                        "bandwidth": 2e10, "fraction": {"seqserve": 0.5,
                                                        "seqserve_not_streamed": 0.625,
                                                        "vllm": 0.25}}}
    md = peers_markdown(result)
    assert "| seqserve | 2.00 | 1000 | 500.0 | 1.00 | 1.25 |" in md
    assert "| seqserve, not streamed | 1.60 | 1000 | 625.0 | 0.80 | 1.00 |" in md
    assert "| vLLM CPU | 4.00 | 1000 | 250.0 | 2.00 | 2.50 |" in md
    assert "seqserve 50%, seqserve, not streamed 62%, vLLM CPU 25%" in md


def test_the_bandwidth_probe_reads_both_ways_and_leaves_torch_threads_as_they_were():
    import torch

    from bench.bandwidth_probe import probe

    before = torch.get_num_threads()
    got = probe(size_mib=8, repeats=2, threads=1)
    assert torch.get_num_threads() == before
    assert got["copy_bytes_per_s"] > 0 and got["read_bytes_per_s"] > 0
    assert got["bandwidth"] == max(got["copy_bytes_per_s"], got["read_bytes_per_s"])


@pytest.mark.parametrize("fractions", ["0", "0.5,-1", "nan"])
def test_rate_fractions_that_give_no_arrivals_stop_before_any_server_starts(fractions):
    args = build_parser("doc\n\nepilog").parse_args(
        ["matrix", "--rate-fractions", fractions, "--no-floor", "--peers", "none"])
    with pytest.raises(SystemExit, match="--rate-fractions wants positive fractions"):
        matrix.run(args)


def test_each_probed_run_gets_a_floor_at_the_mean_of_its_probes():
    from bench.bandwidth_probe import probed
    from bench.floor import FloorRun, floors_by_system

    calls = iter([4e10, 6e10])
    run = probed(lambda: {"duration_s": 2.0}, lambda: next(calls))
    assert run["bandwidth_probes"] == [4e10, 6e10]
    assert "bandwidth_probes" not in probed(lambda: {"skipped": "no venv"}, lambda: 1.0)
    assert probed(lambda: {"duration_s": 1.0}, None) == {"duration_s": 1.0}
    own = floors_by_system({"seqserve": run, "vllm": {"duration_s": 3.0}, "hf": None},
                           lambda bandwidth: FloorRun(duration_s=1e10 / bandwidth))
    assert set(own) == {"seqserve"}
    assert own["seqserve"] == {"bandwidth": 5e10, "probes": [4e10, 6e10], "duration_s": 0.2}
