"""`python -m bench policies` (issue 19), its pure parts: the command line's checks, the
urgent class, warm-up rows, the knee probes' early stop, the tables' ratio columns, the run's
estimate. No server, no timing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from bench import rate_points
from bench.loadgen import _stream_one
from bench.parser import build_parser
from bench.policy_plan import (DEFAULT_POLICIES, DEFAULT_REQUESTS, Speed, TraceWork, check_args,
                               estimate_seconds, knee_probe_s, num_requests, policy_options,
                               split_rows, urgent_class, urgent_positions, with_priority)
from bench.policy_report import e2e_gain, itl_vs_vllm, ordered, policies_markdown, run_row
from bench.workload import BenchRequest, TraceItem


def parse(*argv: str):
    return build_parser("doc\n\nepilog").parse_args(["policies", *argv])


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def test_defaults_are_the_issues_run():
    args = parse()
    check_args(args)
    assert args.workloads == ["azure-conv", "azure-code", "mooncake"]
    assert args.policies == ["fcfs", "fcfs-unchunked", "priority", "mlfq", "length-aware"]
    assert args.rate_fractions == [0.5, 0.8, 1.0]
    assert args.knee_fractions == [0.5, 0.75, 0.9, 1.1]  # the matrix's
    assert (args.urgent_fraction, args.urgent_priority, args.warmup) == (0.1, -10, 32)
    assert args.peers == [] and args.model is None  # no peer unless asked; SmolLM2
    # A queue can form: every trace sends more requests than the batch has slots.
    assert args.max_rolling_batch_size == 16
    assert [num_requests(args, w) for w in args.workloads] == [64, 64, 32]
    assert num_requests(parse("--num-requests", "20"), "mooncake") == 20
    assert parse("--peers", "vllm").peers == ["vllm"]


def test_the_commands_own_defaults_leave_the_other_commands_alone():
    from bench.commands.common import DEFAULT_MODEL
    from bench.peer_systems import PEERS

    for command in ("matrix", "serve", "peers"):
        args = build_parser("doc\n\nepilog").parse_args([command])
        assert args.peers == list(PEERS), command
        assert (args.model, args.num_requests) == (DEFAULT_MODEL, 64), command
        assert args.max_rolling_batch_size == 64, command


@pytest.mark.parametrize("argv, message", [
    (["--policies", "fcfs,sjf"], "unknown polic"),
    (["--policies", "fcfs,mlfq,mlfq"], "twice"),
    (["--policies", "priority,mlfq"], "must include fcfs"),
    (["--workloads", "azure-conv,sharegpt"], "unknown or no workload"),
    (["--workloads", "mooncake,mooncake"], "twice"),
    (["--rate-fractions", "0.5,0"], "--rate-fractions wants positive"),
    (["--knee-fractions", "-1"], "--knee-fractions wants positive"),
    (["--knee-rate", "0", "--workloads", "azure-conv"], "--knee-rate wants a positive"),
    (["--knee-rate", "2.9"], "--knee-rate is one trace's knee: give one --workloads"),
    (["--urgent-fraction", "1"], "--urgent-fraction must be in"),
    (["--urgent-priority", "0"], "--urgent-priority must be in"),
    (["--urgent-priority", "-101"], "--urgent-priority must be in"),
    (["--warmup", "-1"], "--warmup must be"),
    (["--num-requests", "1"], "--num-requests must be"),
    (["--num-requests", "16"], r"<= --max-rolling-batch-size 16: .*no queue forms"),
    (["--max-rolling-batch-size", "40"], r"\['mooncake'\]: --num-requests \[32\] <= "),
    (["--max-rolling-batch-size", "0"], "--max-rolling-batch-size must be >= 1"),
    (["--peers", "hf,vllm"], "only the vllm peer"),
    (["--server-option", "scheduling-policy=mlfq"], "each policy sets its own"),
])
def test_bad_command_lines_say_what_is_wrong(argv, message):
    with pytest.raises(SystemExit, match=message):
        check_args(parse(*argv))


def test_each_policy_is_a_server_option_that_wins_over_the_given_ones():
    given = {"enable_chunked_prefill": "true", "max_num_batched_tokens": "512"}
    assert policy_options("fcfs-unchunked", given) == {
        "enable_chunked_prefill": "false", "max_num_batched_tokens": "512",
        "scheduling_policy": "fcfs"}
    assert policy_options("length-aware", {})["scheduling_policy"] == "length-aware"
    assert policy_options("fcfs", given)["enable_chunked_prefill"] == "true"
    assert policy_options("priority-unshielded", given)["priority_background_chunk_tokens"] == "0"


def test_shield_caps_are_priority_servers_asked_for_by_name_only():
    for cap in (32, 64, 256):
        assert policy_options(f"priority-shield{cap}", {"priority_background_chunk_tokens": "1"}) \
            == {"scheduling_policy": "priority", "priority_background_chunk_tokens": str(cap)}
    assert not [p for p in DEFAULT_POLICIES if p.startswith("priority-")]
    assert "priority" in DEFAULT_POLICIES


# --------------------------------------------------------------------------------------------
# Requests: urgent class, warm-up rows, priority on the wire
# --------------------------------------------------------------------------------------------


def test_urgent_positions_are_seeded_and_sized():
    a = urgent_positions(32, 0.1, seed=0)
    assert a == urgent_positions(32, 0.1, seed=0) and len(a) == 3
    assert a == sorted(set(a)) and all(0 <= i < 32 for i in a)
    assert urgent_positions(32, 0.1, seed=1) != a
    assert len(urgent_positions(4, 0.1, seed=0)) == 1  # at least one when asked for
    assert urgent_positions(32, 0.0, seed=0) == []
    assert len(urgent_positions(16, 0.5, seed=3)) == 8
    with pytest.raises(ValueError, match="urgent fraction"):
        urgent_positions(8, 1.0, seed=0)


def _req(i: int, prompt_len: int = 4) -> BenchRequest:
    return BenchRequest(i, "x" * prompt_len, list(range(prompt_len)), 3)


def test_with_priority_marks_only_the_urgent_positions():
    reqs = [_req(10 + i) for i in range(5)]
    got = with_priority(reqs, [1, 3], -10)
    assert [r.priority for r in got] == [0, -10, 0, -10, 0]
    assert [r.index for r in got] == [10, 11, 12, 13, 14]
    assert all(r.priority == 0 for r in reqs)  # copies: the originals stay as they were


def test_warm_up_rows_come_before_the_measured_ones():
    items = [TraceItem(i, 10, 10, 5, 5) for i in range(10)]
    warm, measured = split_rows(items, 4)
    assert [it.index for it in warm] == [0, 1, 2, 3]
    assert [it.index for it in measured] == [4, 5, 6, 7, 8, 9]
    assert split_rows(items, 0) == ([], items)
    with pytest.raises(ValueError, match="none to measure"):
        split_rows(items, 10)


def test_the_load_generator_sends_the_requests_priority():
    @dataclass
    class Chunk:
        token_id: int | None = 7
        finish_reason: str | None = None
        generated_tokens: int = 1
        prompt_tokens: int = 4
        cached_tokens: int = 0

    class Client:
        def __init__(self):
            self.params = []

        async def stream(self, prompt, **params):
            self.params.append(params)
            yield Chunk(finish_reason="length")

    client = Client()
    asyncio.run(_stream_one(client, BenchRequest(0, "a b", [1, 2], 1, priority=-10)))
    asyncio.run(_stream_one(client, BenchRequest(1, "a b", [1, 2], 1)))
    assert client.params[0]["priority"] == -10
    assert "priority" not in client.params[1]  # 0: the server's default, not sent


def test_urgent_class_against_idle_ttft():
    per = [{"ttft_s": t} for t in (0.5, 0.2, 0.9, 0.3, 0.4)]
    u = urgent_class({"per_request": per}, [1, 3], [0.1, 0.2])
    assert u["count"] == 2
    assert u["ttft"]["p99_ms"] == pytest.approx(200 + 0.99 * 100)  # of 0.2 s and 0.3 s
    assert u["idle_ttft_median_ms"] == pytest.approx(150)
    assert u["p99_over_idle"] == pytest.approx(299 / 150)
    assert u["p99_over_idle_p99"] == pytest.approx(299 / 199)
    assert u["slowdown_p99"] == pytest.approx(2 - 0.01 * 0.5)  # slowdowns 2.0 and 1.5
    assert urgent_class({"per_request": per}, [], []) is None


# --------------------------------------------------------------------------------------------
# The knee probes: the matrix's, stopping after the first past the knee
# --------------------------------------------------------------------------------------------


class FakeTarget:
    """Keeps up at rates up to `limit` requests/s; p99 E2E 1 s while it does."""

    def __init__(self, offline_rate: float, limit: float):
        self.offline_rate, self.limit, self.rates = offline_rate, limit, []

    def run(self, requests, offsets=None, max_concurrency=None, slo=None):
        n = len(requests)
        if offsets is None:
            return {"request_throughput": self.offline_rate, "completed": n}
        rate = (n - 1) / max(offsets)
        self.rates.append(rate)
        ok = rate <= self.limit + 1e-6
        return {"completed": n, "request_throughput": rate if ok else self.limit / 2,
                "e2e": {"mean_ms": 500.0, "p99_ms": 1000.0 if ok else 9000.0}}


@pytest.fixture
def probes(monkeypatch):
    monkeypatch.setattr(rate_points, "build_workload_requests",
                        lambda tok, name, items, seed, block: [_req(i) for i in range(len(items))])
    # Evenly spaced arrivals: each point carries exactly its rate.
    monkeypatch.setattr(rate_points, "arrivals",
                        lambda kind, items, rate, seed: [i / rate for i in range(len(items))])
    items = [TraceItem(i, 10, 10, 5, 5) for i in range(200)]
    reqs = [_req(i) for i in range(200)]

    def run(target, stop):
        return rate_points.run_rate_points(target, None, "azure-conv", items, reqs,
                                           [0.5, 0.75, 0.9, 1.1], seed=0, block_tokens=32,
                                           slo=None, stop_past_knee=stop)
    return run


def test_knee_probes_stop_after_the_first_past_the_knee(probes):
    target = FakeTarget(offline_rate=10.0, limit=7.5)
    base, points = probes(target, True)
    assert base == 10.0
    assert [p["rate"] for p in points] == [None, 5.0, 7.5, 9.0]  # 11/s is not run
    assert rate_points.knee(rate_points.curve(points)) == 7.5
    full = probes(FakeTarget(offline_rate=10.0, limit=7.5), False)[1]  # the matrix's way
    assert [p["rate"] for p in full] == [None, 5.0, 7.5, 9.0, 11.0]
    assert rate_points.knee(rate_points.curve(full)) == 7.5  # the same knee
    assert not rate_points.past_knee(points[:3]) and rate_points.past_knee(points)


# --------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------


def _run(policy: str, fraction: float, e2e_mean: float, itl_p99: float = 100.0,
         urgent_p99: float | None = None) -> dict:
    lat = {"mean_ms": e2e_mean, "median_ms": e2e_mean, "p99_ms": 2 * e2e_mean}
    summary = {"ttft": lat, "tpot": lat, "e2e": lat, "request_throughput": 1.0,
               "output_throughput": 10.0,
               "itl": {"mean_ms": 1.0, "median_ms": 1.0, "p99_ms": itl_p99},
               "goodput": {"request_goodput": 0.5}}
    urgent = None if urgent_p99 is None else {
        "ttft": {"p99_ms": urgent_p99}, "idle_ttft_median_ms": 50.0,
        "p99_over_idle": urgent_p99 / 50.0, "p99_over_idle_p99": urgent_p99 / 100.0,
        "slowdown_p99": 3.0}
    return {"policy": policy, "fraction": fraction, "rate": 2.0, "summary": summary,
            "urgent": urgent}


def test_ratio_columns_take_fcfs_and_vllm_at_the_same_fraction():
    runs = [_run("fcfs", 0.8, 3000.0, itl_p99=300.0), _run("fcfs", 0.5, 1000.0),
            _run("length-aware", 0.8, 1500.0, itl_p99=150.0), _run("vllm", 0.8, 2000.0, 200.0),
            _run("priority", 0.5, 500.0, urgent_p99=80.0)]
    la = runs[2]
    assert e2e_gain(la, runs[0]) == pytest.approx(2.0)  # FCFS 3000 ms / 1500 ms
    assert itl_vs_vllm(la, runs[3]) == pytest.approx(0.75)
    row = run_row(la, runs)
    assert row[:2] == ["length-aware", "0.8"] and row[-2:] == ["2.00", "0.75"]
    row = run_row(runs[4], runs)  # at 0.5: FCFS's 1000 ms, no vLLM run there
    assert row[-2:] == ["2.00", "n/a"]
    # urgent p99, idle median, the ratios to the idle median and p99, slowdown
    assert row[9:14] == ["80", "50", "1.60", "0.80", "3.00"]
    assert run_row(runs[0], runs)[-2:] == ["1.00", "1.50"]  # 300 / 200 ms
    assert run_row(runs[3], runs)[-1] == "n/a"  # vLLM against itself
    assert [(r["policy"], r["fraction"]) for r in ordered(runs, ["fcfs", "priority",
                                                                 "length-aware"])] == [
        ("fcfs", 0.5), ("priority", 0.5), ("fcfs", 0.8), ("length-aware", 0.8), ("vllm", 0.8)]


def test_markdown_has_a_table_per_trace_with_commit_load_and_knee():
    def trace(name, found):
        return {"name": name, "num_requests": 4, "first_row": 64, "scale_text": "scaled",
                "warmup": 64, "urgent_positions": [1], "urgent_priority": -10,
                "knee": {"rate": 2.5, "found": found, "offline_rate": 5.0,
                         "points": [{"rate": None}, {"rate": 2.5}, {"rate": 3.75}]},
                "uptime_start": "load average: 0.10", "uptime_end": "load average: 1.90",
                "runs": [_run("fcfs", 0.5, 100.0), _run("mlfq", 0.5, 50.0)]}
    result = {"model": "models/smollm2", "dtype": "bfloat16", "commit": "abc1234",
              "uptime_start": "load average: 0.05", "uptime_end": "load average: 2.00",
              "estimate_s": 2100.0, "wall_s": 1980.0, "policies": ["fcfs", "mlfq"],
              "slo": "TTFT <= 2000 ms", "vllm_skipped": None,
              "traces": [trace("azure-conv", True), trace("mooncake", False)]}
    md = policies_markdown(result)
    assert md.count("| policy | x knee |") == 2
    assert "### azure-conv" in md and "### mooncake" in md
    assert "abc1234" in md and "load average: 0.05" in md and "load average: 1.90" in md
    assert "Estimated 35 min, took 33 min" in md
    assert "trace rows 64-67" in md and "probes 2.5/s, 3.75/s" in md
    assert md.count("no knee") == 1
    assert "| mlfq | 0.5 |" in md
    given = trace("azure-code", True)
    given["knee"]["given"] = True
    assert "as given (--knee-rate), not probed" in policies_markdown({**result,
                                                                      "traces": [given]})
    assert "not probed" not in md


# --------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------


def test_estimate_counts_every_server_run_and_vllm():
    speed = Speed(prefill_tps=100.0, decode_tps=10.0, server_start_s=20.0,
                  knee_fraction=0.75, tail_s=2.0, vllm_load_s=150.0)
    w = TraceWork(prompt_tokens=1000, output_tokens=100, requests=20,
                  warmup_prompt_tokens=500, warmup_output_tokens=50, urgent_prompt_tokens=200)
    # all at once: 10 + 10 = 20 s; probes at 0.5, 0.75, 0.9 (the first past 0.75), not 1.1
    assert knee_probe_s(w, [1.1, 0.5, 0.75, 0.9], speed) == pytest.approx(
        20 + (40 + 2) + (20 / 0.75 + 2) + (20 / 0.9 + 2))
    one = estimate_seconds([w], policies=1, fractions=[1.0], knee_fractions=[0.5], vllm=False,
                           speed=speed)
    knee_rate = 0.75 * 20 / 20
    expected = (20 + (200 / 100 + 0.1) + (20 + 40 + 2)
                + (20 + 10 + 20 / knee_rate + 2))
    assert one == pytest.approx(expected)
    two = estimate_seconds([w], policies=2, fractions=[1.0], knee_fractions=[0.5],
                           vllm=False, speed=speed)
    assert two - one == pytest.approx(20 + 10 + 20 / knee_rate + 2)  # one more server
    with_vllm = estimate_seconds([w], policies=1, fractions=[1.0], knee_fractions=[0.5],
                                 vllm=True, speed=speed)
    assert with_vllm - one == pytest.approx(150 + 20 / knee_rate + 2)


def test_a_queue_may_form_when_requests_outnumber_the_slots():
    check_args(parse("--num-requests", "17"))
    check_args(parse("--num-requests", "6", "--max-rolling-batch-size", "4"))  # the smoke
    check_args(parse("--max-rolling-batch-size", "31"))
    check_args(parse("--knee-rate", "2.9", "--workloads", "azure-conv"))


def test_default_run_is_estimated_near_45_minutes():
    # The default counts were chosen for it: the traces' real token counts at the matrix's
    # scale, every default policy and fraction, no vLLM.
    from bench.policy_plan import DEFAULT_WARMUP
    from bench.workload import Scale, load_workload, mooncake_scale

    works = []
    for name, n in DEFAULT_REQUESTS.items():
        scale = mooncake_scale(32, 8192, 32) if name == "mooncake" else Scale()
        warm, measured = split_rows(load_workload(name, DEFAULT_WARMUP + n, scale),
                                    DEFAULT_WARMUP)
        works.append(TraceWork(sum(i.prompt_len for i in measured),
                               sum(i.output_len for i in measured), n,
                               sum(i.prompt_len for i in warm), sum(i.output_len for i in warm)))
    minutes = estimate_seconds(works, policies=5, fractions=[0.5, 0.8, 1.0],
                               knee_fractions=[0.5, 0.75, 0.9, 1.1], vllm=False) / 60
    assert 38 <= minutes <= 50
