"""Tests for scheduler_service.partition (max-sparsity batch partitioning)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

REPO_ROOT = Path(__file__).resolve().parent.parent
# The editable install may predate this package, so make the checkout
# importable however pytest is launched.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scheduler_service.partition import (  # noqa: E402
    Partition,
    main,
    optimal_partition,
    plan_partition,
)
from seqserve_common.config import ServingConfig  # noqa: E402

SEED = [38, 33, 24, 22]
# (max_sparsity, expected num_splits, expected 1-based partition) for SEED
# with max_splits 4.
SEED_CASES = [
    (0.01, 4, [[1], [2], [3], [4]]),
    (0.025, 3, [[1], [2], [3, 4]]),
    (0.1, 2, [[1, 2], [3, 4]]),
    (0.9, 1, [[1, 2, 3, 4]]),
]

# Brute force enumerates every set partition, so keep inputs small: Bell(9)
# is 21147 partitions.
small_lengths = st.lists(st.integers(min_value=0, max_value=60), max_size=9)
PROPERTY_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------


def _enumerate_partitions(lengths: Sequence[int]) -> tuple[dict[int, int], int]:
    """Least padding per exact number of groups over ALL set partitions.

    Returns ``({groups: padding}, number of partitions visited)``.  Each
    element joins an existing block or opens a new one, which visits every
    set partition exactly once; padding is updated incrementally.
    """
    n = len(lengths)
    best: dict[int, int] = {}
    maxes: list[int] = []
    counts: list[int] = []
    visited = 0

    def place(pos: int, padding: int) -> None:
        nonlocal visited
        if pos == n:
            visited += 1
            groups = len(maxes)
            if padding < best.get(groups, math.inf):
                best[groups] = padding
            return
        x = lengths[pos]
        for b in range(len(maxes)):
            top, count = maxes[b], counts[b]
            if x <= top:
                delta = top - x
            else:
                # Everyone already in the block pads up to the new maximum.
                delta = count * (x - top)
                maxes[b] = x
            counts[b] = count + 1
            place(pos + 1, padding + delta)
            maxes[b], counts[b] = top, count
        maxes.append(x)
        counts.append(1)
        place(pos + 1, padding)
        maxes.pop()
        counts.pop()

    place(0, 0)
    return best, visited


@lru_cache(maxsize=4096)
def brute_best_at_most(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """``result[k]`` = least padding with at most k groups, k in 0..n."""
    best, _ = _enumerate_partitions(lengths)
    n = len(lengths)
    out = [0 if n == 0 else math.inf] * (n + 1)
    for k in range(1, n + 1):
        out[k] = min(out[k - 1], best.get(k, math.inf))
    return tuple(out)  # type: ignore[arg-type]


def reference_dp(lengths: Sequence[int], k_max: int) -> list[int]:
    """Plain O(k n^2) contiguous DP over the descending sort, for k = 1..k_max.

    Used on inputs too large for brute force, to exercise the hull trick.
    """
    values = sorted(lengths, reverse=True)
    n = len(values)
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + v)

    def cost(i: int, j: int) -> int:
        return (j - i) * values[i] - (prefix[j] - prefix[i])

    inf = math.inf
    prev = [0] + [inf] * n  # at most 0 groups
    out = []
    for _ in range(k_max):
        cur = [0] + [inf] * n
        for j in range(1, n + 1):
            cur[j] = min(prev[i] + cost(i, j) for i in range(j))
        out.append(cur[n])
        prev = cur
    return out


def sparsity(padding: int, lengths: Sequence[int]) -> float:
    denominator = padding + sum(lengths)
    return padding / denominator if denominator else 0.0


def padding_of(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Padding of ``groups`` (0-based indices), recomputed from the lengths."""
    padding = 0
    for group in groups:
        members = [lengths[i] for i in group]
        if members:
            padding += len(members) * max(members) - sum(members)
    return padding


