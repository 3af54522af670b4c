"""One forward over every token of a step, packed into a single sequence.

The linear layers (about nine tenths of a forward's work) do not care which sequence a
token belongs to, so a step runs them once over all of its tokens: the decoding rows
of every group and the whole prompts being prefilled, with no padding. Only attention
is per sequence. Each token knows its segment:

- `DecodeSegment`: rows [row_start, row_end) of one group, one token each. Attention
  reads the group's padded buffers (the padding that max-sparsity splitting bounds).
- `RowSegment`: several tokens of one row: a prompt (or what is left of it after a
  prefix-cache hit), or contrastive candidates (a tree: all at one position, each
  seeing the context and itself).

`PackedCache` is the transformers Cache the model sees: it writes each segment's new
keys and values into its group's buffers. `attend` is the attention that
`attention.seqserve_attention` dispatches to while a batch is active; it names the layer
whose buffers it reads, as the Cache update does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import Cache

from worker_service.kernels import native_attention
from worker_service.attention import FULL, LayerAttention, build_mask, explicit_attention
from worker_service.kv_groups import KVGroup


@dataclass
class DecodeSegment:
    """Rows [row_start, row_end) of `group`, one token each, at slot = the row's length."""

    group: KVGroup
    row_start: int
    row_end: int
    token_start: int  # first of this segment's tokens in the packed batch
    slots: torch.Tensor  # [rows] the slot each row's token is written to
    rows_index: torch.Tensor  # [rows] row numbers, for the scattered write
    kv_len: int
    ends: torch.Tensor  # [rows] int64: each row attends to slots below this (slot + 1)
    # Per LayerAttention (layers may differ in window or chunk): made on first use.
    _masks: dict = field(default_factory=dict)
    _biases: dict = field(default_factory=dict)

    def mask(self, spec: LayerAttention) -> torch.Tensor:
        """[rows, 1, 1, kv_len] bool: the slots each row's token sees in a layer of `spec`."""
        mask = self._masks.get(spec)
        if mask is None:
            mask = build_mask(self.slots, 1, self.kv_len, None, spec.window, spec.chunk)
            self._masks[spec] = mask
        return mask

    def bias(self, spec: LayerAttention) -> torch.Tensor:
        """The mask as an additive float tensor (0 or -inf), made on first use."""
        bias = self._biases.get(spec)
        if bias is None:
            mask = self.mask(spec)
            bias = torch.zeros(mask.shape, dtype=self.group.shape.dtype, device=mask.device)
            bias.masked_fill_(~mask, float("-inf"))
            self._biases[spec] = bias
        return bias

    @property
    def num_tokens(self) -> int:
        return self.row_end - self.row_start


@dataclass
class RowSegment:
    """`num_tokens` tokens of one row, written at slots start .. start + num_tokens - 1."""

    group: KVGroup
    row: int
    token_start: int
    num_tokens: int
    start: int  # slots before this one already hold the row's KV
    tree: bool = False  # contrastive candidates: each sees the context and itself only
    _masks: dict = field(default_factory=dict)

    @property
    def kv_len(self) -> int:
        return self.start + self.num_tokens

    def mask(self, spec: LayerAttention) -> torch.Tensor | None:
        """[1, 1, q, kv] bool in a layer of `spec`; None: plain causal over the new tokens
        (a whole prompt that no window or chunk cuts)."""
        if spec in self._masks:
            return self._masks[spec]
        n, mask = self.num_tokens, None
        if (self.tree or self.start > 0 or (spec.window is not None and n > spec.window)
                or (spec.chunk is not None and n > spec.chunk)):
            device = self.group.shape.device
            starts = torch.tensor([self.start], dtype=torch.long, device=device)
            tree_t = torch.ones(1, dtype=torch.bool, device=device) if self.tree else None
            mask = build_mask(starts, n, self.start + n, tree_t, spec.window, spec.chunk)
        self._masks[spec] = mask
        return mask


