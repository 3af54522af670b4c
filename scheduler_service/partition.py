"""Max-sparsity batch partitioning.

A batch of sequences is split into groups that are each padded to their
longest member.  For a group count ``k`` the optimal partition is the one with
the least padding; :func:`plan_partition` picks the smallest ``k`` whose
optimal partition keeps the padding fraction ("sparsity") under a threshold.

Algorithm
---------
Some optimal partition is contiguous in length-sorted (descending) order, and
some optimal partition never splits a run of equal lengths (moving equal
lengths into one group never adds padding).  So the sequences are sorted,
collapsed into ``m`` runs of distinct lengths, and a layered DP runs over the
runs::

    f_k(j) = min_{i<j} f_{k-1}(i) + (C[j] - C[i]) * L[i] - (S[j] - S[i])

with ``L`` the run lengths (descending), ``C`` prefix counts and ``S`` prefix
sums.  For fixed ``i`` the bracket is a line in ``x = C[j]`` with slope
``L[i]``; slopes decrease as ``i`` grows and queries ``C[j]`` increase, so a
monotone convex-hull trick gives each layer in O(m).  Total cost is
O(n log n + k * m), with exact integer arithmetic throughout.

Limits are not checked here: the configuration loader checks them at start-up
and the CLI checks its flags.
"""

from __future__ import annotations

import argparse
import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import ne, neg

from seqserve_common.config import ServingConfig


@dataclass(frozen=True)
class Partition:
    """A split of a batch into padded groups.

    Attributes:
        groups: 0-based indices into the input lengths.  Groups are ordered by
            descending maximum length; within a group, indices are ordered by
            descending length, ties by ascending index.  No group is empty.
        padding: Total padding, ``sum(len(g) * max(g) - sum(g))``.
        sparsity: ``padding / (padding + sum(lengths))``, 0.0 when both are 0.
    """

    groups: tuple[tuple[int, ...], ...]
    padding: int
    sparsity: float

    @property
    def num_splits(self) -> int:
        """Number of (non-empty) groups."""
        return len(self.groups)


_EMPTY = Partition(groups=(), padding=0, sparsity=0.0)


def _check_lengths(lengths: Iterable[int]) -> list[int]:
    values = list(lengths)
    # A negative length would make the padding meaningless rather than fail.
    if values and min(values) < 0:
        pos = next(p for p, v in enumerate(values) if v < 0)
        raise ValueError(f"lengths[{pos}] must be >= 0, got {values[pos]}")
    return values


def _sparsity(padding: int, total: int) -> float:
    denominator = padding + total
    return padding / denominator if denominator else 0.0


@dataclass(frozen=True)
class _Runs:
    """Sorted input collapsed into runs of equal length."""

    order: list[int]  # input indices sorted by (-length, index)
    L: list[int]  # run lengths, strictly descending
    C: list[int]  # C[r] = number of sequences in runs [0, r)
    S: list[int]  # S[r] = total length of runs [0, r)

    @property
    def m(self) -> int:
        return len(self.L)


def _make_runs(values: list[int]) -> _Runs:
    n = len(values)
    # sorted(reverse=True) keeps stability, so equal lengths stay in ascending
    # index order, which is exactly the within-group order we promise.
    order = sorted(range(n), key=values.__getitem__, reverse=True)
    ordered = list(map(values.__getitem__, order))
    # map/compress/accumulate keep the per-element work out of the bytecode
    # loop; this runs on every scheduling decision.
    starts = [0, *compress(range(1, n), map(ne, ordered, ordered[1:]))] if n else []
    counts = [*starts, n] if n else [0]
    run_lengths = list(map(ordered.__getitem__, starts))
    prefix = [0, *accumulate(ordered)]
    sums = list(map(prefix.__getitem__, counts))
    return _Runs(order, run_lengths, counts, sums)


# A layer is the DP for an exact group count k.  It is carried between steps
# as the intercepts of the lines that the next layer minimises over,
#     g_k(i) = f_k(i) - C[i] * L[i] + S[i]    for i in [k, m),
# so that f_{k+1}(j) + S[j] = min_i g_k(i) + L[i] * C[j].  Passing g rather
# than f saves a full pass per layer.

_Hull = list[tuple[int, int, int]]  # (slope, intercept, first integer x where optimal)


