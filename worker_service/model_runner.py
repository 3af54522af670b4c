"""Loads a Hugging Face causal LM and runs a step's one packed forward and its output layer.

At load it chooses the KV dtype, routes the layers through the CPU kernels where they
apply (worker_service.kernels) and probes each layer's key and value shapes. `forward`
runs every token of a `PackedBatch`, whatever its groups, in one call of the base model;
its keys and values land in their groups' buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from seqserve_common.model_source import gguf_kwargs, model_files
from worker_service import attention
from worker_service.kernels import fused_layers, linear_prepack, native_attention
from worker_service.kv_groups import KVShape
from worker_service.packed_batch import PackedBatch, PackedCache, StatelessCache

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelFacts:
    model_id: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    dtype: str
    device: str


class _ShapeProbe(StatelessCache):
    """Records the per-layer key/value shapes of one token; keeps nothing."""

    def __init__(self):
        super().__init__()
        self.shapes: dict[int, tuple] = {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.shapes[layer_idx] = (key_states.shape[1], key_states.shape[3],
                                  value_states.shape[1], value_states.shape[3])
        return key_states, value_states


def _eos_ids(model_id: str, config, trust_remote_code: bool) -> tuple[int, ...]:
    try:
        gen = GenerationConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
        eos = gen.eos_token_id
    except (OSError, ValueError):
        eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _max_positions(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the KV buffers. auto: the model's, except on CPU where torch's attention
    reads half-precision keys one query row at a time far below memory speed (a decoding
    step over 30 rows of 300 slots, 12 heads of 64: 6.1 ms in bfloat16, 2.7 ms in float32).
    bfloat16 KV there is read by the native loops (kernels/native_attention.py, 0.13 ms);
    where it cannot be built, and for float16, the KV is kept in float32. Half precision
    converts to float32 exactly, so only the rounding inside attention changes."""
    if name == "auto":
        if device.type != "cpu" or model_dtype == torch.float32:
            return model_dtype
        if model_dtype == torch.bfloat16 and native_attention.kernel() is not None:
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"kv dtype {name!r} is not supported; use auto or one of "
                         f"{', '.join(DTYPES)}")
    return DTYPES[name]


class ModelRunner:
    """One model on one device, run through the seqserve attention and group caches."""

    def __init__(self, model_id: str, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, prepack: bool = True,
                 kv_dtype: str = "auto", gguf_cache_dir: str | None = None):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use auto or one of "
                             f"{', '.join(DTYPES)}")
        self.device = torch.device(device)
        impl = attention.register()
        # A .gguf file loads from its converted copy in gguf_cache_dir (made on first use).
        path, gguf_file = model_files(model_id, gguf_cache_dir)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            **gguf_kwargs(gguf_file))
        layer_types = getattr(config, "layer_types", None)
        if layer_types and len(set(layer_types)) > 1:
            raise ValueError(
                f"{model_id}: layers mix attention types {sorted(set(layer_types))}; seqserve "
                "supports models whose layers all use the same attention")
        self.sliding_window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            self.sliding_window = None
        # "auto" keeps the dtype the checkpoint was saved in, as transformers does.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype="auto" if dtype == "auto" else DTYPES[dtype],
            attn_implementation=impl, trust_remote_code=trust_remote_code,
            **gguf_kwargs(gguf_file, weights=True))
        self.model = model.to(self.device).eval()
        self.dtype = self.model.dtype
        dtype = {v: k for k, v in DTYPES.items()}.get(self.dtype, str(self.dtype))
        self.base = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.facts = ModelFacts(
            model_id=model_id,
            architecture=(config.architectures or [type(self.model).__name__])[0],
            vocab_size=int(self.lm_head.weight.shape[0]),
            eos_token_ids=_eos_ids(path, config, trust_remote_code),
            max_position_embeddings=_max_positions(config),
            dtype=dtype,
            device=str(self.device),
        )
        if prepack and linear_prepack.supported(self.model):
            n = linear_prepack.prepack_linears(self.model)
            self.lm_head = self.model.get_output_embeddings()
            logger.info("prepacked the weights of %d linear layers for oneDNN", n)
        norms, rotary = fused_layers.install(self.model)
        if norms or rotary:
            logger.info("one-pass C loops for %d RMSNorms and the rotary embedding of %d "
                        "modeling modules", norms, rotary)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype, self.device)
        self.kv_shape = self._probe_kv_shape()
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        logger.info("loaded %s (%s) on %s in %s; KV in %s, %d bytes per token", model_id,
                    self.facts.architecture, self.device, dtype, self.kv_dtype,
                    self.kv_shape.bytes_per_token)

    @torch.inference_mode()
    def _probe_kv_shape(self) -> KVShape:
        probe = _ShapeProbe()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.base(input_ids=ids, position_ids=ids, attention_mask=mask, past_key_values=probe,
                  use_cache=True)
        layers = [probe.shapes[i] for i in sorted(probe.shapes)]
        key_heads, key_dims = tuple(s[0] for s in layers), tuple(s[1] for s in layers)
        value_heads, value_dims = tuple(s[2] for s in layers), tuple(s[3] for s in layers)
        # Buffers need no zero fill when every read of them goes through the native
        # loops, which touch only each row's own slots (decoding and prompts; contrastive
        # candidates go through SDPA over slots their row has written). Asked of the same
        # predicate attention uses, on empty tensors of each layer's shapes.
        native_only = all(native_attention.supports(
            torch.empty(1, 1, 1, kd, dtype=self.dtype, device=self.device),
            torch.empty(1, kh, 1, kd, dtype=self.kv_dtype, device=self.device),
            torch.empty(1, vh, 1, vd, dtype=self.kv_dtype, device=self.device))
            for kh, kd, vh, vd in layers)
        return KVShape(key_heads=key_heads, key_dims=key_dims, value_heads=value_heads,
                       value_dims=value_dims, dtype=self.kv_dtype, device=self.device,
                       reads_padding=not native_only)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Run every token of `batch` in one forward; returns last-layer hidden states
        [tokens, hidden]. Each segment's keys and values land in its group's buffers."""
        n = batch.num_tokens
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)[None]
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)[None]
        # Attention masks itself per segment; transformers passes a 4D mask through
        # untouched, and this expanded view costs no memory.
        mask = self._no_mask.expand(1, 1, n, n)
        cache = PackedCache(batch, self.kv_shape.num_layers)
        with attention.active_batch(batch):
            out = self.base(input_ids=ids, position_ids=positions, attention_mask=mask,
                            past_key_values=cache, use_cache=True)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output-layer logits (float32) for hidden states [..., hidden]."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
