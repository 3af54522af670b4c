"""The packed forward of Llama-family models as one plain loop over the layers.

transformers' forward reaches each layer's arithmetic through the model's, the decoder
layer's and the attention's `forward` (keyword plumbing, output capture, the mask
builders, `nn.Module.__call__` with its hook checks, attribute look-ups through
`nn.Module.__getattr__`): about 80 us a layer here, 2.5 ms of a 30-layer SmolLM2
decoding step, whose arithmetic at 1-16 rows takes 20-30 ms. `LayerLoop` runs the same
operations in the same order on the same modules, so the hidden states have the same bits,
with the per-layer objects looked up once at load.

Only models whose code is known to compute exactly this take the loop: a base model whose
`forward` is Llama's, Mistral's or Qwen2's (they differ only in the masks, which the
packed batch makes itself), decoder layers with `LlamaDecoderLayer.forward`, and attention
whose `forward` is one of those fused_projections knows. Everything else runs the model's
own forward.
"""

from __future__ import annotations

import ctypes
import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from worker_service.kernels import step_layers
from worker_service.kernels.fused_layers import same_code
from worker_service.kernels.fused_projections import KNOWN_FORWARDS
from worker_service.packed_batch import PackedBatch

SWITCH = "SEQSERVE_LAYER_LOOP"  # 0: always the model's own forward
BASE_FORWARDS = (modeling_llama.LlamaModel.forward, modeling_mistral.MistralModel.forward,
                 modeling_qwen2.Qwen2Model.forward)
ROTARY_FORWARDS = (modeling_llama.LlamaRotaryEmbedding.forward,)

Call = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    """What one decoder layer runs, looked up once."""

    index: int  # the attention's layer_idx: whose KV buffers it writes and reads
    input_norm: Call
    q_proj: Call
    k_proj: Call
    v_proj: Call
    head_dim: int
    scaling: float
    rotary: Callable  # the apply_rotary_pos_emb its attention's forward calls
    o_proj: Call
    post_norm: Call
    mlp: Call


def _direct(module: nn.Module) -> Call:
    """The module's `forward` itself where nothing hooks into its call when the loop is
    built (hooks need `nn.Module.__call__`), else the module. Hooks registered later are
    not seen: the worker registers none. (Global hooks: `unsupported` refuses the loop.)"""
    hooked = module._forward_hooks or module._forward_pre_hooks
    return module if hooked else module.forward


class LayerLoop:
    """The base model's forward over a PackedBatch, without transformers' plumbing."""

    def __init__(self, base: nn.Module):
        self.embed = _direct(base.embed_tokens)
        self.rotary_emb = _direct(base.rotary_emb)
        self.norm = _direct(base.norm)
        self.layers = tuple(self._layer(layer)
                            for layer in base.layers[: base.config.num_hidden_layers])
        # A step runs every layer in one C call where all layers take it.
        self.step_layers = step_layers.StepLayers.build(self.layers)
        # Set: a forward given `between` runs it before its next layer.
        self.pause = (self.step_layers.pause if self.step_layers is not None
                      else ctypes.c_int32(0))

    @staticmethod
    def _layer(layer: nn.Module) -> _Layer:
        attn = layer.self_attn
        return _Layer(index=attn.layer_idx, input_norm=_direct(layer.input_layernorm),
                      q_proj=_direct(attn.q_proj), k_proj=_direct(attn.k_proj),
                      v_proj=_direct(attn.v_proj), head_dim=attn.head_dim,
                      scaling=attn.scaling, rotary=_rotary_function(attn),
                      o_proj=_direct(attn.o_proj),
                      post_norm=_direct(layer.post_attention_layernorm), mlp=_direct(layer.mlp))

    def forward(self, batch: PackedBatch, ids: torch.Tensor, positions: torch.Tensor,
                rows: list[int] | None = None,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        """ids, positions [1, tokens] -> last-layer hidden states [1, tokens, hidden], or
        with `rows` (strictly ascending token indices) those rows' [1, len(rows), hidden];
        each layer's new keys and values land in the batch's group buffers. `between`
        runs before any layer but the first that finds `pause` set."""
        hidden = self.embed(ids)
        cos, sin = self.rotary_emb(hidden, positions)
        if self.step_layers is not None and self.step_layers.takes(batch, hidden, cos):
            return self.norm(self.step_layers.forward(batch, hidden, cos, sin, rows, between))
        shape = hidden.shape[:-1]
        for i, layer in enumerate(self.layers):
            if i and between is not None and self.pause.value:
                between()
            # LlamaDecoderLayer.forward and LlamaAttention.forward, with the Cache update
            # and the attention interface resolved to what they call on a packed batch.
            residual = hidden
            x = layer.input_norm(hidden)
            heads = (*shape, -1, layer.head_dim)
            query = layer.q_proj(x).view(heads).transpose(1, 2)
            key = layer.k_proj(x).view(heads).transpose(1, 2)
            value = layer.v_proj(x).view(heads).transpose(1, 2)
            query, key = layer.rotary(query, key, cos, sin)
            batch.write(layer.index, key, value)
            out = batch.attend(layer.index, query, key, value, layer.scaling)
            hidden = residual + layer.o_proj(out.reshape(*shape, -1).contiguous())
            residual = hidden
            hidden = residual + layer.mlp(layer.post_norm(hidden))
        return self.norm(hidden if rows is None else hidden[:, rows])


def _rotary_function(attn: nn.Module) -> Callable | None:
    """The `apply_rotary_pos_emb` that `attn`'s forward looks up (in its own module's
    globals, where fused_layers.install may have replaced it)."""
    return inspect.unwrap(type(attn).forward).__globals__.get("apply_rotary_pos_emb")


def _overridden(module: nn.Module) -> bool:
    """Whether calling `module` may do more than its class's `forward`: hooks, a forward
    set on the instance (accelerate's hooks do that) or a `__call__` of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or "forward" in vars(module) or type(module).__call__ is not nn.Module.__call__)


def unsupported(base: nn.Module) -> str | None:
    """Why `base` cannot take the layer loop (None: it can). The modules the loop calls
    itself (norms, projections, MLPs, embeddings) may be anything; those whose code it
    replaces (the base model, decoder layers, attention) must run exactly their class's
    forward."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if (nn.modules.module._global_forward_hooks
            or nn.modules.module._global_forward_pre_hooks):
        return "global forward hooks are registered"
    if not any(same_code(type(base).forward, ref) for ref in BASE_FORWARDS):
        return f"{type(base).__name__}.forward is not Llama's, Mistral's or Qwen2's"
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not any(same_code(type(rotary).forward, ref) for ref in ROTARY_FORWARDS):
        return "its rotary embedding is not Llama's"
    for layer in base.layers:
        if not same_code(type(layer).forward, modeling_llama.LlamaDecoderLayer.forward):
            return f"{type(layer).__name__}.forward is not LlamaDecoderLayer's"
        attn = getattr(layer, "self_attn", None)
        if attn is None or not any(same_code(type(attn).forward, ref) for ref in KNOWN_FORWARDS):
            return f"{type(attn).__name__}.forward is not one the loop knows"
        if not callable(_rotary_function(attn)):
            return "its attention's forward finds no apply_rotary_pos_emb"
        for module in (layer, attn):
            if _overridden(module):
                return f"a {type(module).__name__} has hooks or its own forward or __call__"
    if _overridden(base):
        return f"the {type(base).__name__} has hooks or its own forward or __call__"
    return None
