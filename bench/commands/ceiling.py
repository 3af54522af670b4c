"""`python -m bench ceiling`: the forward-pass ceiling alone, at given shapes (how it is
measured: bench/ceiling.py)."""

from __future__ import annotations

from pathlib import Path

from bench.ceiling import forward_ceiling
from bench.commands.common import command_line, ensure_model
from bench.env import environment
from bench.report import ceiling_markdown, write


def run(args) -> dict:
    model_dir = ensure_model(Path(args.model))
    out = forward_ceiling(model_dir, batch=args.batch, context=args.context,
                          prompt_len=args.prompt_len, prefill_batch=args.prefill_batch,
                          device=args.device, threads=args.hf_threads, repeats=args.repeats)
    out["model"], out["env"], out["command"] = str(model_dir), environment(), command_line()
    md = ceiling_markdown(out)
    write(Path(args.out), "ceiling", out, md)
    print(md, flush=True)
    return out
