"""The C bfloat16 product over pair-packed weights (kernels/dpbf16_linear.py) against float64
and oneDNN, and where the worker uses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import amx_on, needs_amx, without_amx
from worker_service.kernels import dpbf16_linear, linear_prepack

needs_library = pytest.mark.skipif(dpbf16_linear.library() is None,
                                   reason="no AVX512-BF16 here: every product runs oneDNN")


def _operands(rows: int, k: int, n: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _product(x, w, b):
    return dpbf16_linear.linear(x, dpbf16_linear.pack(w), b, w.shape[0])


def test_pack_puts_each_pair_of_inputs_of_16_columns_together():
    w = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6).bfloat16()
    p = dpbf16_linear.pack(w)
    assert p.shape == (3, 3, 16, 2)  # 40 columns -> 3 blocks (8 padding columns), 3 pairs
    for j in range(40):
        for i in range(6):
            assert p[j // 16, i // 2, j % 16, i % 2] == w[j, i]
    assert (p[2, :, 8:] == 0).all()


@needs_library
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (40, 24), (100, 7), (2, 3),
                                 (64, 70)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16, 17, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_product_equals_float64_up_to_the_bfloat16_rounding(k, n, rows, bias):
    """Row counts below, at and past a register tile (6 rows) and an AMX tile (16 rows);
    widths that fill whole 16-column blocks and tiles of 4 blocks, and ones that end in a
    part block; input widths that are multiples of 32 (the AMX tiles where the CPU has
    them) and ones that are not (the dot loop)."""
    x, w, b = _operands(rows, k, n, bias, seed=k * n + rows)
    got = _product(x, w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums of exact products, one rounding to bfloat16 (2^-8 relative)
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
    oned = nn.functional.linear(x, w, b)
    assert (got.float() - oned.float()).abs().max() <= oned.float().abs().max() * 2 ** -7


@needs_library
def test_a_row_has_the_same_bits_at_every_row_count():
    x, w, b = _operands(40, 576, 3072, True, seed=3)
    together = _product(x, w, b)
    for r in (0, 5, 6, 17, 39):
        assert torch.equal(_product(x[r:r + 1], w, b), together[r:r + 1])
    for start, stop in ((1, 40), (3, 10), (30, 37)):
        assert torch.equal(_product(x[start:stop], w, b), together[start:stop])
    # strided input rows (a slice of a wider tensor) and leading dimensions
    wide = torch.cat([x, x], dim=1)[:, :576]
    assert torch.equal(_product(wide, w, b), together)
    assert torch.equal(_product(x.view(4, 10, 576), w, b), together.view(4, 10, 3072))
    # past the AMX loop's 256-row chunks: slices across a chunk's end, against float64
    x, w, b = _operands(600, 1536, 96, True, seed=5)
    together = _product(x, w, b)
    for start, stop in ((250, 262), (255, 257), (511, 600), (0, 1)):
        assert torch.equal(_product(x[start:stop], w, b), together[start:stop])
    want = x.double() @ w.double().T + b.double()
    assert ((together.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()


@needs_library
def test_the_bits_do_not_depend_on_the_thread_count():
    """Teams of 1 to 7 threads (more than this machine's cores: some lose their core
    mid-product) split the columns their own way; every column must still be written,
    with the same bits as one thread's."""
    before = torch.get_num_threads()
    shapes = [(1, 576, 960), (3, 576, 576), (64, 1536, 576), (130, 576, 3072), (9, 64, 70)]
    operands = [_operands(rows, k, n, True, seed=rows + n) for rows, k, n in shapes]
    try:
        torch.set_num_threads(1)
        alone = [_product(x, w, b) for x, w, b in operands]
        for threads in range(2, 8):
            torch.set_num_threads(threads)
            for _ in range(20 if threads > 2 else 5):
                for (x, w, b), want in zip(operands, alone):
                    assert torch.equal(_product(x, w, b), want), (threads, x.shape, w.shape)
    finally:
        torch.set_num_threads(before)


@needs_library
def test_the_products_take_the_amx_tiles_where_the_cpu_has_them(monkeypatch):
    """On a CPU with AMX-BF16 the tile loop is on (5-12x the dot loop's rate there) unless
    the process started with SEQSERVE_AMX=0, and stays as it was loaded when SEQSERVE_AMX
    changes later (one loop per process)."""
    loaded = amx_on()
    assert dpbf16_linear.uses_amx() == loaded
    monkeypatch.setenv("SEQSERVE_AMX", "0" if loaded else "1")
    assert dpbf16_linear.uses_amx() == loaded


