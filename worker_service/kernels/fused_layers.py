"""One-pass RMSNorm and rotary embedding for Llama-family models in bfloat16 or float32 on
CPU, and the SiLU gate product in bfloat16 (torch's bits) and float32 (its own).

Eager transformers runs an RMSNorm as seven torch kernels and a rotary embedding as nine,
each a pass over memory with a dispatch in front; a decoding step of the benchmark model
runs 17 norms and 8 rotary embeddings. `fused_layers.c` does each in one pass, rounding to
bfloat16 where the eager code does: the rotary embedding gives the same bits, the norm the
same up to the order of one float32 sum of squares (a last-bit difference in under 0.1% of
the values). In float32 (float32 models, and bfloat16 ones computing in float32 on CPUs
without native bfloat16) the same holds with float32's roundings.

Only code known to compute exactly this is replaced: a norm whose `forward` compiles to the
same bytecode as `LlamaRMSNorm.forward` (Mistral's, Qwen2's and the other copies), and a
module-level `apply_rotary_pos_emb` (with its `rotate_half`) identical to Llama's. Anything
else, and any call with other dtypes, devices or shapes, runs the model's own code.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import sys
import types
from pathlib import Path

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama as reference

from worker_service.kernels import native_build

SOURCE = Path(__file__).with_name("fused_layers.c")
_P, _I, _F = native_build.P, native_build.I64, native_build.F32
FUNCTIONS = {
    "rms_norm_bf16": ([_P, _P, _P, _I, _I, _I, _I, _F], None),
    "rotary_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I], None),
    "rms_norm_f32": ([_P, _P, _P, _I, _I, _I, _I, _F], None),
    "rotary_f32": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I], None),
    "silu_mul_bf16": ([_P, _P, _P, _P, _I], None),
    "silu_mul_rows_bf16": ([_P, _P, _P, _I, _I, _I], None),
    "silu_mul_f32": ([_P, _P, _P, _I], None),
    "silu_mul_rows_f32": ([_P, _P, _P, _I, _I, _I], None),
    "silu_f32_vectorized": ([], ctypes.c_int),
}
@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library, built on first use; None where it cannot be built."""
    return native_build.build(SOURCE, "SEQSERVE_FUSED_LAYERS",
                               "norms and rotary embeddings run eagerly",
                               FUNCTIONS)


def same_code(fn, ref) -> bool:
    """Whether `fn` compiles to the same bytecode as `ref` (docstrings aside)."""
    a = getattr(inspect.unwrap(fn), "__code__", None)
    b = getattr(inspect.unwrap(ref), "__code__", None)
    if a is None or b is None:
        return False
    consts = lambda c: tuple(x for x in c.co_consts if not isinstance(x, str))  # noqa: E731
    return (a.co_code == b.co_code and a.co_names == b.co_names
            and consts(a) == consts(b))


# The norm and rotary loops for each dtype.
NORM = {torch.bfloat16: "rms_norm_bf16", torch.float32: "rms_norm_f32"}
ROTARY = {torch.bfloat16: "rotary_bf16", torch.float32: "rotary_f32"}


def _fast(*tensors: torch.Tensor, dtypes=(torch.bfloat16,)) -> bool:
    """CPU tensors of one of `dtypes`, all the same, nothing for autograd to record, and
    the library loaded."""
    return ((not torch.is_grad_enabled() or torch.is_inference_mode_enabled())
            and tensors[0].dtype in dtypes
            and all(t.dtype == tensors[0].dtype and t.device.type == "cpu" for t in tensors)
            and library() is not None)


