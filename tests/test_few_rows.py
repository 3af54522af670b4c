"""The C product of one to three bfloat16 rows (kernels/few_rows.py) against float64 and
oneDNN, and where the worker uses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_service.kernels import few_rows, linear_prepack

needs_library = pytest.mark.skipif(few_rows.library() is None,
                                   reason="no AVX512-BF16 here: every product runs oneDNN")


def _operands(rows: int, k: int, n: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@needs_library
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (40, 24), (100, 7), (64, 3)])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_product_equals_float64_up_to_the_bfloat16_rounding(k, n, rows, bias):
    """Widths that are multiples of 64, of 32 only, and neither (the masked tail)."""
    x, w, b = _operands(rows, k, n, bias, seed=k * n + rows)
    got = few_rows.linear(x, w, b, n)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums of exact products, one rounding to bfloat16 (2^-8 relative)
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
    oned = nn.functional.linear(x, w, b)
    assert (got.float() - oned.float()).abs().max() <= oned.float().abs().max() * 2 ** -7


@needs_library
def test_a_row_has_the_same_bits_alone_and_beside_others():
    x, w, b = _operands(3, 576, 3072, True, seed=3)
    three = few_rows.linear(x, w, b, 3072)
    for r in range(3):
        assert torch.equal(few_rows.linear(x[r:r + 1], w, b, 3072), three[r:r + 1])
    assert torch.equal(few_rows.linear(x[1:], w, b, 3072), three[1:])
    # strided input rows (a slice of a wider tensor) read the same values
    wide = torch.cat([x, x], dim=1)[:, :576]
    assert torch.equal(few_rows.linear(wide, w, b, 3072), three)


@needs_library
def test_more_rows_or_other_dtypes_are_left_to_onednn():
    x, w, b = _operands(4, 64, 8, True, seed=4)
    assert few_rows.linear(x, w, b, 8) is None
    assert few_rows.linear(x[:1].float(), w, b, 8) is None


@needs_library
@pytest.mark.skipif(not linear_prepack.runs(torch.bfloat16), reason="no oneDNN bfloat16")
def test_prepacked_linear_takes_the_c_product_for_one_to_three_rows_only():
    linear = nn.Linear(96, 40, dtype=torch.bfloat16)
    plain = linear_prepack.PrepackedLinear(linear, keep_plain=True)
    packed = linear_prepack.PrepackedLinear(linear)
    assert packed.plain_weight is None
    for rows in (1, 2, 3):
        x = torch.randn(1, rows, 96).bfloat16()
        assert torch.equal(plain(x), few_rows.linear(x, linear.weight, linear.bias, 40))
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(plain(x), packed(x))


@needs_library
def test_plain_weights_kept_only_where_memory_allows():
    model = nn.Sequential(nn.Linear(64, 64, dtype=torch.bfloat16))
    size = 64 * 64 * 2
    assert few_rows.keep_plain(model, int(size / few_rows.MEMORY_SHARE) + 1)
    assert not few_rows.keep_plain(model, int(size / few_rows.MEMORY_SHARE) - 1)
    assert not few_rows.keep_plain(model, None)
    assert not few_rows.keep_plain(nn.Sequential(nn.Linear(64, 64)), 1 << 40)  # float32


@needs_library
@pytest.mark.skipif(not linear_prepack.runs(torch.bfloat16), reason="no oneDNN bfloat16")
def test_the_worker_keeps_plain_weights_except_under_batch_invariance(tmp_path):
    from worker_service.fixtures import make_model
    from worker_service.model_runner import ModelRunner

    model = make_model(tmp_path / "m", arch="llama", size="tiny", dtype="bfloat16", seed=1)
    prepacked = [m for m in ModelRunner(str(model), dtype="bfloat16").model.modules()
                 if isinstance(m, linear_prepack.PrepackedLinear)]
    assert prepacked and all(m.plain_weight is not None for m in prepacked)
    invariant = ModelRunner(str(model), dtype="bfloat16", batch_invariant=True)
    assert all(m.plain_weight is None for m in invariant.model.modules()
               if isinstance(m, linear_prepack.PrepackedLinear))
