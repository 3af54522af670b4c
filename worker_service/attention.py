"""The attention function the worker registers with transformers, and the masks it reads.

transformers lets a project register its own attention (`AttentionInterface`); models
loaded with `attn_implementation="seqserve"` call `seqserve_attention` in every layer.
While the runner executes a packed forward (`packed_batch.py`) the function hands each
layer, by its index, to that batch, which attends per segment over that layer's group
buffers; otherwise (the load-time shape probe) it is plain SDPA over what the cache
returned.

Layers need not attend alike: `LayerAttention` says what one layer's queries see (all
earlier slots, the last `window` of them, or their own `chunk`) and whether its scores are
softcapped (Gemma 2); `layer_attention` reads that from the config, as transformers'
masks do, and the load-time probe adds what the model passes each call (softcap).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "seqserve"

_active = threading.local()


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's queries see: every earlier slot, only the last `window` slots (their
    own included, as transformers' sliding masks), or only slots of their own `chunk` of
    positions (Llama 4's chunked layers); `softcap`: scores go through
    softcap * tanh(scores / softcap) before the softmax (Gemma 2)."""

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    # Whether the native loops can compute it (they know windows, not chunks or caps); a
    # field, not a property: attention reads it in every layer.
    native: bool = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "native", self.chunk is None and self.softcap is None)


FULL = LayerAttention()
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def layer_attention(config) -> tuple[tuple[LayerAttention, ...], str | None]:
    """Each layer's attention as the config describes it (the rule transformers' masks
    follow: `layer_types` where the config has them, else one `sliding_window` for every
    layer), and the reason the packed path cannot express them (None: it can).

    An empty tuple means every layer attends alike (the uniform window, if any, is then
    the one entry of a 1-tuple repeated by `per_layer`)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False or not isinstance(window, int):
        window = None
    types = getattr(text, "layer_types", None)
    if not types:
        return (LayerAttention(window=window),), None
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        return (), f"layer types {unknown} are not attention the packed path computes"
    chunk = getattr(text, "attention_chunk_size", None)
    specs = []
    for kind in types:
        if kind == "sliding_attention":
            if window is None:
                return (), "sliding_attention layers but no sliding_window in the config"
            specs.append(LayerAttention(window=window))
        elif kind == "chunked_attention":
            if not isinstance(chunk, int):
                return (), "chunked_attention layers but no attention_chunk_size in the config"
            specs.append(LayerAttention(chunk=chunk))
        else:
            specs.append(FULL)
    return tuple(specs), None


def build_mask(starts: torch.Tensor, q_len: int, kv_len: int, tree: torch.Tensor | None = None,
               sliding_window: int | None = None, chunk: int | None = None) -> torch.Tensor:
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
    if sliding_window is not None or chunk is not None:
        # Positions equal slots here, except for tree rows, whose candidates all sit at starts[r].
        pos = qpos if tree is None else torch.where(tree[:, None, None], starts[:, None, None], qpos)
        if sliding_window is not None:
            mask &= slot > pos - sliding_window
        if chunk is not None:
            mask &= torch.div(slot, chunk, rounding_mode="floor") == torch.div(
                pos, chunk, rounding_mode="floor")
    return mask[:, None]


@contextmanager
def recording(calls: dict):
    """Record, per layer index, the keyword arguments each attention call gets (outside a
    packed batch: the load-time probe)."""
    _active.calls = calls
    try:
        yield calls
    finally:
        _active.calls = None


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
    calls = getattr(_active, "calls", None)
    if calls is not None:
        calls[layer] = {k: v for k, v in kwargs.items() if v is not None}
    # The masks transformers made for this layer (sdpa's format: bool, or None where
    # plain causal attention is meant): the load-time self-check's reference.
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]
    softcap = kwargs.get("softcap")
    if softcap is not None:
        out = explicit_attention(query, key, value, attention_mask, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling,
        is_causal=attention_mask is None and query.shape[2] > 1,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, scaling: float,
                       softcap: float | None) -> torch.Tensor:
    """Attention written out, in transformers' eager order (scores, scaling, softcap, mask,
    softmax in float32): for what SDPA cannot do (softcapped scores). query [b, heads, q,
    dim], key/value [b, kv_heads, kv, dim] (query heads that share a key/value head are
    folded into the query axis, not repeated); mask bool broadcastable to [b, 1, q, kv],
    None: causal with the queries at the last q slots. Returns [b, heads, q, value_dim]."""
    b, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    g = heads // kv_heads
    if mask is None:
        slot = torch.arange(kv_len, device=query.device)
        qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = (slot[None, :] <= qpos[:, None])[None, None]
    q = query.to(key.dtype).reshape(b, kv_heads, g * q_len, dim)
    if g > 1:
        mask = mask.expand(mask.shape[0], 1, q_len, kv_len).repeat(1, 1, g, 1)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)
    return out.reshape(b, heads, q_len, value.shape[-1]).to(query.dtype)


def register() -> str:
    """Register the attention function; returns the `attn_implementation` name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, seqserve_attention)
    # Masks the model builds itself (a 2D attention mask: the self-check's reference
    # forward) in SDPA's format; packed forwards pass a 4D mask that transformers keeps.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
