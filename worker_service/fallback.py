"""The slow, always-correct path: a model's own attention over a transformers DynamicCache.

Some architectures never call transformers' attention interface (GPT-J, Falcon and Bloom
compute attention in their own modules, Bloom and some Falcons with ALiBi biases), and
some attend in ways the packed path cannot express (attention sinks, layer kinds other
than full, sliding or chunked). `ModelRunner` serves those through this class: the same
`forward(PackedBatch)` contract as the packed path (each segment's keys and values land
in its group's buffers, hidden states come back in packed order), but every segment runs
as its own forward of the model as transformers wrote it, loaded with its default
attention, over a `DynamicCache` filled from the row's buffer:

- a prompt (or what a prefix-cache hit left of it): one forward of its tokens;
- a decoding segment: one forward of one token per row;
- contrastive candidates: one forward with a batch of k rows, each the row's context and
  one candidate, as `generate` itself does.

The group buffers stay the source of truth, so regrouping, the prefix cache and the KV
budget work unchanged. The cost is a copy of each row's KV into the cache per forward and
one forward per sequence instead of one per step.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from worker_service.kv_groups import KVShape
from worker_service.packed_batch import DecodeSegment, PackedBatch


class OwnAttention:
    """Runs packed batches one segment (or one row) at a time through the model's own code."""

    def __init__(self, base: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.base = base
        self.device = device
        self.dtype = dtype
        params = inspect.signature(base.forward).parameters
        # Bloom takes no positions (ALiBi reads them off the attention mask).
        self.takes_positions = "position_ids" in params

    @torch.inference_mode()
    def probe_shapes(self) -> list[tuple[int, int, int, int]]:
        """(key heads, key dim, value heads, value dim) of each layer, from one token."""
        cache = DynamicCache()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._run(ids, cache, 0)
        shapes = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            if k is None or k.dim() != 4:
                raise ValueError("the model's cache holds no [batch, heads, tokens, dim] keys")
            shapes.append((k.shape[1], k.shape[3], v.shape[1], v.shape[3]))
        return shapes

    def _run(self, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
        rows, n = ids.shape
        mask = torch.ones(rows, start + n, dtype=torch.long, device=self.device)
        kwargs = {}
        if self.takes_positions:
            kwargs["position_ids"] = torch.arange(start, start + n,
                                                  device=self.device).expand(rows, n)
        out = self.base(input_ids=ids, attention_mask=mask, past_key_values=cache,
                        use_cache=True, **kwargs)
        return out.last_hidden_state

    def _cache(self, shape: KVShape, group, row: int, start: int, rows: int) -> DynamicCache:
        """A DynamicCache holding the row's first `start` tokens (repeated `rows` times)."""
        if start == 0:
            return DynamicCache()
        data = []
        for layer in range(shape.num_layers):
            k = group.keys[layer][row : row + 1, :, :start].to(self.dtype)
            v = group.values[layer][row : row + 1, :, :start].to(self.dtype)
            data.append((k.expand(rows, *k.shape[1:]), v.expand(rows, *v.shape[1:])))
        return DynamicCache(ddp_cache_data=data)

    def _segment(self, group, row: int, token_ids: list[int], start: int,
                 tree: bool) -> torch.Tensor:
        """One row's tokens (a prompt: [1, n]; candidates: [k, 1] all at `start`); writes
        their KV at slots start.. of the row; returns hidden states [n or k, hidden]."""
        shape = group.shape
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        ids = ids[:, None] if tree else ids[None]
        cache = self._cache(shape, group, row, start, ids.shape[0])
        hidden = self._run(ids, cache, start)
        n = len(token_ids)
        for layer, cached in enumerate(cache.layers):
            k, v = cached.keys[:, :, start:], cached.values[:, :, start:]
            if tree:  # [k, heads, 1, dim]: candidate j goes to slot start + j
                k, v = k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1)
            else:
                k, v = k[0], v[0]
            group.keys[layer][row, :, start : start + n] = k
            group.values[layer][row, :, start : start + n] = v
        return hidden.reshape(n, -1)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Hidden states [tokens, hidden] of every token of `batch`, in its order."""
        parts: list[torch.Tensor] = []
        for seg in batch.segments:
            if isinstance(seg, DecodeSegment):
                tokens = batch.token_ids[seg.token_start : seg.token_start + seg.num_tokens]
                for i, row in enumerate(range(seg.row_start, seg.row_end)):
                    parts.append(self._segment(seg.group, row, [tokens[i]],
                                               seg.group.length(row), False))
            else:
                tokens = batch.token_ids[seg.token_start : seg.token_start + seg.num_tokens]
                parts.append(self._segment(seg.group, seg.row, tokens, seg.start, seg.tree))
        return torch.cat(parts) if parts else torch.empty(0, device=self.device)
