"""Attention over bfloat16 KV on CPU with a small C library (`native_attention.c`), and
decoding over float32 KV (a model computing in float32).

torch's CPU kernels read bfloat16 keys one query row at a time far below memory speed:
a decoding step over 30 rows of 300 slots (12 heads of 64) took 6.1 ms through SDPA in
bfloat16 and 2.7 ms with the KV in float32. The C loops read each row's keys and values
once, only up to the row's length (no padding), and keep scores and sums in float32:

- `attend` (decoding: one query per row of a group): 0.13 ms for 30 rows of 0-300 slots.
- `attend_prompt` (a prompt, causal over its row's slots, after any cached prefix): 2.0
  ms for 512 tokens against 4.8 ms through SDPA in bfloat16. Where it is built, every
  prompt piece takes the tiled loop of `prompt_attention.c` instead (tiles of queries as
  two small bfloat16 GEMMs): on one core 2.2-2.4x the one-query loop at 500-2000 tokens (9
  heads over 3 of 64), where the one-query loop made half of a 2000-token prefill; below
  32 tokens the two are as fast. The two round the probabilities differently, so a prompt
  must not switch loops with the length of a piece: a prefix-cache hit or a chunk leaving
  a short tail would then compute other bits than the whole prompt (on SmolLM2 in bfloat16
  that changed greedy tokens of a repeated 120-token prompt).

In float32 (a float32 model, or a bfloat16 one computing in float32 on a CPU without
native bfloat16, cpu_dtype.py) decoding takes the same loop with AVX2 over float32 keys,
8 slots at a time: on an AVX2 EPYC SmolLM2's 64-row step took 300 ms with it against 360
ms with two batched products over the padded buffers. Prompts take prompt_attention.c's
float32 tiles (two small GEMMs of fused multiply-adds a tile): 2.3-2.7x SDPA's float32
kernel at 32-512 tokens and 1.5x at 2000 on that CPU (9 heads over 3 of 64, two threads),
with the same bits for a query whatever the piece of its prompt.

Where the CPU has AVX512-BF16 (and the head size is a multiple of 32) the query-key
products use its bfloat16 dot instruction, 16 slots at a time: the 64-request benchmark
burst replayed in process takes 4.0-4.2 s with it, 4.5-4.7 s with the portable C loop for
decoding and SDPA for prompts (figures in docs/benchmarks.md). There, with grouped-query
attention, decoding takes the query heads that share a KV head together: their
probabilities one head at a time, then one pass over the values for up to 4 heads, each
value slot widened once for all of them. The attention alone runs 1.2-1.4x faster at
16-64 rows (SmolLM2's 9 heads over 3, 16 over 4, 32 over 8 at dim 128), whole decoding
steps of 16-64 rows 3-6% faster on SmolLM2 and qwen2-gqa (docs/benchmarks.md). Where the
CPU has AMX (and heads are at most 128 wide) the heads' scores come from the tile unit
instead, all of a KV head's query heads from one read of each key, and each unit fetches
the next one's keys and values into L2 while it works: 64 rows of about 800 slots over
SmolLM2's 30 layers ran 16.2-16.9 GB/s before and 19.0-19.6 after, the streaming reads of
this 2-core guest 25 GB/s. `SEQSERVE_AMX=0` keeps the dot-instruction loop.

The C file is compiled when the worker starts (`cc -O3 -march=native`, about 0.3 s) into a
temporary directory and loaded with ctypes: no torch headers, no build step at install.
With OpenMP it splits the (row or query, head) pairs over torch's own threads. Where no C
compiler is found, or the build fails, `kernel()` is None and the worker keeps
half-precision KV in float32 instead (model_runner.resolve_kv_dtype).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from worker_service.kernels import native_build

SOURCE = Path(__file__).with_name("native_attention.c")
TILED_SOURCE = Path(__file__).with_name("prompt_attention.c")
MAX_DIM = 512  # the C loops' largest head size (MAX_DIM there)
TILED_MIN_TOKENS = 1  # every piece: one rounding whatever a chunk's length (see above)
_P, _I, _F = native_build.P, native_build.I64, native_build.F32
FUNCTIONS = {
    "decode_attention_bf16": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _I,
                               _P, _P, _I, _I], ctypes.c_int),
    "decode_attention_f32": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _I,
                              _P, _P, _I, _I], ctypes.c_int),
    "prompt_attention_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I], ctypes.c_int),
    "prompt_attention_f32": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I], ctypes.c_int),
    "amx_enable": ([], ctypes.c_int),
}
# The decoding loop for each query/KV dtype.
DECODE = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}
TILED_FUNCTIONS = {
    "prompt_attention_tiled_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I],
                                    ctypes.c_int),
    "prompt_attention_tiled_f32": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I],
                                   ctypes.c_int),
    "amx_enable": ([], ctypes.c_int),
}
# The prompt loops for each query/KV dtype: the tiled one (prompt_attention.c), and the
# one-query one (here) for the shapes the tiled one does not take.
PROMPT = {torch.bfloat16: ("prompt_attention_tiled_bf16", "prompt_attention_bf16"),
          torch.float32: ("prompt_attention_tiled_f32", "prompt_attention_f32")}


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The C library, built on first use; None where it cannot be built."""
    lib = native_build.build(SOURCE, "SEQSERVE_NATIVE_ATTENTION",
                             "half-precision KV is kept in float32 on CPU", FUNCTIONS)
    if lib is not None and os.environ.get("SEQSERVE_AMX", "1") != "0":
        lib.amx_enable()  # decoding scores on AMX where the CPU has them
    return lib


