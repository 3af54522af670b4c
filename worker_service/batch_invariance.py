"""option.batch_invariant: a request's tokens do not depend on what else is in the batch.

A packed step computes each row's numbers from that row alone everywhere except where a
kernel picks its method by the shape of the whole product. Measured on this project's
CPU (AMD EPYC, AVX512-BF16; torch 2.13 with oneDNN), bfloat16:

- attention (kernels/native_attention.c), RMSNorm and rotary (fused_layers.c) loop over
  one row, or one (row, head) pair, in a fixed order: independent of the batch.
- the linear products: on CPUs with AVX512-BF16 they run the C loop of
  kernels/dpbf16_linear.c, which sums each output of each row in one fixed order whatever
  the row count. Elsewhere oneDNN's (prepacked weights) give every row the same bits
  whatever the row count M and the other rows, for every M from 2 to 4096 tried, but a
  product of one row (M = 1) takes another path: for a [1536] x [1536, 576] product 50 of
  600 rows differed from the same rows in a batch. A request decoding alone is exactly
  that M = 1.

So batch-invariant mode pads every oneDNN product of one row with a zero row
(linear_prepack's `min_rows`), at the price of computing two rows where one would do,
only when one row is all the step has. The worker checks at load that this holds on its CPU for its model
and refuses to start if any bit differs: `check` multiplies random rows alone and
together through every linear shape of the model, and computes a probe prompt's logits
alone and beside two other prompts, at its prefill and four decoding steps.

Not covered (the worker refuses the option): float32 models, whose products (MKL) were
not checked row by row; bfloat16 models on CPUs without native bfloat16, which compute in
float32 (their products, kernels/bf16_weights.c, sum in one fixed order, but their prompts'
attention is SDPA's); other devices; models on the fallback path.
"""

from __future__ import annotations

import torch

from worker_service.kernels import linear_prepack
from worker_service.kv_groups import KVGroup
from worker_service.packed_batch import PackedBatch

MIN_ROWS = 2  # oneDNN computes M >= 2 row by row alike (above)
OPTION = "option.batch_invariant"


def unsupported(runner) -> str | None:
    """Why batch-invariant mode cannot run `runner`'s model; None if it can."""
    if runner.device.type != "cpu":
        return f"it is implemented for CPU workers, not {runner.device.type}"
    if not linear_prepack.runs(torch.bfloat16):
        return ("oneDNN cannot prepack bfloat16 linear layers on this CPU (bfloat16 models "
                "compute in float32 here)")
    if runner.dtype != torch.bfloat16:
        return (f"it is implemented for bfloat16 models, not {runner.dtype} (set "
                "option.dtype=bf16)")
    if runner.fallback is not None:
        return "the model runs on the fallback path (its own attention)"
    if runner.kv_dtype != torch.bfloat16 or runner.kv_shape.reads_padding:
        return ("its attention must run in the native bfloat16 loops (bfloat16 KV, a C "
                "compiler, SEQSERVE_NATIVE_ATTENTION not 0)")
    return None


def _probe_ids(n: int, salt: int, vocab: int) -> list[int]:
    return [(i * 7919 + salt * 104729 + 11) % vocab for i in range(n)]


@torch.inference_mode()
def _logits(runner, prompts: list[list[int]], steps: int = 4) -> list[torch.Tensor]:
    """Prefill `prompts` together in one group, then decode `steps` tokens each together:
    the logits [rows, vocab] of the last prompt token and of each decoded token."""
    group = KVGroup(runner.kv_shape)
    batch = PackedBatch(runner.device, runner.layer_attention)
    ends = []
    for row, ids in enumerate(prompts):
        group.add_empty_row(row, len(ids) + steps)
        batch.add_row(group, row, ids, 0)
        ends.append(batch.num_tokens - 1)
    out = [runner.logits(runner.forward(batch)[ends])]
    for row, ids in enumerate(prompts):
        group.fill(row, len(ids))
    for step in range(steps):
        batch = PackedBatch(runner.device, runner.layer_attention)
        batch.add_decode(group, 0, len(prompts), [5 + step] * len(prompts))
        out.append(runner.logits(runner.forward(batch)))
        group.advance(0, len(prompts))
    return out


@torch.inference_mode()
def _linear_rows(model: torch.nn.Module, rows: int = 64) -> str | None:
    """Whether every linear shape of `model` gives each of `rows` random rows the same bits
    alone as in one product with the others; else the first shape where one differs. A
    differing row is rare and changes an element by its last bit, which the model's
    rounding often hides (so the forward probe alone would seldom see it)."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for module in model.modules():
        if not isinstance(module, linear_prepack.PrepackedLinear):
            continue
        shape = (module.in_features, module.out_features)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(rows, shape[0], generator=gen).to(module.packed_weight.dtype)
        together = module(x)
        for i in range(rows):
            if not torch.equal(module(x[i : i + 1])[0], together[i]):
                return (f"a [{shape[0]} -> {shape[1]}] linear product gives a row other bits "
                        f"alone than beside {rows - 1} others")
    if not seen:
        return "its linear layers are not prepacked nn.Linear modules"
    return None


def check(runner) -> str | None:
    """None if every linear layer computes a row alone as beside others, and a probe
    prompt's logits are the same bits alone and beside two other prompts (at its prefill
    and at four decoding steps); else what differed."""
    reason = _linear_rows(runner.model)
    if reason is not None:
        return reason
    vocab = runner.facts.vocab_size
    probe, left, right = (_probe_ids(n, salt, vocab) for n, salt in ((21, 0), (9, 1), (33, 2)))
    alone = _logits(runner, [probe])
    beside = _logits(runner, [left, probe, right])  # the probe is row 1 here
    for step, (a, b) in enumerate(zip(alone, beside)):
        if not torch.equal(a[0], b[1]):
            what = "its prefill" if step == 0 else f"decoding step {step}"
            diff = float((a[0] - b[1]).abs().max())
            return (f"at {what}, a probe prompt's logits alone and beside two others differ "
                    f"(by up to {diff:.3g}) on this CPU and model")
    return None
