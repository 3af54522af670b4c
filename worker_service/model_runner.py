"""Loads a Hugging Face causal LM and runs a step's one packed forward and its output layer.

At load it chooses the KV dtype, routes the layers through the CPU kernels where they
apply (worker_service.kernels) and probes each layer's key and value shapes. `forward`
runs every token of a `PackedBatch`, whatever its groups, in one call of the base model;
its keys and values land in their groups' buffers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from seqserve_common.model_source import gguf_kwargs, model_files
from worker_service import (attention, batch_invariance, cpu_dtype, huge_pages, layer_loop,
                            tensor_parallel)
from worker_service.kernels import (dpbf16_linear, fused_layers, fused_projections,
                                    linear_prepack, native_attention, sharded_prepack)
from worker_service.fallback import OwnAttention
from worker_service.kv_groups import KVGroup, KVShape
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
                 kv_dtype: str = "auto", gguf_cache_dir: str | None = None,
                 batch_invariant: bool = False, tensor_parallel_degree: int = 1):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use auto or one of "
                             f"{', '.join(DTYPES)}")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # cuDNN's SDPA builds an execution plan per new shape, and a serving step's
            # shapes are new at every step (each row one token longer): on an H100 that
            # made every Step about 190 ms against 28 ms at a repeated shape. Flash and
            # memory-efficient attention have no per-shape setup.
            torch.backends.cuda.enable_cudnn_sdp(False)
        impl = attention.register()
        # A .gguf file loads from its converted copy in gguf_cache_dir (made on first use).
        path, gguf_file = model_files(model_id, gguf_cache_dir)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            **gguf_kwargs(gguf_file))
        # Under tensor parallelism (the process group is joined already) every rank loads
        # its shard of each layer; attention then sees this rank's heads only.
        shard = tensor_parallel.shard_kwargs(config, tensor_parallel_degree)
        if shard and batch_invariant:
            raise ValueError(f"{batch_invariance.OPTION} is not supported with "
                             f"tensor_parallel_degree={tensor_parallel_degree} (its padded "
                             "products are not built for sharded layers); turn one off")
        self.layer_attention, reason = attention.layer_attention(config)
        self.fallback: OwnAttention | None = None
        self.layer_loop: layer_loop.LayerLoop | None = None  # set once the model is final
        self.kv_dtype_name = kv_dtype

        def load(attn: str | None):
            # "auto" keeps the dtype the checkpoint was saved in, as transformers does.
            # attn None: the model's own default attention (the fallback path).
            extra = {} if attn is None else {"attn_implementation": attn}
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype="auto" if dtype == "auto" else DTYPES[dtype],
                trust_remote_code=trust_remote_code, **extra, **shard,
                **gguf_kwargs(gguf_file, weights=True))
            return self._place(model.to(self.device).eval(), sharded=bool(shard))

        layers = None
        if reason is None:
            try:
                layers, reason = self._check_packed(load(impl))
            except Exception as exc:  # e.g. GPT-J and Falcon look their attention up by name
                reason = (f"it does not run with a registered attention function "
                          f"({type(exc).__name__}: {exc})")
        if reason is not None:
            self.model = None
            layers = self._use_fallback(load(None), config, reason)
        dtype = {v: k for k, v in DTYPES.items()}.get(self.dtype, str(self.dtype))
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
        # A sharded model's linear layers hold DTensors inside transformers' tensor-parallel
        # forward: they get prepacked shards under the same styles (sharded_prepack.py);
        # the fused norm and rotary loops, which patch modules the plan may also wrap,
        # stay off under tensor parallelism.
        sharded = bool(shard)
        if prepack and linear_prepack.supported(self.model):
            min_rows = batch_invariance.MIN_ROWS if batch_invariant else 1
            # bfloat16 products in C where the CPU has AVX512-BF16 (dpbf16_linear.py);
            # tensor-parallel shards keep oneDNN (sharded_prepack.py)
            c_product = not sharded and dpbf16_linear.library() is not None

            def prepacked(linear):
                return linear_prepack.PrepackedLinear(linear, min_rows, c_product)
            qkv = 0 if sharded else fused_projections.fuse_qkv(self.model, prepacked)
            # gate and up stacked only for the C SiLU product, which reads both halves
            gate_up = (0 if sharded or not fused_layers.mlp_product_builds() else
                       fused_projections.fuse_gate_up(self.model, prepacked))
            n = (sharded_prepack.prepack_sharded_linears(self.model) if sharded else
                 linear_prepack.prepack_linears(self.model, min_rows, c_product)
                 + 3 * qkv + 2 * gate_up)
            self.lm_head = self.model.get_output_embeddings()
            linear_prepack.log_prepacked(self.model, n, sharded, qkv, gate_up)
        norms, rotary = (0, 0) if sharded else fused_layers.install(self.model)
        mlps = 0 if sharded else fused_layers.install_mlp(self.model)
        if norms or rotary or mlps:
            logger.info("one-pass C loops for %d RMSNorms, the rotary embedding of %d "
                        "modeling modules and the SiLU gate product of %d MLPs", norms,
                        rotary, mlps)
        # once prepacking has replaced the weights; the C step takes their addresses after
        self.weight_huge_page_bytes = huge_pages.weights_onto_huge_pages(self.model)
        self.kv_shape = self._kv_shape(layers)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.layer_loop = None if self.fallback is not None or sharded else self._layer_loop()
        if batch_invariant:
            reason = batch_invariance.unsupported(self) or batch_invariance.check(self)
            if reason is not None:
                raise ValueError(f"{batch_invariance.OPTION} cannot hold for {model_id}: "
                                 f"{reason}; turn it off or see worker_service/"
                                 "batch_invariance.py")
            logger.info("batch-invariant: a request's logits do not depend on the batch "
                        "(checked on a probe)")
        logger.info("loaded %s (%s) on %s in %s; KV in %s, %d bytes per token; %s", model_id,
                    self.facts.architecture, self.device, dtype, self.kv_dtype,
                    self.kv_shape.bytes_per_token,
                    "fallback path" if self.fallback is not None else "packed path")

    def _place(self, model, sharded: bool):
        """Make `model` the runner's model (its dtype settled for this device); returns it."""
        if self.device.type == "cpu":
            model = cpu_dtype.settle(model, swap_modules=not sharded)
        self.model = model
        self.dtype = cpu_dtype.compute_dtype(model)
        self.base = model.base_model
        if self.base is model:  # e.g. Llama4ForCausalLM, whose prefix names no submodule
            self.base = next((m for m in (getattr(model, "model", None),
                                          getattr(model, "transformer", None))
                              if isinstance(m, torch.nn.Module)), model)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.kv_dtype = resolve_kv_dtype(self.kv_dtype_name, self.dtype, self.device)
        return model

    @torch.inference_mode()
    def _check_packed(self, model) -> tuple[list | None, str | None]:
        """Whether the packed path computes what `model` does: every layer must write its
        keys and values to the cache and attend through the registered function with
        nothing the packed path ignores, and a probe prompt must give the hidden states of
        the model's own masks. Returns (per-layer KV shapes, None) or (None, the reason)."""
        probe, calls = _ShapeProbe(), {}
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        try:
            with attention.recording(calls):
                self.base(input_ids=ids, position_ids=ids, attention_mask=self._no_mask,
                          past_key_values=probe, use_cache=True)
        except Exception as exc:  # e.g. Bloom, which never calls the attention interface
            return None, (f"its forward does not run over seqserve's cache "
                          f"({type(exc).__name__}: {exc})")
        if not probe.shapes:
            return None, "its layers write no keys and values to the cache"
        indices = sorted(probe.shapes)
        if indices != list(range(len(indices))):
            return None, f"only layers {indices[:8]}... hold keys and values (shared KV)"
        missing = [i for i in indices if i not in calls]
        if missing:
            return None, (f"layers {missing[:8]} compute attention themselves, not through "
                          "transformers' attention interface")
        for layer in indices:
            if "s_aux" in calls[layer]:
                return None, "its attention has sinks (s_aux)"
            if calls[layer].get("is_causal") is False:
                return None, "its attention is bidirectional"
        specs = self.layer_attention
        if len(specs) == 1:
            specs = specs * len(indices)
        if len(specs) != len(indices):
            return None, f"the config names {len(specs)} layer types for {len(indices)} layers"
        self.layer_attention = tuple(
            dataclasses.replace(spec, softcap=calls[i].get("softcap"))
            for i, spec in enumerate(specs))
        layers = [probe.shapes[i] for i in indices]
        return layers, self._self_check(layers)

    @torch.inference_mode()
    def _self_check(self, layers: list) -> str | None:
        """Prefill a probe prompt and decode one more token through the packed path, and
        compare every hidden state with one plain forward of the model (its own masks,
        which is where a window, chunk or layer kind the config hides would show)."""
        spans = [s.window or s.chunk for s in self.layer_attention if s.window or s.chunk]
        n = min(max([48] + [2 * w + 8 for w in spans]), 256,
                _max_positions(self.model.config) - 1)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        ids = (torch.arange(n, device=self.device) * 7919 + 11) % vocab
        self.kv_shape = self._kv_shape(layers)
        got = self._probe(ids.tolist()).float()
        ref = self.base(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                        use_cache=False).last_hidden_state[0].float()
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        if not err <= tol:
            return (f"on a {n}-token probe the packed path's hidden states differ from the "
                    f"model's own by {err:.3g} (relative; tolerance {tol})")
        return None

    @torch.inference_mode()
    def _layer_loop(self) -> layer_loop.LayerLoop | None:
        """The plain layer loop, where it applies and gives the model's own forward's bits
        on a probe (a prompt and one decoding token); else None, and the reason logged."""
        reason = layer_loop.unsupported(self.base)
        if reason is None:
            loop = layer_loop.LayerLoop(self.base)
            vocab = self.model.get_input_embeddings().weight.shape[0]
            ids = [(i * 7919 + 11) % vocab for i in range(17)]
            if torch.equal(self._probe(ids, loop), self._probe(ids)):
                logger.info("packed forwards run the plain layer loop")
                return loop
            reason = "on a probe it does not give the bits of the model's own forward"
        logger.info("packed forwards run the model's own forward: %s", reason)
        return None

    def _probe(self, ids: list[int], loop: layer_loop.LayerLoop | None = None
               ) -> torch.Tensor:
        """The hidden states [len(ids), hidden] of a packed prefill of ids[:-1] and then the
        decoding step of ids[-1] over its KV, each through `_packed(batch, loop)`."""
        group = KVGroup(self.kv_shape)
        group.add_empty_row(0, len(ids) + 1)
        batch = PackedBatch(self.device, self.layer_attention)
        batch.add_row(group, 0, ids[:-1], 0)
        first = self._packed(batch, loop)
        group.fill(0, len(ids) - 1)
        batch = PackedBatch(self.device, self.layer_attention)
        batch.add_decode(group, 0, 1, ids[-1:])
        return torch.cat([first, self._packed(batch, loop)])

    def _use_fallback(self, model, config, reason: str) -> list:
        """Serve `model` (loaded with its default attention) through its own attention and
        a DynamicCache; logs once why. Returns its per-layer KV shapes."""
        arch = (config.architectures or [type(model).__name__])[0]
        self.fallback = OwnAttention(self.base, self.device, self.dtype)
        self.layer_attention = ()
        try:
            layers = self.fallback.probe_shapes()
        except Exception as exc:
            raise ValueError(
                f"{arch} cannot be served: the packed path cannot run it ({reason}), and its "
                f"own attention over a DynamicCache fails too ({type(exc).__name__}: {exc})"
            ) from exc
        if self.kv_dtype_name == "auto":
            self.kv_dtype = self.dtype  # the cache the model's own attention reads
        logger.warning("%s runs on the FALLBACK path (its own attention, one forward per "
                       "sequence, slower) because %s", arch, reason)
        return layers

    def _kv_shape(self, layers: list) -> KVShape:
        key_heads, key_dims = tuple(s[0] for s in layers), tuple(s[1] for s in layers)
        value_heads, value_dims = tuple(s[2] for s in layers), tuple(s[3] for s in layers)
        # Buffers need no zero fill when every read of them goes through the native
        # loops, which touch only each row's own slots (decoding and prompts; contrastive
        # candidates go through SDPA over slots their row has written). Asked of the same
        # predicate attention uses, on empty tensors of each layer's shapes.
        specs = self.layer_attention or (attention.FULL,)
        if len(specs) == 1:
            specs = specs * len(layers)
        native_only = self.fallback is None and all(spec.native and native_attention.supports(
            torch.empty(1, 1, 1, kd, dtype=self.dtype, device=self.device),
            torch.empty(1, kh, 1, kd, dtype=self.kv_dtype, device=self.device),
            torch.empty(1, vh, 1, vd, dtype=self.kv_dtype, device=self.device))
            for spec, (kh, kd, vh, vd) in zip(specs, layers))
        return KVShape(key_heads=key_heads, key_dims=key_dims, value_heads=value_heads,
                       value_dims=value_dims, dtype=self.kv_dtype, device=self.device,
                       reads_padding=not native_only)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, rows: list[int] | None = None,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        """Run every token of `batch` in one forward; returns last-layer hidden states
        [tokens, hidden], or with `rows` (strictly ascending token indices: the states the
        caller reads) [len(rows), hidden], where the C step may leave the other tokens'
        last layer out but for its keys and values. Each segment's keys and values land
        in its group's buffers. `between` runs between two layers whenever the
        `pause_flag` is set (only where the layer loop runs the forward)."""
        if self.fallback is not None:
            hidden = self.fallback.forward(batch)
            return hidden if rows is None else hidden[rows]
        return self._packed(batch, self.layer_loop, rows, between)

    def pause_flag(self) -> ctypes.c_int32 | None:
        """The flag that stops a forward between two layers for its `between` (None: none)."""
        return None if self.layer_loop is None else self.layer_loop.pause

    def _packed(self, batch: PackedBatch, loop: layer_loop.LayerLoop | None = None,
                rows: list[int] | None = None,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        n = batch.num_tokens
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)[None]
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)[None]
        if loop is not None:
            return loop.forward(batch, ids, positions, rows, between)[0]
        # Attention masks itself per segment; transformers passes a 4D mask through
        # untouched, and this expanded view costs no memory.
        mask = self._no_mask.expand(1, 1, n, n)
        cache = PackedCache(batch, self.kv_shape.num_layers)
        with attention.active_batch(batch):
            out = self.base(input_ids=ids, position_ids=positions, attention_mask=mask,
                            past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state[0]
        return hidden if rows is None else hidden[rows]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output-layer logits (float32) for hidden states [..., hidden]."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