def _rms_norm(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    n = weight.shape[0]
    if (not _fast(hidden, weight, dtypes=NORM) or hidden.shape[-1] != n
            or not weight.is_contiguous()):
        return type(self).forward(self, hidden)
    x = hidden.reshape(-1, n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    getattr(library(), NORM[x.dtype])(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                      x.shape[0], n, x.stride(0), n,
                                      float(self.variance_epsilon))
    return out.view(hidden.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _, heads, tokens, dim = x.shape
    y = torch.empty(1, heads, tokens, dim, dtype=x.dtype)
    getattr(library(), ROTARY[x.dtype])(x.data_ptr(), y.data_ptr(), cos.data_ptr(),
                                        sin.data_ptr(), heads, tokens, dim, x.stride(1),
                                        x.stride(2), tokens * dim, dim)
    return y


def _fused_rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and _fast(q, k, cos, sin, dtypes=ROTARY)
                and q.dim() == 4 and k.dim() == 4
                and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[0] == 1
                and q.shape[0] == 1 and k.shape[0] == 1
                and q.shape[2] == k.shape[2] == cos.shape[1]
                and q.shape[3] == k.shape[3] == cos.shape[2] and cos.shape[2] % 2 == 0
                and q.stride(-1) == 1 and k.stride(-1) == 1):
            c, s = cos[0].contiguous(), sin[0].contiguous()
            return _rotate(q, c, s), _rotate(k, c, s)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.seqserve_original = original
    return apply_rotary_pos_emb


@functools.cache
def silu_table() -> torch.Tensor | None:
    """torch's SiLU of every bfloat16 value, widened to float32 and indexed by its bits;
    None if torch's vectorized and element-at-a-time loops disagree on any value but NaN
    (a strided input takes the second), as then no one table has the bits of every call.
    (A NaN stays NaN; its payload bits differ between torch's own loops.)"""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    with torch.inference_mode():
        whole = torch.nn.functional.silu(x)
        strided = torch.nn.functional.silu(torch.stack([x, x], 1)[:, 0])
    if not torch.equal(whole.isnan(), strided.isnan()) or not torch.equal(
            whole.nan_to_num(0.0).view(torch.int16), strided.nan_to_num(0.0).view(torch.int16)):
        return None
    table = torch.empty(65536, dtype=torch.float32)
    table[bits.to(torch.int64) & 0xFFFF] = whole.float()
    return table


def mlp_product_builds(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether install_mlp's C SiLU gate product runs in `dtype` here: bfloat16 through torch's own
    activations (silu_table), float32 with AVX2 and FMA (its own exponential)."""
    if library() is None:
        return False
    if dtype == torch.bfloat16:
        return silu_table() is not None
    return dtype == torch.float32 and bool(library().silu_f32_vectorized())


def _silu_mul(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    product = getattr(self.gate_proj, "product", None)  # fused_projections.fuse_gate_up's
    if product is not None and getattr(self.up_proj, "product", None) is product:
        gate_up = product.linear(x)
        cols = self.gate_proj.out_features
        if (_fast(gate_up, dtypes=(torch.bfloat16, torch.float32)) and gate_up.stride(-1) == 1
                and gate_up.shape[-1] == 2 * cols and mlp_product_builds(gate_up.dtype)):
            flat = gate_up.reshape(-1, 2 * cols)
            out = torch.empty(flat.shape[0], cols, dtype=flat.dtype)
            if flat.dtype == torch.bfloat16:
                library().silu_mul_rows_bf16(flat.data_ptr(), out.data_ptr(),
                                             silu_table().data_ptr(), flat.shape[0], cols,
                                             flat.stride(0))
            else:
                library().silu_mul_rows_f32(flat.data_ptr(), out.data_ptr(), None,
                                            flat.shape[0], cols, flat.stride(0))
            return self.down_proj(out.view(*x.shape[:-1], cols))
        gate, up = gate_up[..., :cols], gate_up[..., cols:]
        return self.down_proj(self.act_fn(gate) * up)
    gate, up = self.gate_proj(x), self.up_proj(x)
    table = silu_table()
    if (table is None or not _fast(gate, up) or gate.shape != up.shape
            or not gate.is_contiguous() or not up.is_contiguous()):
        return self.down_proj(self.act_fn(gate) * up)
    # The product overwrites the gate, which nothing else holds.
    library().silu_mul_bf16(gate.data_ptr(), up.data_ptr(), gate.data_ptr(),
                            table.data_ptr(), gate.numel())
    return self.down_proj(gate)


def install_mlp(model: nn.Module) -> int:
    """Route `model`'s Llama-style gated MLPs with a SiLU (`down(silu(gate(x)) * up(x))`,
    Qwen2's and Mistral's included) through the one-pass C product where it runs on CPU:
    in bfloat16, and in float32 where gate and up are one stacked product (a bfloat16
    model computing in float32 over bfloat16 weights, bf16_weights.py; a float32 model
    keeps torch's SiLU). Returns how many."""
    p = next(model.parameters())
    if p.device.type != "cpu" or not mlp_product_builds(p.dtype):
        return 0
    mlps = 0
    for module in model.modules():
        if gated_silu_mlp(module) and (p.dtype == torch.bfloat16 or getattr(
                getattr(module, "gate_proj", None), "product", None) is not None):
            module.forward = types.MethodType(_silu_mul, module)
            mlps += 1
    return mlps


def gated_silu_mlp(module: nn.Module) -> bool:
    """Whether `module` computes `down(silu(gate(x)) * up(x))` with Llama's code."""
    return (same_code(type(module).forward, reference.LlamaMLP.forward)
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, nn.SiLU))


def install(model: nn.Module) -> tuple[int, int]:
    """Route `model`'s Llama-style norms and rotary embeddings through the C loops where it
    runs in bfloat16 or float32 on CPU; returns (norms patched, modeling modules whose
    rotary embedding now runs the C loop)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype not in NORM or library() is None:
        return 0, 0
    norms = 0
    for module in model.modules():
        if same_code(type(module).forward, reference.LlamaRMSNorm.forward):
            module.forward = types.MethodType(_rms_norm, module)
            norms += 1
    modeling = {sys.modules[type(m).__module__] for m in model.modules()}
    patched = 0
    for mod in modeling:
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or hasattr(fn, "seqserve_original"):
            patched += fn is not None
            continue
        # Llama's own, unwrapped: once a Llama model was installed, the module's name
        # holds our wrapper, whose code no other family's function shares.
        llama = getattr(reference.apply_rotary_pos_emb, "seqserve_original",
                        reference.apply_rotary_pos_emb)
        if (same_code(fn, llama)
                and same_code(getattr(mod, "rotate_half", None), reference.rotate_half)):
            # Module-wide, as the model's attention looks the function up there; other
            # models of this family in the process fall through to the original.
            mod.apply_rotary_pos_emb = _fused_rotary(fn)
            patched += 1
    return norms, patched
