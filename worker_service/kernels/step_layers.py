"""A step's decoder layers in one C call (`step_layers.c`): in bfloat16, or in float32 over
packed bfloat16 weights (a bfloat16 model on a CPU without native bfloat16, bf16_weights.py).

The layer loop (layer_loop.py) runs every layer's arithmetic in C loops already, but calls
each through Python: per layer a norm, the stacked q/k/v product, two rotary passes, the
decoding attention with its KV write, the output product, a residual add, a norm, the
gate/up product, the SiLU gate product, the down product and an add, with their tensor
allocations and checks. On SmolLM2 (30 layers) that was about 6 ms of a one-row decoding
step of 18 ms. Here one call runs all layers, calling the same compiled functions (passed
as pointers from the libraries the loop uses) with the same arguments, so the hidden states
have the same bits; the worker's probe of the loop (ModelRunner._layer_loop) compares a
decoding step against the model's own forward too.

The gate/up product and the SiLU gate product run as one pass (dpbf16_linear.c's
linear_silu_dpbf16; on AMX tiles from 32 rows on), and the output and down products add
into the hidden states in their own pass (linear_add_dpbf16), with the same bits: the
megabytes of a long prompt's intermediate products are never written out and read back.
On AMX a 2048-token SmolLM2 prefill went from 435 to 400 ms (the SiLU) and 381 ms (the
adds), medians of three alternated runs; at 512 tokens the change was within the noise.

In float32 the products are bf16_weights.c's, the SiLU gate product fused_layers.c's own
float32 loop (which the model's MLPs then run in every path, so that the call keeps the
per-layer calls' bits), and the attention the float32 loops of native_attention.c and
prompt_attention.c. On an AVX2 EPYC (2 threads) SmolLM2's steps ran 1.77x as fast at one
decoding row, 1.33x at 16, 1.21x at 64, and 1.10x on prefills of 1 x 512 and 4 x 128
tokens (`python -m bench.step_ab ... --change layers`, medians of 5 alternated rounds).

Given the rows the caller reads (the tokens a step samples from), the last layer of every
other token stops once its keys and values are in the cache: a prompt token's last-layer
output is never read. On this project's EPYC a prefill ran 1.01-1.03x faster on
SmolLM2 (30 layers), 1.05-1.06x on qwen2-gqa (16) and 1.10-1.13x on mid (8).

It takes steps of decoding rows and prompts (whole or in chunks, after a cached prefix),
not contrastive search's candidate trees, and only layers built from the pieces it calls,
all in one dtype: C norms, q/k/v and gate/up stacked into C products, the C output and
down products, the C rotary embedding, and attention the native loops compute.
`SEQSERVE_STEP_LAYERS=0` keeps the per-layer calls.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_service.kernels import (bf16_weights, dpbf16_linear, fused_layers,
                                    fused_projections, native_attention, native_build)
from worker_service.kernels.bf16_weights import Bf16WeightLinear
from worker_service.kernels.linear_prepack import PrepackedLinear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("step_layers.c")
SWITCH = "SEQSERVE_STEP_LAYERS"
_P, _I = native_build.P, native_build.I64


class _Kernels(ctypes.Structure):
    _fields_ = [("rms_norm", _P), ("linear", _P), ("rotary", _P), ("silu_rows", _P),
                ("decode", _P), ("prompt", _P), ("prompt_tiled", _P),
                ("tiled_min_tokens", _I), ("silu", _P), ("linear_silu", _P),
                ("linear_add", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("qkv", _P), ("qkv_bias", _P), ("o", _P),
                ("o_bias", _P), ("gate_up", _P), ("gate_up_bias", _P), ("down", _P),
                ("down_bias", _P), ("scaling", ctypes.c_float), ("window", _I)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("dim", _I), ("inter", _I)]


class _Segment(ctypes.Structure):
    _fields_ = [("kind", _I), ("token_start", _I), ("rows", _I), ("max_end", _I),
                ("start", _I), ("row_stride", _I), ("head_stride", _I), ("ends", _P)]


_STEP_ARGS = [_P, _P, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _P, _P]
# The call for each compute dtype: bfloat16 over dpbf16_linear's products, float32 over
# bf16_weights' (a bfloat16 model on a CPU without native bfloat16).
ENTRY = {torch.bfloat16: "step_layers_bf16", torch.float32: "step_layers_f32"}
FUNCTIONS = {name: (_STEP_ARGS, ctypes.c_int) for name in ENTRY.values()}
_SCRATCH = ("normed", "qkv", "q_rows", "attn", "product", "gate_up", "act")


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _P) for name in _SCRATCH]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library, built on first use; None where it cannot be built."""
    return native_build.build(SOURCE, SWITCH, "steps call each layer's C loops "
                              "from Python", FUNCTIONS)


