"""When to send a pipelined Step: shortly before the worker should finish the ones it has.

With `steps_in_flight` >= 2 the loop plans Step N+1 while the worker runs Step N, so the
worker finds its next Step waiting instead of idling for an answer's round trip. Planned
the moment N is sent, N+1 misses every request that arrives while N runs, and each of
them pays a whole extra Step before its prefill starts. Planned a little before N's
expected end, N+1 still reaches the worker before it needs it and takes those requests
in. If the worker answers first (the estimate was long), the loop plans at once and sends
the Step before it hands out that answer's tokens, as without pacing, so a long estimate
costs the worker the planning's time and no more.

The expected time of a Step is a least-squares fit of the worker's own time
(`worker_seconds` of its answers) for the last `window` Steps on their rows and prompt
tokens: on a steady batch it tracks a decoding Step within a few percent; a prompt
chunk's cost is the slope on its tokens. Pure: the loop gives it plans, times and clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_service.batch_plan import StepPlan

# Answered Steps the fit needs before it paces; until then each Step goes at once.
MIN_SAMPLES = 8
# Ridge term of the fit, so a term the window never varied (no prompt tokens yet) gets a
# slope near 0 instead of a singular system.
RIDGE = 1e-6


def step_size(plan) -> tuple[int, int]:
    """(rows, prompt tokens) of a StepPlan: the sequences its groups run and the prompt
    tokens it prefills (whole prompts when unchunked)."""
    rows = sum(len(g) for g in plan.groups)
    tokens = plan.prefill_tokens if plan.chunks else sum(len(s.prompt_ids) for s in plan.prefill)
    return rows, tokens


@dataclass
class SentStep:
    """A Step sent to the worker and not yet answered."""

    plan: StepPlan
    step_id: int
    sent: float  # perf_counter when it was handed to the stream
    plan_seconds: float
    background: bool = False  # it pays chunks the policy capped (AdmissionPolicy.chunk_limit)

    @cached_property
    def size(self) -> tuple[int, int]:  # (rows, prompt tokens): what the pacer prices
        return step_size(self.plan)


@dataclass
class StepPacer:
    """`lead_s` + `lead_fraction` of the expected time is how early the next Step goes, to
    cover its planning, its trip to the worker and the estimate's error; a negative
    `lead_s` turns pacing off (each Step goes as soon as the previous one is sent)."""

    lead_s: float
    lead_fraction: float = 0.1
    window: int = 64
    _samples: deque = field(default_factory=deque, init=False, repr=False)
    # The window's sums of x x^T and x y, x = (1, rows, tokens), y in nanoseconds: kept
    # as Steps come and go, so each answer costs the loop a 3x3 solve, not a pass over
    # the window. Integers, so taking a Step out leaves no rounding behind.
    _sums: list = field(default_factory=lambda: [[0] * 4 for _ in range(3)], init=False,
                        repr=False)
    _coef: tuple[float, float, float] | None = field(default=None, init=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.lead_s >= 0

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """An answered Step's size and the worker's time for it."""
        if not self.enabled or seconds <= 0:
            return
        sample = (int(rows), int(tokens), round(seconds * 1e9))
        self._samples.append(sample)
        _add(self._sums, sample, 1)
        if len(self._samples) > self.window:
            _add(self._sums, self._samples.popleft(), -1)
        self._coef = _fit(self._sums) if len(self._samples) >= MIN_SAMPLES else None

    def expected(self, rows: int, tokens: int) -> float | None:
        """The worker's expected seconds for a Step of this size; None before the fit."""
        if self._coef is None:
            return None
        a, b, c = self._coef
        return max(a + b * rows + c * tokens, 0.0)

    def delay(self, started: float, sizes: list[tuple[int, int]], now: float) -> float:
        """Seconds to hold the next Step: the worker began the first of the Steps in
        flight (`sizes`, oldest first) at `started` and runs the rest after it."""
        if not self.enabled or not sizes:
            return 0.0
        total = 0.0
        for rows, tokens in sizes:
            e = self.expected(rows, tokens)
            if e is None:
                return 0.0
            total += e
        return max(started + total * (1 - self.lead_fraction) - self.lead_s - now, 0.0)


def _add(sums: list, sample: tuple[int, int, int], sign: int) -> None:
    """Add (sign 1) or take out (sign -1) one sample's terms of the normal equations."""
    rows, tokens, y = sample
    x = (1, rows, tokens)
    for i in range(3):
        for j in range(3):
            sums[i][j] += sign * x[i] * x[j]
        sums[i][3] += sign * x[i] * y


def _fit(sums: list) -> tuple[float, float, float]:
    """Least squares of seconds on (1, rows, tokens): the 3x3 normal equations from the
    window's sums, solved by Gaussian elimination."""
    m = [[float(v) for v in row[:3]] + [row[3] / 1e9] for row in sums]
    for i in range(3):
        m[i][i] += RIDGE * max(m[i][i], 1.0)
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col and m[col][col]:
                f = m[r][col] / m[col][col]
                for k in range(col, 4):
                    m[r][k] -= f * m[col][k]
    return tuple(m[i][3] / m[i][i] if m[i][i] else 0.0 for i in range(3))
