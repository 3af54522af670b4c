"""The attention function the worker registers with transformers, and the masks it reads.

transformers lets a project register its own attention (`AttentionInterface`); models
loaded with `attn_implementation="seqserve"` call `seqserve_attention` in every layer.
While the runner executes a packed forward (`packed_batch.py`) the function hands each
layer, by its index, to that batch, which attends per segment over that layer's group
buffers; otherwise (the load-time shape probe) it is plain SDPA over what the cache
returned.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "seqserve"

_active = threading.local()


def build_mask(starts: torch.Tensor, q_len: int, kv_len: int, tree: torch.Tensor | None = None,
               sliding_window: int | None = None) -> torch.Tensor:
    """Which key slots each query of each row may see: [rows, 1, q_len, kv_len] bool.

    Row r's query i sits at slot starts[r] + i. A causal row sees every slot up to its
    own; a tree row (contrastive candidates, all at the same position) sees the
    context slots before starts[r] and its own slot only, not the other candidates.
    """
    device = starts.device
    slot = torch.arange(kv_len, device=device)[None, None, :]  # [1, 1, kv]
    qpos = starts[:, None, None] + torch.arange(q_len, device=device)[None, :, None]  # [r, q, 1]
    mask = slot <= qpos
    if tree is not None and bool(tree.any()):
        tree_mask = (slot < starts[:, None, None]) | (slot == qpos)
        mask = torch.where(tree[:, None, None], tree_mask, mask)
    if sliding_window is not None:
        # Positions equal slots here, except for tree rows, whose candidates all sit at starts[r].
        pos = qpos if tree is None else torch.where(tree[:, None, None], starts[:, None, None], qpos)
        mask &= slot > pos - sliding_window
    return mask[:, None]


@contextmanager
def active_batch(batch):
    """Route this thread's attention calls to `batch` (a PackedBatch) for the duration."""
    _active.batch = batch
    try:
        yield
    finally:
        _active.batch = None


def layer_index(module) -> int:
    """The index of the layer whose attention `module` is: the one its keys and values
    were written under (transformers' attention modules pass `self.layer_idx` to the
    Cache update)."""
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no integer layer_idx; seqserve reads "
                         "each layer's KV buffers by the attention module's layer_idx")
    return layer


def seqserve_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """query [batch, heads, q, dim]; key/value [batch, kv_heads, kv, dim]."""
    dim = query.shape[-1]
    if scaling is None:
        scaling = dim**-0.5
    # Asked in the load-time probe too, so a model without layer indices fails at load.
    layer = layer_index(module)
    batch = getattr(_active, "batch", None)
    if batch is not None:
        return batch.attend(layer, query, key, value, scaling), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function; returns the `attn_implementation` name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, seqserve_attention)
    return ATTN_IMPLEMENTATION