def _pointer(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _c_linear(module) -> PrepackedLinear | Bf16WeightLinear | None:
    """`module` if it is a C product the call can run (dpbf16_linear's bfloat16 one, or
    bf16_weights' float32 one), else None."""
    if isinstance(module, PrepackedLinear) and module.c_product:
        return module
    return module if isinstance(module, Bf16WeightLinear) else None


def _packed(module: PrepackedLinear | Bf16WeightLinear) -> torch.Tensor:
    """The packed weight the C product reads."""
    return module.packed if isinstance(module, Bf16WeightLinear) else module.packed_weight


def _norm(call) -> tuple[torch.Tensor, float] | None:
    """The weight and epsilon of a norm whose forward is the C norm's, else None."""
    module = getattr(call, "__self__", None)
    if getattr(call, "__func__", None) is not fused_layers._rms_norm:
        return None
    w = getattr(module, "weight", None)
    if w is None or w.dtype not in ENTRY or not w.is_contiguous():
        return None
    return w, float(module.variance_epsilon)


def _stacked(slices) -> PrepackedLinear | Bf16WeightLinear | None:
    """The C product that `slices` (the q/k/v or gate/up ProductSlices, in order) cut
    into consecutive columns, else None."""
    if not all(isinstance(s, types.MethodType) and isinstance(s.__self__,
               fused_projections.ProductSlice) for s in slices):
        return None
    parts = [s.__self__ for s in slices]
    product = parts[0].product
    if any(p.product is not product for p in parts) or parts[0].lo != 0 or any(
            a.hi != b.lo for a, b in zip(parts, parts[1:])):
        return None
    linear = _c_linear(product.linear)
    return linear if linear is not None and linear.out_features == parts[-1].hi else None


@dataclass(frozen=True)
class _Pieces:
    """What the C call runs of one layer loop `_Layer`."""

    input_norm: tuple[torch.Tensor, float]  # weight, epsilon
    post_norm: tuple[torch.Tensor, float]
    qkv: PrepackedLinear | Bf16WeightLinear
    o: PrepackedLinear | Bf16WeightLinear
    gate_up: PrepackedLinear | Bf16WeightLinear
    down: PrepackedLinear | Bf16WeightLinear
    shape: tuple[int, int, int, int, int]  # _Shape's fields
    dtype: torch.dtype  # what the layer computes in: its norms' and products' dtype


def _pieces(layer) -> _Pieces | str:
    """The C pieces of a layer loop `_Layer`, or why it has none the call can run."""
    input_norm, post_norm = _norm(layer.input_norm), _norm(layer.post_norm)
    if input_norm is None or post_norm is None:
        return "a norm is not the C norm"
    qkv = _stacked((layer.q_proj, layer.k_proj, layer.v_proj))
    if qkv is None:
        return "q, k and v are not one stacked C product"
    if not hasattr(layer.rotary, "seqserve_original"):
        return "the rotary embedding is not the C loop's"
    o = (_c_linear(layer.o_proj.__self__) if isinstance(layer.o_proj, types.MethodType)
         else None)
    if o is None:
        return "an output projection is not a C product"
    if getattr(layer.mlp, "__func__", None) is not fused_layers._silu_mul:
        return "an MLP is not the C SiLU gate product"
    mlp = layer.mlp.__self__
    gate_up = (_stacked((mlp.gate_proj.forward, mlp.up_proj.forward))
               if isinstance(getattr(mlp, "gate_proj", None), fused_projections.ProductSlice)
               else None)
    down = _c_linear(mlp.down_proj)
    if gate_up is None or down is None:
        return "an MLP's products are not stacked C products"
    if layer.head_dim % 2:
        return "an odd head size"
    hidden, dim = input_norm[0].shape[0], layer.head_dim
    q_cols = layer.q_proj.__self__.hi
    kv_cols = layer.k_proj.__self__.hi - q_cols
    inter = gate_up.out_features // 2
    if (o.in_features != q_cols or o.out_features != hidden or down.in_features != inter
            or down.out_features != hidden
            or layer.v_proj.__self__.hi - layer.k_proj.__self__.hi != kv_cols
            or qkv.in_features != hidden or gate_up.in_features != hidden):
        return "a layer's products do not chain"
    dtype = input_norm[0].dtype
    linears = (qkv, o, gate_up, down)
    if (post_norm[0].dtype != dtype
            or {type(m) for m in linears} != {PrepackedLinear if dtype == torch.bfloat16
                                               else Bf16WeightLinear}
            or any(m.bias is not None and m.bias.dtype != dtype for m in linears)):
        return "a layer's norms and products do not compute in one dtype"
    return _Pieces(input_norm, post_norm, qkv, o, gate_up, down,
                   (hidden, q_cols // dim, kv_cols // dim, dim, inter), dtype)


def _libraries_load(dtype: torch.dtype) -> bool:
    """Whether every library the call over layers of `dtype` runs is built."""
    products = (dpbf16_linear.library() if dtype == torch.bfloat16
                else bf16_weights.library())
    return (library() is not None and products is not None
            and fused_layers.library() is not None
            and fused_layers.mlp_product_builds(dtype)
            and native_attention.kernel() is not None)


def _kernels(dtype: torch.dtype) -> _Kernels:
    """The kernels the call runs for layers of `dtype` (step_layers.c's struct kernels):
    those the per-layer calls run, so that the hidden states keep their bits."""
    norms, tiled = fused_layers.library(), native_attention.tiled_kernel()
    attention = native_attention.kernel()
    if dtype == torch.bfloat16:
        products = dpbf16_linear.library()
        return _Kernels(
            _pointer(norms.rms_norm_bf16), _pointer(products.linear_dpbf16),
            _pointer(norms.rotary_bf16), _pointer(norms.silu_mul_rows_bf16),
            _pointer(attention.decode_attention_bf16),
            _pointer(attention.prompt_attention_bf16),
            None if tiled is None else _pointer(tiled.prompt_attention_tiled_bf16),
            native_attention.TILED_MIN_TOKENS, fused_layers.silu_table().data_ptr(),
            _pointer(products.linear_silu_dpbf16), _pointer(products.linear_add_dpbf16))
    return _Kernels(
        _pointer(norms.rms_norm_f32), _pointer(bf16_weights.library().linear_bf16p),
        _pointer(norms.rotary_f32), _pointer(norms.silu_mul_rows_f32),
        _pointer(attention.decode_attention_f32), _pointer(attention.prompt_attention_f32),
        None if tiled is None else _pointer(tiled.prompt_attention_tiled_f32),
        native_attention.TILED_MIN_TOKENS, None, None, None)


class StepLayers:
    """The C call over a layer loop's layers; `build` says whether they can take it."""

    def __init__(self, layers: list[_Layer], shape: _Shape, keep: list, dtype: torch.dtype):
        self._kernels = _kernels(dtype)
        self._entry = getattr(library(), ENTRY[dtype])
        self.dtype = dtype
        self._layers = (_Layer * len(layers))(*layers)
        self._count = len(layers)
        self._shape = shape
        # Each scratch buffer's width per token (step_layers.c's struct scratch).
        heads, kv = shape.heads * shape.dim, shape.kv_heads * shape.dim
        self._scratch_widths = dict(
            normed=shape.hidden, qkv=heads + 2 * kv, q_rows=heads, attn=heads,
            product=shape.hidden, gate_up=2 * shape.inter, act=shape.inter)
        self._keep = keep  # the tensors whose addresses the structures hold
        self._windows: tuple | None = None
        # Non-zero asks a running call to stop before its next layer; `forward` then runs
        # `between` and goes on (the engine's urgent Steps, engine.py).
        self.pause = ctypes.c_int32(0)

    @classmethod
    def build(cls, loop_layers) -> "StepLayers | None":
        """For LayerLoop's `_Layer`s; None (and why, logged) where any layer has a piece
        the C call does not run, or a library is missing."""
        reason, pieces = None, []
        if not loop_layers:
            reason = "no layers"
        elif [layer.index for layer in loop_layers] != list(range(len(loop_layers))):
            reason = "layer indices are not 0, 1, ..."
        else:
            pieces = [_pieces(layer) for layer in loop_layers]
            reason = next((p for p in pieces if isinstance(p, str)), None)
            if reason is None and len({(p.shape, p.dtype) for p in pieces}) > 1:
                reason = "layers of several shapes or dtypes"
            elif reason is None and not _libraries_load(pieces[0].dtype):
                reason = "a library is missing"
        if reason is not None:
            logger.info("steps call each layer from Python: %s", reason)
            return None
        layers, keep = [], []
        for layer, p in zip(loop_layers, pieces):
            (w_in, eps_in), (w_post, eps_post) = p.input_norm, p.post_norm
            keep += [w_in, w_post, p.qkv, p.o, p.gate_up, p.down]
            layers.append(_Layer(
                _ptr(w_in), _ptr(w_post), eps_in, eps_post,
                _ptr(_packed(p.qkv)), _ptr(p.qkv.bias), _ptr(_packed(p.o)), _ptr(p.o.bias),
                _ptr(_packed(p.gate_up)), _ptr(p.gate_up.bias), _ptr(_packed(p.down)),
                _ptr(p.down.bias), float(layer.scaling), 0))
        return cls(layers, _Shape(*pieces[0].shape), keep, pieces[0].dtype)

    def takes(self, batch, hidden: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether this step can take the call: decoding rows and prompts (no candidate
        tree), in the layers' dtype, every layer's attention in the native loops, autograd
        off."""
        from worker_service.packed_batch import DecodeSegment, RowSegment

        if (hidden.dtype != self.dtype or hidden.device.type != "cpu"
                or cos.dtype != self.dtype or cos.shape != (1, hidden.shape[1],
                                                                self._shape.dim)
                or (torch.is_grad_enabled() and not torch.is_inference_mode_enabled())):
            return False
        if not batch.segments or not all(
                type(s) is DecodeSegment or (type(s) is RowSegment and not s.tree)
                for s in batch.segments):
            return False
        if batch.layers and not all(spec.native for spec in batch.layers):
            return False
        probe = hidden.new_empty(1, 1, 1, self._shape.dim)
        return all(native_attention.supports(probe, seg.group.keys[0], seg.group.values[0])
                   and seg.group.keys[0].shape[1] == self._shape.kv_heads
                   for seg in batch.segments)

    def forward(self, batch, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rows: list[int] | None = None,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        """hidden [1, tokens, hidden] (the embeddings; not changed) through every layer,
        each segment's new keys and values written to its group; returns the last layer's
        hidden states [1, tokens, hidden], or with `rows` (token indices, strictly
        ascending) those rows' [1, len(rows), hidden] only: the other tokens' last layer
        then stops after its keys and values. With `between`, a call that `pause` stops
        runs it before the remaining layers (which must not use this call's scratch; a
        nested forward allocates its own). Call only where `takes`."""
        from worker_service.packed_batch import DecodeSegment

        windows = tuple(spec.window or 0 for spec in batch.layers) if batch.layers else ()
        if windows != self._windows:
            for i in range(self._count):
                self._layers[i].window = windows[i] if windows else 0
            self._windows = windows
        sh = self._shape
        tokens = hidden.shape[1]
        out = hidden.reshape(tokens, sh.hidden).clone()
        c, s = cos[0].contiguous(), sin[0].contiguous()
        segs = batch.segments
        nseg = len(segs)
        k_ptrs = (ctypes.c_void_p * (self._count * nseg))()
        v_ptrs = (ctypes.c_void_p * (self._count * nseg))()
        c_segs = (_Segment * nseg)()
        for g, seg in enumerate(segs):
            keys, values = seg.group.keys, seg.group.values
            decoding = type(seg) is DecodeSegment
            row = seg.row_start if decoding else seg.row
            offset = row * keys[0].stride(0) * keys[0].element_size()
            for layer in range(self._count):
                k_ptrs[layer * nseg + g] = keys[layer].data_ptr() + offset
                v_ptrs[layer * nseg + g] = values[layer].data_ptr() + offset
            c_segs[g] = (_Segment(0, seg.token_start, seg.num_tokens, seg.kv_len, 0,
                                  keys[0].stride(0), keys[0].stride(1), seg.ends.data_ptr())
                         if decoding else
                         _Segment(1, seg.token_start, seg.num_tokens, 0, seg.start,
                                  keys[0].stride(0), keys[0].stride(1), None))
        buffers = {name: torch.empty(tokens, width, dtype=self.dtype)
                   for name, width in self._scratch_widths.items()}
        scratch = _Scratch(*(buffers[name].data_ptr() for name in _SCRATCH))
        keep = None
        if rows is not None:
            if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and not (
                    0 <= rows[0] and rows[-1] < tokens)):
                raise ValueError(f"rows must be strictly ascending token indices below "
                                 f"{tokens}, not {rows}")
            keep = (ctypes.c_int64 * len(rows))(*rows)
        pause = ctypes.byref(self.pause) if between is not None else None
        done, first = ctypes.c_int64(0), 0
        layer_size, ptr_size = ctypes.sizeof(_Layer), ctypes.sizeof(ctypes.c_void_p)
        while True:
            status = self._entry(
                ctypes.byref(self._kernels), ctypes.byref(sh),
                ctypes.byref(self._layers, first * layer_size), self._count - first,
                out.data_ptr(), tokens, c.data_ptr(), s.data_ptr(), c_segs, nseg,
                ctypes.byref(k_ptrs, first * nseg * ptr_size),
                ctypes.byref(v_ptrs, first * nseg * ptr_size),
                ctypes.byref(scratch), keep, 0 if rows is None else len(rows), pause,
                ctypes.byref(done))
            if status != 0:
                raise ValueError(f"the C step layers refused a step of {tokens} rows "
                                 f"(status {status}); set {SWITCH}=0 and report it")
            first += done.value
            if first >= self._count:
                break
            between()
        if rows is not None:
            return out[:len(rows)].view(1, len(rows), sh.hidden)
        return out.view(1, tokens, sh.hidden)