@functools.cache
def tiled_kernel() -> ctypes.CDLL | None:
    """The tiled prompt loop (prompt_attention.c), built on first use; None where it
    cannot be built (prompts then take the one-query loop of `kernel()`)."""
    lib = native_build.build(TILED_SOURCE, "SEQSERVE_TILED_PROMPT_ATTENTION",
                             "prompts take the one-query loop", TILED_FUNCTIONS)
    if lib is not None and os.environ.get("SEQSERVE_AMX", "1") != "0":
        lib.amx_enable()  # the tiles' products on AMX where the CPU has them
    return lib


def supports(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether this query and these KV buffers can take the native loops (decoding and prompts):
    bfloat16, or float32 (a model computing in float32), query and KV of one dtype."""
    return (query.device.type == "cpu" and query.dtype in DECODE
            and keys.dtype == query.dtype
            and query.shape[-1] == keys.shape[-1] <= MAX_DIM
            and keys.is_contiguous()
            and values.shape == keys.shape and values.is_contiguous()
            and kernel() is not None)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_start: int,
           ends: torch.Tensor, max_end: int, scale: float, window: int | None,
           new_keys: torch.Tensor | None = None,
           new_values: torch.Tensor | None = None) -> torch.Tensor:
    """query [rows, heads, dim] (bfloat16 or float32, the KV's dtype); keys/values the
    group's whole buffers [row_capacity, kv_heads, slots, dim]; row i of the query is
    buffer row row_start + i and attends to its slots below ends[i] (int64, at most
    max_end), the last `window` of them when set. With new_keys/new_values ([rows,
    kv_heads, dim], any row and head strides), row i's are first written to its slot
    ends[i] - 1: the step's KV write in the same call. Returns [rows, heads, dim] in the
    query's dtype."""
    query, out, pointers = _operands(query, keys, values, row_start)
    rows, heads, dim = query.shape
    new = (None, None, 0, 0)
    if new_keys is not None:
        new_keys, new_values = new_keys.to(keys.dtype), new_values.to(keys.dtype)
        if new_keys.stride(-1) != 1 or new_keys.stride() != new_values.stride():
            new_keys, new_values = new_keys.contiguous(), new_values.contiguous()
        new = (new_keys.data_ptr(), new_values.data_ptr(), new_keys.stride(0),
               new_keys.stride(1))
    status = getattr(kernel(), DECODE[query.dtype])(
        *pointers, ends.data_ptr(), rows, heads, keys.shape[1], dim, keys.stride(0),
        keys.stride(1), scale, window or 0, max_end, *new)
    _check(status, "decode", query, keys)
    return out


def attend_prompt(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: int,
                  start: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of a prompt's queries [tokens, heads, dim] (bfloat16 or float32,
    the KV's dtype) at slots start, start + 1, ... of buffer row `row`, whose keys and
    values up to the last of them are already written. Returns [tokens, heads, dim] in the
    query's dtype."""
    query, out, pointers = _operands(query, keys, values, row)
    tokens, heads, dim = query.shape
    tiled, one_query = PROMPT[query.dtype]
    if tokens >= TILED_MIN_TOKENS and tiled_kernel() is not None:
        status = getattr(tiled_kernel(), tiled)(
            *pointers, start, tokens, heads, keys.shape[1], dim, keys.stride(1), scale,
            window or 0)
        if status != -1:  # -1: a shape (or a build) it does not take
            _check(status, "tiled prompt", query, keys)
            return out
    status = getattr(kernel(), one_query)(
        *pointers, start, tokens, heads, keys.shape[1], dim, keys.stride(1), scale, window or 0)
    _check(status, "prompt", query, keys)
    return out


def _operands(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: int):
    """The contiguous query, its output, and the C call's four pointers (query, the keys
    and values from buffer row `row` on, output)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    offset = row * keys.stride(0) * keys.element_size()
    return query, out, (query.data_ptr(), keys.data_ptr() + offset,
                        values.data_ptr() + offset, out.data_ptr())


def _check(status: int, what: str, query: torch.Tensor, keys: torch.Tensor) -> None:
    if status != 0:
        reason = "out of memory" if status == -2 else "a shape it does not take"
        raise ValueError(f"native {what} attention refused heads={query.shape[1]} kv_heads="
                         f"{keys.shape[1]} dim={query.shape[2]}: {reason} (status {status})")
