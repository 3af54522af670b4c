"""Reference outputs computed with plain Hugging Face transformers, one request at a time."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WORDS = ("the king once upon a time dragon castle river model token batch split cache "
         "héllo wörld café 你好 世界 こんにちは Привет 🙂 🚀 € ≠ 42 2024 . , !").split()


@lru_cache(maxsize=None)
def load(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def prompt_of_tokens(tok, n_tokens: int, rng: random.Random) -> str:
    """Random text whose tokenization has exactly `n_tokens` tokens (n >= 1): the fewest
    words drawn from `rng` that reach n tokens, then characters trimmed from the end.

    The word count is found by doubling and bisection over a copy of `rng`, not by
    tokenizing each longer text in turn (quadratic: seconds for a few long prompts); `rng`
    then advances by exactly the words used, as a draw of one word at a time would."""
    ahead = random.Random()
    ahead.setstate(rng.getstate())
    words: list[str] = []

    def count(k: int) -> int:
        while len(words) < k:
            words.append(ahead.choice(WORDS))
        return len(tok(" ".join(words[:k])).input_ids)

    high = 1
    while count(high) < n_tokens:
        high *= 2
    low = high // 2  # count(low) < n_tokens, or low == 0
    while high - low > 1:
        mid = (low + high) // 2
        if count(mid) >= n_tokens:
            high = mid
        else:
            low = mid
    for _ in range(high):
        rng.choice(WORDS)
    text = " ".join(words[:high])
    # Trim characters from the end until the count matches (counts move by ~1 per char).
    while len(tok(text).input_ids) > n_tokens and len(text) > 1:
        text = text[:-1]
    return text


def same_until_eos(got: list[int], expected: list[int], eos_id: int) -> bool:
    """`got` ran on past EOS (ignore_eos); `expected` is generate's output, which stops at EOS.

    generate's min_new_tokens would instead forbid EOS and so change the tokens, hence
    the comparison of the common part.
    """
    if len(expected) < len(got):
        return expected[-1:] == [eos_id] and got[: len(expected)] == expected
    return got == expected


@torch.inference_mode()
def greedy(model_dir: str | Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Token ids `model.generate(do_sample=False)` produces for this prompt alone."""
    tok, model = load(str(model_dir))
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()
