"""The vectorized greedy pick (kernels/greedy.c) against torch's argmax: first index of the
maximum, NaN as the largest, -inf rows, widths with and without a tail."""

from __future__ import annotations

import pytest
import torch

from worker_service.kernels import greedy

needs_library = pytest.mark.skipif(greedy.library() is None,
                                   reason="no AVX-512 greedy loop on this CPU")


def reference(logits: torch.Tensor) -> list[int]:
    return logits.float().argmax(-1).tolist()


both_dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


@needs_library
@both_dtypes
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 49152, 151936])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_random_logits_match_torch(rows, n, dtype):
    torch.manual_seed(rows * 1000 + n)
    logits = (torch.randn(rows, n) * 8).to(dtype)
    assert greedy.argmax_rows(logits) == reference(logits)


@needs_library
@both_dtypes
@pytest.mark.parametrize("n", [5, 16, 40, 1000])
def test_ties_go_to_the_first_index(n, dtype):
    """bfloat16 has few values: ties are common in real logits. Every lane and the tail
    hold the maximum somewhere; the first must win."""
    logits = torch.zeros(4, n, dtype=dtype)
    logits[0, :] = 3.0  # all equal: index 0
    logits[1, n // 2:] = 3.0  # from the middle on
    logits[2, n - 1] = 3.0  # only the last (a tail element where n % 16)
    logits[3, 1::3] = 3.0
    assert greedy.argmax_rows(logits) == reference(logits)
    assert greedy.argmax_rows(logits)[0] == 0


@needs_library
@both_dtypes
@pytest.mark.parametrize("n", [7, 48, 49152])
def test_nan_and_infinities_as_torch(n, dtype):
    logits = torch.randn(5, n).to(dtype)
    logits[0, :] = float("-inf")  # every value masked: index 0
    logits[1, n // 3] = float("nan")  # a NaN wins over everything
    logits[1, n - 1] = float("inf")
    logits[2, n - 1] = float("nan")  # NaN in the last position (the tail where n % 16)
    logits[2, 0] = float("nan")  # ... and a first one
    logits[3, n // 2] = float("inf")
    logits[4, :] = float("-inf")
    logits[4, n - 1] = -1e30
    assert greedy.argmax_rows(logits) == reference(logits)


@needs_library
@both_dtypes
def test_strided_rows_and_other_dtypes(dtype):
    """A view of every other row (the greedy rows of a mixed Step are gathered, but a
    strided view must work as well), float16 logits (torch's own argmax) and no rows."""
    torch.manual_seed(0)
    logits = torch.randn(8, 3000).to(dtype)
    view = logits[::2]
    assert greedy.argmax_rows(view) == reference(view)
    f16 = torch.randn(3, 999).half()
    assert greedy.argmax_rows(f16) == f16.argmax(-1).tolist()
    assert greedy.argmax_rows(torch.empty(0, 10, dtype=dtype)) == []