@needs_library
@needs_amx
def test_the_tile_loop_runs_and_rounds_as_the_dot_loop_up_to_a_last_bit(tmp_path):
    """The two loops sum the same exact products in the same order but round the pair sums
    their own ways: the last bits of a few values differ, which shows the tiles ran; a
    worker started with SEQSERVE_AMX=0 gets the dot loop's."""
    x, w, b = _operands(64, 576, 3072, True, seed=7)
    dot = without_amx(tmp_path, "from worker_service.kernels import dpbf16_linear as d\n"
                      "x, w, b = args\nresult = d.linear(x, d.pack(w), b, w.shape[0])",
                      x, w, b)
    tiles = _product(x, w, b)
    differ = dot != tiles
    assert 0 < int(differ.sum()) < dot.numel() // 100
    # one bfloat16 step of the value, or float32 sums' difference where sums cancel
    assert ((dot.float() - tiles.float()).abs() <= dot.float().abs() * 2 ** -7 + 1e-3).all()


@needs_library
def test_odd_widths_other_dtypes_and_no_rows():
    assert not dpbf16_linear.takes(torch.zeros(8, 7, dtype=torch.bfloat16))
    assert not dpbf16_linear.takes(torch.zeros(8, 8))
    assert dpbf16_linear.takes(torch.zeros(8, 8, dtype=torch.bfloat16))
    x, w, b = _operands(3, 64, 8, True, seed=4)
    with pytest.raises(TypeError, match="float32 inputs"):
        _product(x.float(), w, b)
    assert _product(x[:0], w, b).shape == (0, 8)


@needs_library
@pytest.mark.skipif(not linear_prepack.runs(torch.bfloat16), reason="no oneDNN bfloat16")
def test_prepacked_linear_takes_the_c_product_where_asked_and_possible():
    linear = nn.Linear(96, 40, dtype=torch.bfloat16)
    in_c = linear_prepack.PrepackedLinear(linear, c_product=True)
    onednn = linear_prepack.PrepackedLinear(linear)
    assert in_c.c_product and not onednn.c_product
    for rows in (1, 2, 7, 64):
        x = torch.randn(1, rows, 96).bfloat16()
        assert torch.equal(in_c(x), _product(x, linear.weight, linear.bias))
        assert (in_c(x).float() - onednn(x).float()).abs().max() <= 0.05
    odd = linear_prepack.PrepackedLinear(nn.Linear(95, 40, dtype=torch.bfloat16),
                                         c_product=True)
    assert not odd.c_product  # the loop reads pairs: oneDNN takes it


@needs_library
@pytest.mark.skipif(not linear_prepack.runs(torch.bfloat16), reason="no oneDNN bfloat16")
def test_the_worker_runs_the_c_product_and_generates_the_plain_forwards_tokens(tmp_path,
                                                                               monkeypatch):
    """Every linear layer of a bfloat16 worker takes the C product (batch-invariant mode
    too: it needs no padding row), and greedy decoding gives the tokens of the model's
    forward without prepacking; with the switch off, oneDNN's."""
    from worker_service.fixtures import make_model
    from worker_service.model_runner import ModelRunner
    from worker_service import batch_invariance

    model = make_model(tmp_path / "m", arch="llama", size="tiny", dtype="bfloat16", seed=1)

    def layers(runner):
        return [m for m in runner.model.modules()
                if isinstance(m, linear_prepack.PrepackedLinear)]

    runner = ModelRunner(str(model), dtype="bfloat16")
    assert layers(runner) and all(m.c_product for m in layers(runner))
    plain = ModelRunner(str(model), dtype="bfloat16", prepack=False)
    prompt = [(i * 7919 + 11) % 1000 + 3 for i in range(37)]
    assert _greedy(runner, prompt, 16) == _greedy(plain, prompt, 16)
    invariant = ModelRunner(str(model), dtype="bfloat16", batch_invariant=True)
    assert all(m.c_product for m in layers(invariant))
    assert batch_invariance.check(invariant) is None
    monkeypatch.setattr(dpbf16_linear, "library", lambda: None)
    assert not any(m.c_product for m in layers(ModelRunner(str(model), dtype="bfloat16")))


def _greedy(runner, prompt: list[int], steps: int) -> list[int]:
    from worker_service.kv_groups import KVGroup
    from worker_service.packed_batch import PackedBatch

    group = KVGroup(runner.kv_shape)
    group.add_empty_row(0, len(prompt) + steps)
    batch = PackedBatch(runner.device, runner.layer_attention)
    batch.add_row(group, 0, prompt, 0)
    with torch.inference_mode():
        out = [int(runner.logits(runner.forward(batch)[-1:]).argmax())]
        group.fill(0, len(prompt))
        for _ in range(steps - 1):
            batch = PackedBatch(runner.device, runner.layer_attention)
            batch.add_decode(group, 0, 1, [out[-1]])
            out.append(int(runner.logits(runner.forward(batch)).argmax()))
            group.advance(0, 1)
    return out