@dataclass
class PackedBatch:
    """The tokens of one forward, their positions, and the segments they form."""

    device: torch.device
    # Each layer's attention (ModelRunner.layer_attention); empty: every layer full causal.
    layers: tuple[LayerAttention, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[DecodeSegment | RowSegment] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add_decode(self, group: KVGroup, row_start: int, row_end: int,
                   token_ids: list[int]) -> DecodeSegment:
        """One token per row; each row's token goes at its current length."""
        lengths = [group.length(r) for r in range(row_start, row_end)]
        slots = torch.tensor(lengths, dtype=torch.long, device=self.device)
        kv_len = max(lengths) + 1
        seg = DecodeSegment(
            group, row_start, row_end, self.num_tokens, slots,
            torch.arange(row_start, row_end, device=self.device), kv_len, slots + 1)
        self.token_ids += token_ids
        self.positions += lengths
        self.segments.append(seg)
        return seg

    def add_row(self, group: KVGroup, row: int, token_ids: list[int], start: int,
                tree: bool = False) -> RowSegment:
        """Causal tokens at positions start.. (a prompt), or a tree of candidates that all
        sit at position `start`."""
        n = len(token_ids)
        seg = RowSegment(group, row, self.num_tokens, n, start, tree)
        self.token_ids += token_ids
        self.positions += [start] * n if tree else list(range(start, start + n))
        self.segments.append(seg)
        return seg

    # --- what the model calls, layer by layer ----------------------------------------------

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new keys/values [1, kv_heads, T, dim] of every segment in its group
        (a decoding segment that the C loop attends over: in `attend`'s call)."""
        for seg in self.segments:
            a, b = seg.token_start, seg.token_start + seg.num_tokens
            k_buf, v_buf = seg.group.keys[layer], seg.group.values[layer]
            if isinstance(seg, DecodeSegment):
                if not self._writes_in_attend(layer, key, k_buf, v_buf):
                    self._write_decode(seg, k_buf, v_buf, key[0, :, a:b].transpose(0, 1),
                                       value[0, :, a:b].transpose(0, 1))
            else:
                k_buf[seg.row, :, seg.start : seg.start + seg.num_tokens] = key[0, :, a:b]
                v_buf[seg.row, :, seg.start : seg.start + seg.num_tokens] = value[0, :, a:b]

    def _writes_in_attend(self, layer: int, key: torch.Tensor, k_buf: torch.Tensor,
                          v_buf: torch.Tensor) -> bool:
        """Whether a decoding segment's new keys and values in `layer` are written by the C
        loop's call in `attend` (one call, where index_put would take two a layer) rather
        than by `write`: decided alike in both from the new keys, which have the query's
        dtype and head size."""
        spec = self.layers[layer] if self.layers else FULL
        return spec.native and native_attention.supports(key[0, :, :1], k_buf, v_buf)

    @staticmethod
    def _write_decode(seg: DecodeSegment, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [rows, kv_heads, dim] into each row's slot (advanced indices on dims 0
        and 2 put them first: [rows, heads, dim])."""
        k_buf[seg.rows_index, :, seg.slots] = key.to(k_buf.dtype)
        v_buf[seg.rows_index, :, seg.slots] = value.to(v_buf.dtype)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [1, heads, T, dim] -> attention output [1, T, heads, value_dim], reading
        the buffers of `layer`, whose new keys and values `write` has stored.

        `key`/`value` are this layer's new keys and values [1, kv_heads, T, dim]: a whole
        prompt attends over them directly."""
        _, heads, total, _ = query.shape
        kv_heads = key.shape[1]
        spec = self.layers[layer] if self.layers else FULL
        window, softcap = spec.window, spec.softcap
        out = query.new_empty(1, total, heads, value.shape[-1])
        for seg in self.segments:
            a, b = seg.token_start, seg.token_start + seg.num_tokens
            if isinstance(seg, DecodeSegment):
                rows = seg.num_tokens
                k_buf, v_buf = seg.group.keys[layer], seg.group.values[layer]
                deferred = self._writes_in_attend(layer, key, k_buf, v_buf)
                new_k, new_v = key[0, :, a:b].transpose(0, 1), value[0, :, a:b].transpose(0, 1)
                if spec.native and native_attention.supports(query, k_buf, v_buf):
                    # On CPU: a C loop over each row's own slots (writing its new KV first).
                    out[0, a:b] = native_attention.attend(
                        query[0, :, a:b].transpose(0, 1), k_buf, v_buf, seg.row_start,
                        seg.ends, seg.kv_len, scaling, window,
                        *((new_k, new_v) if deferred else ()))
                    continue
                if deferred:
                    self._write_decode(seg, k_buf, v_buf, new_k, new_v)
                # SDPA reads the padding of shorter rows (masked): only zero-filled buffers.
                assert seg.group.shape.reads_padding, "unfilled KV buffers read past rows"
                # Fold the query heads that share a kv head into the query axis: no kv
                # head is repeated, and the row's mask broadcasts over them.
                q = query[0, :, a:b].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, -1)
                k = k_buf[seg.row_start : seg.row_end, :, : seg.kv_len]
                v = v_buf[seg.row_start : seg.row_end, :, : seg.kv_len]
                q = q.to(k.dtype)
                if k.dtype == torch.float32 and k.device.type == "cpu":
                    # Two batched products over the buffer views (no copy): with one query
                    # per row they beat SDPA's CPU kernel, which tiles for many queries.
                    scores = torch.matmul(q, k.transpose(-1, -2))
                    scores.mul_(scaling)
                    if softcap is not None:
                        scores.div_(softcap).tanh_().mul_(softcap)
                    scores.add_(seg.bias(spec))
                    o = torch.matmul(torch.softmax(scores, -1), v)
                elif softcap is not None:
                    o = explicit_attention(q, k, v, seg.mask(spec), scaling, softcap)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask(spec),
                                                       scale=scaling)
                out[0, a:b] = o.reshape(rows, heads, -1)
                continue
            k_buf, v_buf = seg.group.keys[layer], seg.group.values[layer]
            if (not seg.tree and spec.native
                    and native_attention.supports(query, k_buf, v_buf)):
                # Causal over the row's slots, prefix and window included: the C loop
                # reads the keys this segment just wrote (2.4x SDPA's speed at 512 tokens).
                out[0, a:b] = native_attention.attend_prompt(
                    query[0, :, a:b].transpose(0, 1), k_buf, v_buf, seg.row, seg.start,
                    scaling, window)
                continue
            q = query[:, :, a:b]
            mask = seg.mask(spec)
            if mask is None:
                # A whole prompt: its own new keys, plain causal attention.
                k, v = key[:, :, a:b], value[:, :, a:b]
            else:
                k = k_buf[seg.row : seg.row + 1, :, : seg.kv_len]
                v = v_buf[seg.row : seg.row + 1, :, : seg.kv_len]
            if softcap is not None:
                o = explicit_attention(q, k, v, mask, scaling, softcap)
            elif mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                   enable_gqa=kv_heads != heads)
            else:
                o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                                   scale=scaling, enable_gqa=kv_heads != heads)
            out[0, a:b] = o[0].transpose(0, 1)
        return out


class StatelessCache(Cache):
    """A transformers Cache that holds nothing itself: subclasses route `update` elsewhere.

    No Cache.__init__ and no per-layer objects: transformers' layer-type queries
    (is_sliding, ...) then see an empty list."""

    def __init__(self):
        self.layers = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


class PackedCache(StatelessCache):
    """The Cache the model sees during a packed forward: `update` writes each segment's new
    keys and values into its group's buffers; attention reads them through the batch."""

    def __init__(self, batch: PackedBatch, num_layers: int):
        super().__init__()
        self.batch = batch
        self.num_layers = num_layers

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.batch.write(layer_idx, key_states, value_states)
        return key_states, value_states

    def __len__(self) -> int:
        return self.num_layers
