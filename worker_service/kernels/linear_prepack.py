"""oneDNN-prepacked weights for the linear layers of a model on CPU (bfloat16 / float16).

`F.linear` in bfloat16 on CPU runs oneDNN, which first reorders the weight into its
blocked layout, on every call. With few rows (a decoding step) that reorder is a large
part of the call: prepacking once at load time made a [4, 768] x [768, 3072] product
about 1.8x faster and [30, 768] x [768, 3072] about 1.15x on this project's CPUs, with
results identical to F.linear. The packed weight replaces the original, so memory does
not grow. On CPUs with AVX512-BF16, bfloat16 weights are packed for the C product of
dpbf16_linear.py instead, which beats oneDNN at every row count there.

Whether oneDNN can run a dtype depends on the CPU: float16 needs AVX512-FP16 or
AVX-NE-CONVERT (Sapphire Rapids, Granite Rapids, recent client cores; an AMD EPYC with
AVX512-BF16 has neither), bfloat16 AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only EPYC,
Zen 3 and older, has neither), and on others the reorder raises. `runs` tries the packed
product once per dtype, on a 16 x 16 weight, before any layer is swapped; where it fails,
the model computes in float32 (worker_service/cpu_dtype.py).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from worker_service.kernels import dpbf16_linear

logger = logging.getLogger(__name__)

# The row count oneDNN is told to expect: decoding steps have few rows, and large
# prefills lose little with this layout.
BATCH_HINT = 1


class PrepackedLinear(nn.Module):
    """`linear` with its weight packed once at load: for the C product of dpbf16_linear.py
    where `c_product` is set and it takes the weight (bfloat16, an even input width, a CPU
    with AVX512-BF16), else in oneDNN's blocked layout. `min_rows` (oneDNN only): a product
    of fewer rows gets zero rows appended up to it (batch_invariance.py: oneDNN computes
    one row differently from two or more, and a row of a larger product independently of
    the others; the C product computes every row alike)."""

    def __init__(self, linear: nn.Linear, min_rows: int = 1, c_product: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = min_rows
        weight = linear.weight.detach()
        self.c_product = c_product and dpbf16_linear.takes(weight)
        self.register_buffer("packed_weight", dpbf16_linear.pack(weight) if self.c_product
                             else torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_product:
            return dpbf16_linear.linear(x, self.packed_weight, self.bias, self.out_features)
        rows = x.numel() // self.in_features
        if rows < self.min_rows:
            flat = x.reshape(rows, self.in_features)
            padded = torch.cat([flat, flat.new_zeros(self.min_rows - rows, self.in_features)])
            out = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias,
                                                     "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")


def log_prepacked(model: nn.Module, n: int, sharded: bool, qkv: int, gate_up: int) -> None:
    """Log what prepacking did: `n` linear layers, how many of them run the C product, and
    the layers whose q/k/v (`qkv`) and gate/up (`gate_up`) products were stacked."""
    in_c = sum(isinstance(m, PrepackedLinear) and m.c_product for m in model.modules())
    logger.info("prepacked the weights of %d linear layers%s: %d for the C bfloat16 "
                "product, the others for oneDNN%s", n,
                " (this rank's shards)" if sharded else "", in_c,
                f"; q, k and v stacked into one product in {qkv} layers, gate and "
                f"up in {gate_up}" if qkv or gate_up else "")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _try(dtype: torch.dtype) -> str | None:
    """None if a prepacked product in `dtype` runs on this CPU and equals F.linear; else
    why not."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "torch has no oneDNN linear prepacking"
    try:
        weight = (torch.arange(256, dtype=torch.float32).reshape(16, 16) / 64).to(dtype)
        x = torch.ones(2, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    if not torch.equal(out, torch.nn.functional.linear(x, weight)):
        return "oneDNN's packed product differs from F.linear"
    return None


def runs(dtype: torch.dtype) -> bool:
    """Whether prepacked linear layers run in `dtype` on this CPU (tried once)."""
    return _try(dtype) is None


def half_reason(dtype: torch.dtype) -> str:
    """Why `dtype` (float16 or bfloat16) has no fast path on this CPU, in words (flags and
    oneDNN's answer)."""
    flags = cpu_flags()
    have = sorted(f for f in ("avx512_fp16", "avx_ne_convert", "avx512_bf16", "avx512bw",
                              "amx_bf16", "amx_fp16") if f in flags)
    return (f"CPU flags {', '.join(have) or 'none of avx512_fp16/avx512_bf16/avx_ne_convert'}"
            f", torch capability {torch.backends.cpu.get_cpu_capability()}; oneDNN: "
            f"{_try(dtype) or 'runs'}")


def supported(model: nn.Module) -> bool:
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)
            and runs(p.dtype))


def prepack_linears(model: nn.Module, min_rows: int = 1, c_product: bool = False) -> int:
    """Swap every nn.Linear of `model` for a PrepackedLinear; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PrepackedLinear(child, min_rows, c_product))
    return len(swaps)