def assert_well_formed(lengths: Sequence[int], result: Partition, k: int) -> None:
    n = len(lengths)
    flat = [idx for group in result.groups for idx in group]
    assert sorted(flat) == list(range(n)), "groups must partition range(n)"
    assert all(result.groups), "no empty groups"
    assert result.num_splits == len(result.groups) <= k
    assert padding_of(lengths, result.groups) == result.padding
    assert result.sparsity == pytest.approx(sparsity(result.padding, lengths))
    # Ordering contract: by descending max, inside by (-length, index).
    for group in result.groups:
        assert list(group) == sorted(group, key=lambda i: (-lengths[i], i))
    maxes = [lengths[group[0]] for group in result.groups]
    assert maxes == sorted(maxes, reverse=True)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_service.partition", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --------------------------------------------------------------------------
# Oracle self-checks
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n, bell", [(0, 1), (1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)])
def test_brute_force_visits_every_set_partition(n: int, bell: int) -> None:
    _, visited = _enumerate_partitions(list(range(n)))
    assert visited == bell


def test_padding_oracle() -> None:
    assert padding_of(SEED, [[0], [1], [2, 3]]) == 2
    assert padding_of(SEED, [[0, 1, 2, 3]]) == 35
    assert padding_of(SEED, [[3, 0], [], [2, 1]]) == 16 + 9
    assert sparsity(2, SEED) == pytest.approx(2 / 119)
    assert sparsity(0, [0, 0]) == 0.0


# --------------------------------------------------------------------------
# Seed demonstration
# --------------------------------------------------------------------------


@pytest.mark.parametrize("max_sparsity, splits, expected", SEED_CASES)
def test_seed_demonstration_function(
    max_sparsity: float, splits: int, expected: list[list[int]]
) -> None:
    result = plan_partition(SEED, max_sparsity, 4)
    assert result.num_splits == splits
    assert [[i + 1 for i in group] for group in result.groups] == expected
    assert result.sparsity <= max_sparsity
    assert_well_formed(SEED, result, 4)


@pytest.mark.parametrize("max_sparsity, splits, expected", SEED_CASES)
def test_seed_demonstration_cli_text(
    max_sparsity: float, splits: int, expected: list[list[int]]
) -> None:
    proc = run_cli(
        *map(str, SEED), "--max-sparsity", str(max_sparsity), "--max-splits", "4"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"seq_lengths: {SEED}\n"
        f"max_sparsity: {max_sparsity}\n"
        f"num_splits: {splits}\n"
        f"partition: {expected}\n"
    )


