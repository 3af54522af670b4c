"""The attention function the worker registers with transformers, and the masks it reads.

transformers lets a project register its own attention (`AttentionInterface`); models
loaded with `attn_implementation="seqserve"` call `seqserve_attention` in every layer.
The worker passes a boolean 4D mask [rows, 1, q, kv] that transformers hands through
unchanged. Decoding (one query per row) uses two batched matmuls, which on CPU is far
faster than the SDPA kernel at query length 1; longer queries use SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "seqserve"


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


def seqserve_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """query [rows, heads, q, dim]; key/value [rows, kv_heads, kv, dim] (strided views)."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if scaling is None:
        scaling = dim**-0.5
    if q_len == 1:
        group = heads // kv_heads
        # Heads h*group .. h*group+group-1 share kv head h, as repeat_kv would arrange them.
        q = query.reshape(rows, kv_heads, group, dim)
        scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [rows, kv_heads, group, kv]
        scores.mul_(scaling)
        if attention_mask is not None:
            scores.masked_fill_(~attention_mask[:, :, 0, :].unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        out = torch.matmul(probs, value)  # [rows, kv_heads, group, dim]
        return out.reshape(rows, 1, heads, value.shape[-1]), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling,
        enable_gqa=kv_heads != heads)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function; returns the `attn_implementation` name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, seqserve_attention)
    return ATTN_IMPLEMENTATION
