"""Real instructions with known greedy response lengths, for measuring length predictors
that read the prompt's text or the model's hidden state (the traces hold lengths only).

The prompts are templates x topics, shuffled with a fixed seed: tasks that ask for a word,
a sentence, a list, an explanation or an essay, so the answers range from a few tokens to
past the 256-token cap. `generate` runs the model greedily on each prompt alone (chat
template) and keeps, per prompt, its token ids, the response length (tokens generated, an
ending EOS included; MAX_NEW_TOKENS when cut), whether it was cut, and the final hidden
state of the prompt's last position (post final norm, the vector the LM head reads: what
the worker's length probe sees). Cached under bench-results/, not in git.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS = 256
SEED = 19

TEMPLATES = (
    "Answer with a single word: what is {t} mostly associated with?",
    "In one short sentence, what is {t}?",
    "Is {t} older than the printing press? Answer yes or no.",
    "Give three keywords that describe {t}.",
    "Define {t} in at most ten words.",
    "List five facts about {t}, one per line.",
    "Explain {t} to a ten-year-old in a short paragraph.",
    "Write a haiku about {t}.",
    "What are the advantages and disadvantages of {t}? Explain each in detail.",
    "Write a detailed essay about the history and importance of {t}.",
    "Explain step by step how {t} works, with examples.",
    "Write a short story in which {t} plays a central role.",
    "Compare {t} with something similar and describe the differences thoroughly.",
    "Give a numbered list of ten questions a student might ask about {t}.",
)

TOPICS = (
    "photosynthesis", "the Roman Empire", "black holes", "machine learning", "the water cycle",
    "jazz music", "volcanoes", "the French Revolution", "bicycles", "vaccines", "chess",
    "the stock market", "honeybees", "the internet", "climate change",
)


def prompts() -> list[str]:
    """Every template x topic, in a fixed shuffled order (the arrival order)."""
    out = [tpl.format(t=topic) for tpl in TEMPLATES for topic in TOPICS]
    random.Random(SEED).shuffle(out)
    return out


@dataclass
class Generated:
    prompt_ids: list[int]
    length: int  # tokens generated, an ending EOS included (MAX_NEW_TOKENS when cut)
    cut: bool  # stopped by MAX_NEW_TOKENS, not by EOS
    hidden: list[float]  # final hidden state of the prompt's last position


def generate(model_dir: Path, cache: Path, batch: int = 42) -> list[Generated]:
    """The greedy responses of `model_dir` (float32) to `prompts()`, from `cache` when it
    was made from the same prompts and model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = prompts()
    key = {"model": str(model_dir), "prompts": texts, "max_new_tokens": MAX_NEW_TOKENS}
    if cache.exists():
        saved = torch.load(cache)
        if saved["key"] == key:
            return [Generated(**g) for g in saved["rows"]]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ids = [list(tok.apply_chat_template([{"role": "user", "content": t}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]) for t in texts]
    rows: list[Generated] = []
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            chunk = ids[start:start + batch]
            width = max(map(len, chunk))
            inp = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids=inp, attention_mask=mask, do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad)
            for p, row in zip(chunk, out[:, width:].tolist()):
                n = next((i + 1 for i, t in enumerate(row) if t in eos), None)
                # Each prompt alone, no padding: the hidden state the worker sees.
                h = model.model(input_ids=torch.tensor([p])).last_hidden_state[0, -1]
                rows.append(Generated(p, n or MAX_NEW_TOKENS, n is None, h.tolist()))
            logger.info("generated %d / %d", len(rows), len(ids))
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "rows": [r.__dict__ for r in rows]}, cache)
    return rows