@pytest.mark.parametrize("max_sparsity, splits, expected", SEED_CASES)
def test_seed_demonstration_cli_json(
    max_sparsity: float, splits: int, expected: list[list[int]]
) -> None:
    proc = run_cli(
        *map(str, SEED), "--max-sparsity", str(max_sparsity), "--max-splits", "4", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    assert list(payload) == ["num_splits", "partition", "padding", "sparsity"]
    assert payload["num_splits"] == splits
    assert payload["partition"] == expected
    expected_result = plan_partition(SEED, max_sparsity, 4)
    assert payload["padding"] == expected_result.padding
    assert payload["sparsity"] == pytest.approx(expected_result.sparsity)


def test_cli_exact_text_from_brief() -> None:
    proc = run_cli("38", "33", "24", "22", "--max-sparsity", "0.025", "--max-splits", "4")
    assert proc.returncode == 0
    assert proc.stdout == (
        "seq_lengths: [38, 33, 24, 22]\n"
        "max_sparsity: 0.025\n"
        "num_splits: 3\n"
        "partition: [[1], [2], [3, 4]]\n"
    )
    assert proc.stderr == ""


def test_cli_json_padding_for_brief_example(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["38", "33", "24", "22", "--max-sparsity", "0.025", "--max-splits", "4", "--json"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["num_splits"] == 3
    assert payload["partition"] == [[1], [2], [3, 4]]
    assert payload["padding"] == 2
    assert payload["sparsity"] == pytest.approx(2 / 119)


def test_cli_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    # The configuration's defaults (0.33, 3): one group has 35/152 <= 0.33.
    assert (ServingConfig.max_sparsity, ServingConfig.max_splits) == (0.33, 3)
    assert main(["38", "33", "24", "22"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "max_sparsity: 0.33"
    assert out[2:] == ["num_splits: 1", "partition: [[1, 2, 3, 4]]"]


def test_cli_defaults_come_from_serving_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ServingConfig, "max_sparsity", 0.0)
    monkeypatch.setattr(ServingConfig, "max_splits", 2)
    assert main(["38", "33", "24", "22"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["max_sparsity: 0.0", "num_splits: 2", "partition: [[1, 2], [3, 4]]"]


def test_cli_orders_positions_by_length(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["5", "40", "5", "39", "--max-sparsity", "0", "--max-splits", "2", "--json"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload == {
        "num_splits": 2,
        "partition": [[2, 4], [1, 3]],
        "padding": 1,
        "sparsity": 1 / 90,
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["1", "--max-sparsity", "nan"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-sparsity", "inf"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-sparsity=-inf"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-sparsity", "1.5"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-sparsity", "-0.1"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-sparsity", "x"], "max_sparsity must be a finite number in [0, 1]"),
        (["1", "--max-splits", "0"], "max_splits must be an int >= 1"),
        (["1", "--max-splits", "-3"], "max_splits must be an int >= 1"),
        (["1", "--max-splits", "2.5"], "max_splits must be an int >= 1"),
        (["1", "--max-splits", "x"], "max_splits must be an int >= 1"),
        (["3", "-2"], "lengths[1] must be >= 0"),
    ],
)
def test_cli_rejects_bad_values(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


@pytest.mark.parametrize(
    "argv, splits",
    [
        (["--max-sparsity", "0", "--max-splits", "1"], 1),
        (["--max-sparsity", "1", "--max-splits", "4"], 1),
        (["--max-sparsity", "0.0", "--max-splits", "4"], 4),
    ],
)
def test_cli_accepts_boundary_limits(
    argv: list[str], splits: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*map(str, SEED), *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_splits"] == splits


def test_cli_bad_value_exit_code_in_subprocess() -> None:
    proc = run_cli("1", "2", "--max-sparsity", "nan")
    assert proc.returncode == 2
    assert "max_sparsity must be a finite number in [0, 1]" in proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------
# Known optima and edge cases
# --------------------------------------------------------------------------


@pytest.mark.parametrize("k, padding", [(1, 128), (2, 50), (3, 26), (4, 14)])
def test_known_optimal_padding(k: int, padding: int) -> None:
    lengths = [27, 26, 18, 16, 14, 13, 12, 8, 7, 1]
    result = optimal_partition(lengths, k)
    assert result.padding == padding
    assert result.num_splits == k
    assert_well_formed(lengths, result, k)


def test_empty_input() -> None:
    empty = Partition(groups=(), padding=0, sparsity=0.0)
    assert optimal_partition([], 3) == empty
    assert optimal_partition([], 1) == empty
    assert plan_partition([], 0.1, 4) == empty


def test_all_zero_lengths_have_zero_sparsity() -> None:
    result = plan_partition([0, 0, 0], 0.0, 3)
    assert result == Partition(groups=((0, 1, 2),), padding=0, sparsity=0.0)


def test_more_groups_than_distinct_lengths_never_yields_empty_groups() -> None:
    lengths = [5, 9, 5, 9, 5]
    result = optimal_partition(lengths, 4)
    assert result.groups == ((1, 3), (0, 2, 4))
    assert result.padding == 0
    assert result.sparsity == 0.0
    assert plan_partition(lengths, 0.0, 8).groups == result.groups


def test_ties_ordered_by_ascending_index() -> None:
    result = optimal_partition([7, 3, 7, 3, 7], 1)
    assert result.groups == ((0, 2, 4, 1, 3),)
    assert result.padding == 8


def test_plan_falls_back_to_max_splits_when_threshold_unreachable() -> None:
    lengths = [100, 90, 80, 70, 60, 50]
    result = plan_partition(lengths, 0.0, 3)
    assert result.num_splits == 3
    assert result.padding == optimal_partition(lengths, 3).padding > 0
    assert result.sparsity > 0.0


def test_length_and_k_validation() -> None:
    with pytest.raises(ValueError, match=r"lengths\[1\] must be >= 0"):
        optimal_partition([3, -1], 1)
    for bad_k in (0, -1, 1.0):
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            optimal_partition([3, 1], bad_k)  # type: ignore[arg-type]


def test_plan_validates_lengths() -> None:
    with pytest.raises(ValueError, match=r"lengths\[0\] must be >= 0"):
        plan_partition([-5, 3], 0.5, 2)


# --------------------------------------------------------------------------
# Properties against brute force over all set partitions
# --------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(lengths=small_lengths)
@example(lengths=[60, 0, 59, 1, 30, 30, 17, 44, 2])  # the full 9, with a tie
@example(lengths=[27, 26, 18, 16, 14, 13, 12, 8, 7])
def test_optimal_matches_brute_force(lengths: list[int]) -> None:
    best = brute_best_at_most(tuple(lengths))
    n = len(lengths)
    for k in range(1, n + 2):
        result = optimal_partition(lengths, k)
        expected = best[min(k, n)]
        assert result.padding == expected, (lengths, k)
        assert result.sparsity == pytest.approx(sparsity(expected, lengths))
        assert_well_formed(lengths, result, k)


def check_plan(lengths: list[int], max_sparsity: float, max_splits: int) -> None:
    """plan_partition must pick the smallest k whose brute-force optimum meets
    the threshold, or max_splits (capped by n) when none does."""
    best = brute_best_at_most(tuple(lengths))
    n = len(lengths)
    result = plan_partition(lengths, max_sparsity, max_splits)
    if n == 0:
        assert result == Partition(groups=(), padding=0, sparsity=0.0)
        return
    achievable = [sparsity(best[k], lengths) for k in range(1, n + 1)]
    cap = min(max_splits, n)
    meeting = [k for k in range(1, cap + 1) if achievable[k - 1] <= max_sparsity]
    chosen = meeting[0] if meeting else cap
    assert result.num_splits == chosen, (lengths, max_sparsity, max_splits)
    assert result.padding == best[chosen]
    assert result.sparsity == pytest.approx(achievable[chosen - 1])
    if meeting:
        assert result.sparsity <= max_sparsity
    assert_well_formed(lengths, result, max_splits)


@PROPERTY_SETTINGS
@given(
    lengths=small_lengths,
    max_splits=st.integers(min_value=1, max_value=10),
    data=st.data(),
)
def test_plan_picks_smallest_k_meeting_threshold(
    lengths: list[int], max_splits: int, data: st.DataObject
) -> None:
    best = brute_best_at_most(tuple(lengths))
    achievable = [sparsity(best[k], lengths) for k in range(1, len(lengths) + 1)]
    # Thresholds exactly at an achievable sparsity exercise the "<=" edge.
    max_sparsity = data.draw(
        st.one_of(
            st.floats(min_value=0.0, max_value=1.0),
            st.sampled_from(achievable or [0.0]),
            st.just(0.0),
        ),
        label="max_sparsity",
    )
    check_plan(lengths, max_sparsity, max_splits)


@pytest.mark.parametrize("max_splits", [1, 2, 3, 4, 8, 9, 12])
def test_plan_on_nine_sequences_at_every_achievable_threshold(max_splits: int) -> None:
    lengths = [38, 33, 24, 22, 60, 5, 5, 41, 0]
    best = brute_best_at_most(tuple(lengths))
    thresholds = {sparsity(best[k], lengths) for k in range(1, 10)}
    thresholds |= {0.0, 0.01, 0.05, 0.2, 0.5, 1.0}
    for max_sparsity in sorted(thresholds):
        check_plan(lengths, max_sparsity, max_splits)


# --------------------------------------------------------------------------
# Larger inputs against a plain quadratic DP (exercises the hull trick)
# --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 2048), st.integers(0, 8)), min_size=1, max_size=70
    ),
    k_max=st.integers(min_value=1, max_value=8),
)
def test_matches_quadratic_dp_on_larger_inputs(lengths: list[int], k_max: int) -> None:
    expected = reference_dp(lengths, k_max)
    for k in range(1, k_max + 1):
        result = optimal_partition(lengths, k)
        assert result.padding == expected[k - 1], (lengths, k)
        assert_well_formed(lengths, result, k)


def test_matches_quadratic_dp_on_batch_sized_input() -> None:
    rng = random.Random(20240607)
    lengths = [rng.randint(1, 2048) for _ in range(256)]
    expected = reference_dp(lengths, 8)
    for k in range(1, 9):
        result = optimal_partition(lengths, k)
        assert result.padding == expected[k - 1]
        assert_well_formed(lengths, result, k)
    plan = plan_partition(lengths, 0.0, 8)
    assert plan.num_splits == 8
    assert plan.padding == expected[7]
