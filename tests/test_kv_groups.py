"""KVGroup's row moves, over one buffer for all layers (uniform shapes) and over a buffer a
layer (shapes that differ): the same KV ends in the same rows either way."""

import pytest
import torch

from worker_service.kv_groups import KVGroup, KVShape

UNIFORM = ((2, 2, 2), (8, 8, 8), (2, 2, 2), (8, 8, 8))
MIXED = ((2, 1, 2), (8, 8, 16), (2, 1, 2), (8, 8, 16))  # a layer of other heads and dims


def _group(dims, rows=4, length=10) -> tuple[KVGroup, list[list[torch.Tensor]]]:
    shape = KVShape(*dims, dtype=torch.float32, device=torch.device("cpu"))
    g = KVGroup(shape)
    g.ensure_capacity(rows, 16)
    g.ensure_capacity(rows, 70)  # a reallocation keeps what was written
    truth = []
    for r in range(rows):
        g.add_empty_row(100 + r, length)
        kv = []
        for layer in range(shape.num_layers):
            k = torch.randn(shape.key_heads[layer], length, shape.key_dims[layer])
            v = torch.randn(shape.value_heads[layer], length, shape.value_dims[layer])
            g.keys[layer][r, :, :length] = k
            g.values[layer][r, :, :length] = v
            kv.append((k, v))
        g.fill(r, length)
        truth.append(kv)
    return g, truth


def _holds(g: KVGroup, row: int, kv, length: int) -> bool:
    return all(torch.equal(g.keys[layer][row, :, :length], k[:, :length])
               and torch.equal(g.values[layer][row, :, :length], v[:, :length])
               for layer, (k, v) in enumerate(kv))


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_rows_move_with_all_their_layers(dims):
    g, truth = _group(dims)
    assert (g.kv is not None) == (dims == UNIFORM)
    if g.kv is not None:  # every layer's keys and values are views of the one buffer
        base = g.kv.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in g.keys + g.values)
    g.ensure_capacity(9, 100)  # grow both ways: the rows keep their KV
    assert all(_holds(g, r, truth[r], 10) for r in range(4))
    g.remove_row(1)  # the last row moves into row 1
    assert g.seq_ids == [100, 103, 102] and _holds(g, 1, truth[3], 10)
    other, other_truth = _group(dims, rows=2, length=7)
    row = g.add_row_from(other, 1)
    assert row == 3 and g.length(row) == 7 and _holds(g, row, other_truth[1], 7)
    g.copy_within(0, 2, start=3)  # row 2 becomes row 0 from slot 3 on
    kv = [(torch.cat([k2[:, :3], k0[:, 3:]], 1), torch.cat([v2[:, :3], v0[:, 3:]], 1))
          for (k0, v0), (k2, v2) in zip(truth[0], truth[2])]
    assert _holds(g, 2, kv, 10) and _holds(g, 0, truth[0], 10)


@pytest.mark.parametrize("dims", [UNIFORM, MIXED])
def test_rows_dropped_together_move_only_the_kept_rows_past_the_new_end(dims):
    g, truth = _group(dims, rows=6)
    g.copied_bytes = 0
    g.remove_rows([1, 4, 5])  # one by one, row 5 would first move into row 1
    assert g.seq_ids == [100, 103, 102]
    assert all(_holds(g, r, truth[t], 10) for r, t in enumerate((0, 3, 2)))
    assert g.copied_bytes == 10 * g.shape.bytes_per_token  # row 3 alone moved
    g.remove_rows([2, 0])  # the last row, and one it fills
    assert g.seq_ids == [103] and _holds(g, 0, truth[3], 10) and g.lengths == (10,)


def test_a_growth_copies_each_row_up_to_its_own_length():
    g, truth = _group(UNIFORM, rows=4, length=40)
    for r, n in enumerate((40, 2, 3, 5)):
        g._lengths[r] = n  # the rows' KV ends where the lengths say
    g.copied_bytes = 0
    g.ensure_capacity(9, 100)
    assert all(_holds(g, r, truth[r], n) for r, n in enumerate((40, 2, 3, 5)))
    assert g.copied_bytes == 50 * g.shape.bytes_per_token  # not 4 rows x 40 slots