def _first_layer(runs: _Runs) -> tuple[list[int], int]:
    """``(g_1, f_1(m))``; g_1 is indexed from i = 1."""
    L, C = runs.L, runs.C
    top = L[0]
    m = runs.m
    g = [c * (top - a) for c, a in zip(C[1:m], L[1:m])]
    return g, C[m] * top - runs.S[m]


def _next_layer(runs: _Runs, g_prev: list[int], k: int) -> tuple[list[int], int, _Hull]:
    """Layer ``k`` from layer ``k-1`` with the monotone convex-hull trick.

    ``g_prev`` holds g_{k-1}(i) for i in [k-1, m).  Returns ``(g_k, f_k(m),
    hull)``; ``g_k`` is indexed from i = k, and ``hull`` is the lower envelope
    used, from which :func:`_parent` recovers split points.

    All lines i in [k-1, m) go into one envelope even though line i is only
    valid for queries j > i: for i >= j the line's value is >= f_{k-1}(i) >=
    f_{k-1}(j) > f_k(j), so an invalid line never attains the minimum.
    """
    L, C = runs.L, runs.C
    m = runs.m
    x_lo = C[k]
    x_hi = C[m]
    slopes = L[k - 1 : m]
    # Slopes strictly decrease; queries C[j] strictly increase.  The top entry
    # lives in locals because nearly every new line pops it.
    ta = slopes[0]
    tb = g_prev[0]
    ts = x_lo
    hull: _Hull = []
    push = hull.append
    pop = hull.pop
    for a, b in zip(slopes[1:], g_prev[1:]):
        # The new line (smaller slope) is <= the top for integer x >= s.
        s = -((tb - b) // (ta - a))
        if s > ts:
            if s <= x_hi:  # otherwise it never wins inside the query range
                push((ta, tb, ts))
                ta, tb, ts = a, b, s
            continue
        while hull:
            ta, tb, ts = pop()
            s = -((tb - b) // (ta - a))
            if s > ts:
                push((ta, tb, ts))
                break
        else:
            s = x_lo
        ta, tb, ts = a, b, s
    push((ta, tb, ts))

    # Expand the envelope to the winning line of every query j in [k, m]; list
    # repetition is far cheaper than a per-query Python loop.
    win_a: list[int] = []
    win_b: list[int] = []
    lo = k
    for t in range(1, len(hull)):
        a, b, _ = hull[t - 1]
        hi = bisect_left(C, hull[t][2], lo)
        win_a += [a] * (hi - lo)
        win_b += [b] * (hi - lo)
        lo = hi
    a, b, _ = hull[-1]
    win_a += [a] * (m + 1 - lo)
    win_b += [b] * (m + 1 - lo)
    # f_k(j) = b + a*C[j] - S[j], hence g_k(j) = b + (a - L[j]) * C[j].
    g = [b + (a - length) * c for a, b, length, c in zip(win_a, win_b, L[k:m], C[k:m])]
    f_m = win_b[-1] + win_a[-1] * x_hi - runs.S[m]
    return g, f_m, hull


def _parent(runs: _Runs, hull: _Hull, j: int) -> int:
    """First run of the last group in the optimal layer solution for ``j``."""
    starts = [s for _, _, s in hull]
    slope = hull[bisect_right(starts, runs.C[j]) - 1][0]
    # Run lengths are distinct, so the slope identifies the run; L descends,
    # hence the negated key.
    return bisect_left(runs.L, -slope, key=neg)


def _last_layer(runs: _Runs, g_prev: list[int], k: int) -> tuple[int, int]:
    """``(f_k(m), split)`` only: a plain scan beats building a hull here."""
    m = runs.m
    x = runs.C[m]
    values = [b + a * x for a, b in zip(runs.L[k - 1 : m], g_prev)]
    best = min(values)
    return best - runs.S[m], values.index(best) + k - 1


class _Solver:
    """Incremental layered DP that can reconstruct the current layer.

    Incremental so that :func:`plan_partition` stops at the first k that
    meets the threshold instead of paying for all ``max_splits`` layers.
    """

    def __init__(self, runs: _Runs, k_max: int) -> None:
        self.runs = runs
        # More groups than distinct lengths cannot lower padding below 0.
        self.k_max = min(k_max, runs.m)
        self.k = 0
        self._g: list[int] = []
        self._hulls: list[_Hull] = []  # hull of layer k at index k - 2
        self._last_split: int | None = None

    def step(self) -> int:
        """Advance to the next k and return its optimal padding f_k(m)."""
        runs = self.runs
        k = self.k + 1
        self.k = k
        if k == 1:
            self._g, value = _first_layer(runs)
        elif k == self.k_max:
            # The final layer is never extended, so only f_k(m) is needed.
            value, self._last_split = _last_layer(runs, self._g, k)
        else:
            self._g, value, hull = _next_layer(runs, self._g, k)
            self._hulls.append(hull)
        return value

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups of the optimal partition for the current k."""
        runs = self.runs
        bounds = [runs.m]
        j = runs.m
        layer = self.k
        if self._last_split is not None:
            j = self._last_split
            bounds.append(j)
            layer -= 1
        while layer >= 2:
            j = _parent(runs, self._hulls[layer - 2], j)
            bounds.append(j)
            layer -= 1
        bounds.append(0)  # layer 1 always starts at the first run
        bounds.reverse()
        order, C = runs.order, runs.C
        return tuple(tuple(order[C[lo] : C[hi]]) for lo, hi in zip(bounds, bounds[1:]))


def _run_groups(runs: _Runs) -> tuple[tuple[int, ...], ...]:
    order, C = runs.order, runs.C
    return tuple(tuple(order[C[r] : C[r + 1]]) for r in range(runs.m))


def _solve(values: list[int], k: int) -> Partition:
    runs = _make_runs(values)
    if runs.m == 0:
        return _EMPTY
    total = runs.S[runs.m]
    if k >= runs.m:
        # One group per distinct length already gives zero padding.
        return Partition(_run_groups(runs), 0, 0.0)
    solver = _Solver(runs, k)
    padding = 0
    while solver.k < k:
        padding = solver.step()
    return Partition(solver.groups(), padding, _sparsity(padding, total))


def optimal_partition(lengths: Sequence[int], k: int) -> Partition:
    """An optimal (least-padding) partition into at most ``k`` groups.

    Fewer than ``k`` groups are returned only when the input has fewer than
    ``k`` distinct lengths, in which case the padding is 0.

    Raises:
        ValueError: if ``k`` is not an int >= 1 or a length is negative.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return _solve(_check_lengths(lengths), k)


def plan_partition(lengths: Sequence[int], max_sparsity: float, max_splits: int) -> Partition:
    """Partition with the smallest k <= ``max_splits`` meeting ``max_sparsity``.

    If no k meets the threshold the optimal partition for ``max_splits`` is
    returned (it then has exactly ``max_splits`` groups, since any input with
    at most ``max_splits`` distinct lengths reaches zero sparsity).  The limits
    must be valid (``0 <= max_sparsity <= 1``, ``max_splits >= 1``).

    Raises:
        ValueError: if a length is negative.
    """
    runs = _make_runs(_check_lengths(lengths))
    if runs.m == 0:
        return _EMPTY
    total = runs.S[runs.m]
    solver = _Solver(runs, max_splits)
    while True:
        padding = solver.step()
        sparsity = _sparsity(padding, total)
        if sparsity <= max_sparsity or solver.k == solver.k_max:
            break
    return Partition(solver.groups(), padding, sparsity)


def _max_sparsity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # also false for nan
        msg = f"max_sparsity must be a finite number in [0, 1], got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _max_splits(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"max_splits must be an int >= 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; groups are printed with 1-based positions."""
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_service.partition",
        description="Split a batch of sequence lengths into padded groups, using the "
        "fewest groups whose padding fraction stays within --max-sparsity.",
    )
    parser.add_argument("lengths", nargs="+", type=int, metavar="LENGTH",
                        help="sequence lengths (>= 0)")
    parser.add_argument("--max-sparsity", type=_max_sparsity, default=ServingConfig.max_sparsity,
                        help="largest allowed padding fraction in [0, 1] (default %(default)s)")
    parser.add_argument("--max-splits", type=_max_splits, default=ServingConfig.max_splits,
                        help="largest number of groups, >= 1 (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        result = plan_partition(args.lengths, args.max_sparsity, args.max_splits)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    positions = [[idx + 1 for idx in group] for group in result.groups]
    if args.json:
        print(json.dumps({"num_splits": result.num_splits, "partition": positions,
                          "padding": result.padding, "sparsity": result.sparsity}))
    else:
        print(f"seq_lengths: {list(args.lengths)}")
        print(f"max_sparsity: {args.max_sparsity}")
        print(f"num_splits: {result.num_splits}")
        print(f"partition: {positions}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