def _linear_silu(x, packed, b, inter) -> torch.Tensor | None:
    """linear_silu_dpbf16 of x [rows, k]; None where it declined (-1)."""
    from worker_service.kernels import fused_layers

    out = torch.full((x.shape[0], inter), float("nan"), dtype=torch.bfloat16)
    status = dpbf16_linear.library().linear_silu_dpbf16(
        x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
        x.shape[0], inter, x.shape[1], x.stride(0), fused_layers.silu_table().data_ptr())
    return None if status else out


@needs_library
@pytest.mark.parametrize("k,inter,bias", [(576, 1536, False), (1024, 96, True), (64, 32, True),
                                          (40, 64, True), (16, 32, False)])
def test_the_gate_product_and_its_silu_in_one_pass_have_the_bits_of_the_two_apart(
        k, inter, bias):
    """linear_silu_dpbf16 against the product of the stacked [gate | up] weight followed by
    eager torch's SiLU gate product in bfloat16: the same bits at row counts inside one
    256-row chunk of the tiles, across chunks, with several passes over k (1024: 32 tile
    steps), with a bias, and with teams of 1 to 3 threads; without the tiles (or for k = 40
    and 16, which they do not take) also at row counts under and between the register
    tiles'. k = 16 has fewer input pairs than a tile has outputs to finish inside the next
    tile's k loop (the dot loop finishes the rest after it)."""
    before = torch.get_num_threads()
    counts = ((32, 2), (96, 1), (288, 3), (544, 2))
    if not amx_on() or k % 32:
        counts += ((1, 2), (5, 1), (13, 2), (67, 3))
    try:
        for rows, threads in counts:
            torch.set_num_threads(threads)
            x, w, b = _operands(rows, k, 2 * inter, bias, seed=rows + k)
            w[inter:] *= 4  # up values of another size than the gate's
            packed = dpbf16_linear.pack(w)
            both = dpbf16_linear.linear(x, packed, b, 2 * inter)
            want = nn.functional.silu(both[:, :inter]) * both[:, inter:]
            got = _linear_silu(x, packed, b, inter)
            assert got is not None and torch.equal(got, want), (rows, threads)
            # strided input rows: a slice of a wider tensor
            wide = torch.cat([x, x], dim=1)[:, :k]
            assert torch.equal(_linear_silu(wide, packed, b, inter), want)
    finally:
        torch.set_num_threads(before)


@needs_library
def test_the_one_pass_gate_product_declines_what_it_does_not_take():
    """No rows and an inter not a multiple of 32 return -1 with nothing written,
    and on the tiles rows not a multiple of 32 (the dot loop takes them); the caller then
    runs the two apart."""
    declined = [(0, 64, 32), (32, 64, 48), (32, 64, 16)]
    if amx_on():
        declined.append((33, 64, 32))
    for rows, k, inter in declined:
        x, w, b = _operands(max(rows, 1), k, 2 * inter, False, seed=1)
        assert _linear_silu(x[:rows], dpbf16_linear.pack(w), b, inter) is None, (rows, k, inter)


@needs_library
@pytest.mark.parametrize("k,n,bias", [(576, 576, False), (1536, 576, True), (64, 70, True),
                                      (40, 7, False)])
def test_a_product_added_into_its_output_in_one_pass_has_the_bits_of_the_two_apart(
        k, n, bias):
    """linear_add_dpbf16 (a layer's output and down products with their residual adds)
    against the product followed by eager torch's bfloat16 add: the same bits under a
    16-row tile, past the 32-row loop, across 256-row chunks, in a part block of columns
    (70), with a bias and with teams of 1 to 3 threads."""
    before = torch.get_num_threads()
    try:
        for rows, threads in ((1, 2), (13, 1), (40, 2), (300, 3), (544, 2)):
            torch.set_num_threads(threads)
            x, w, b = _operands(rows, k, n, bias, seed=rows + n)
            packed = dpbf16_linear.pack(w)
            h = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).bfloat16()
            want = h + dpbf16_linear.linear(x, packed, b, n)
            status = dpbf16_linear.library().linear_add_dpbf16(
                x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(),
                h.data_ptr(), rows, n, k, x.stride(0))
            assert status == 0 and torch.equal(h, want), (rows, threads)
    finally:
        torch.set_num_threads(before)
