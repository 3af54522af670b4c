"""Small random-weight Hugging Face models for tests, benchmarks and the default `make run`.

No model hub is reachable from our machines, so the project writes its own models:
a transformers config of a real architecture, random weights drawn from a seed, and a
byte-level BPE tokenizer trained locally with the `tokenizers` library. Everything is
saved with `save_pretrained` and used only through the normal `from_pretrained` path,
the same path a real `model_id` takes.

    python -m worker_service.fixtures make-model --arch llama --out models/tiny-llama
    python -m worker_service.fixtures make-model --arch llama --size mid --dtype bfloat16 --out models/mid-llama
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "gpt2", "qwen2", "mistral", "gpt_neox", "opt", "mixtral", "qwen3",
                 "gemma2", "gemma3", "phi", "phi3", "gptj", "falcon", "bloom", "stablelm",
                 "starcoder2", "llama4")
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
FIXTURE_VERSION = 1  # bump when the generated files change, so cached copies are rebuilt


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    # Larger than HF's default 0.02 so that logits are peaked: near-ties between the top
    # two tokens would make greedy comparisons depend on float rounding.
    init_std: float
    # The "odd" size's sliding window (architectures that have one), smaller than test prompts
    # so that it matters; None: no window.
    sliding_window: int | None = None


SIZES = {
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000,
                      max_positions=1024, init_std=0.1),
    # About 80 M parameters: the benchmark model (docs/benchmarks.md; Llama, 768 x 8 layers).
    "mid": ModelSize(hidden=768, layers=8, heads=12, kv_heads=12, intermediate=3072, vocab=4000,
                     max_positions=2048, init_std=0.02),
    # A grouped-query shape beside the mid one (docs/benchmarks.md's matrix): Qwen2-style,
    # 16 query heads over 4 key/value heads of 64, about 190 M parameters.
    "gqa": ModelSize(hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816,
                     vocab=4000, max_positions=2048, init_std=0.02),
    # The architecture sweep (tests/test_architectures.py): sizes no kernel is tuned for
    # (head size 12), grouped heads (6 query heads over 2 key/value heads; multi-query where
    # an architecture has it) and a short sliding window.
    # The batch-invariance test (tests/test_batch_invariant.py): a tiny model whose MLP down
    # projection sums 2048 inputs, past the 1024 where oneDNN's one-row bfloat16 product
    # starts to round differently from its batched one (worker_service/batch_invariance.py).
    "wide": ModelSize(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=2048, vocab=1000,
                      max_positions=1024, init_std=0.1),
    "odd": ModelSize(hidden=72, layers=3, heads=6, kv_heads=2, intermediate=120, vocab=1000,
                     max_positions=1024, init_std=0.1, sliding_window=8),
}

_WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or have not but "
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "once upon there lived king queen dragon castle forest river mountain village light dark "
    "serve model token batch split sparse cache prompt worker scheduler request stream "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2024 . , ; : ! ? ' \" ( ) - def return import class if else"
).split()
_MULTIBYTE = (
    "héllo wörld café naïve über façade", "你好，世界。今天天气很好。", "こんにちは世界、ありがとう",
    "Привет мир", "🙂🚀🎉 emoji ✨", "€ £ ¥ ≈ ≠ ∑ ∞ →", "안녕하세요 세계",
)


def training_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic text with ASCII words and multi-byte characters for BPE training."""
    rng = random.Random(seed)
    corpus = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 20))]
        if i % 5 == 0:
            words.insert(rng.randint(0, len(words)), rng.choice(_MULTIBYTE))
        corpus.append(" ".join(words))
    return corpus


def train_tokenizer(vocab_size: int, seed: int):
    """A GPT-2 style byte-level BPE tokenizer, trained here, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
    )


def make_config(arch: str, size: ModelSize, eos_id: int, pad_id: int):
    """A transformers config of the given architecture and size."""
    import transformers as tf

    common = dict(vocab_size=size.vocab, bos_token_id=eos_id, eos_token_id=eos_id,
                  pad_token_id=pad_id, tie_word_embeddings=False)
    window = size.sliding_window
    head_dim = size.hidden // size.heads
    llama_like = dict(hidden_size=size.hidden, intermediate_size=size.intermediate,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads,
                      max_position_embeddings=size.max_positions,
                      initializer_range=size.init_std, **common)
    if arch in ("llama", "qwen2", "mistral"):
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
        extra = {}
        if arch == "mistral":
            extra = {"sliding_window": 2 * window if window else None}  # uniform window
        elif arch == "qwen2" and window:
            # Full attention in layer 0, a sliding window above (max_window_layers).
            extra = {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}
        return cls(**llama_like, **extra)
    if arch == "mixtral":
        return tf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None)
    if arch == "llama4":
        # Llama 4's text model: chunked attention in three of four layers, experts.
        return tf.Llama4TextConfig(**llama_like, head_dim=head_dim,
                                   intermediate_size_mlp=size.intermediate,
                                   attention_chunk_size=window or 8192, num_local_experts=2)
    if arch == "qwen3":
        return tf.Qwen3Config(**llama_like, head_dim=head_dim)
    if arch in ("gemma2", "gemma3"):
        # Sliding and full layers alternate; softcapped attention logits (Gemma 2) small
        # enough to change the scores of these random weights.
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(size.layers)]
        extra = dict(head_dim=head_dim, query_pre_attn_scalar=head_dim,
                     sliding_window=window or 4096, layer_types=layer_types,
                     num_key_value_heads=1 if arch == "gemma3" else size.kv_heads)
        if arch == "gemma2":
            return tf.Gemma2Config(**{**llama_like, **extra}, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=30.0)
        return tf.Gemma3TextConfig(**{**llama_like, **extra})
    if arch == "phi":
        return tf.PhiConfig(**llama_like, partial_rotary_factor=0.5)
    if arch == "phi3":
        return tf.Phi3Config(**llama_like, sliding_window=3 * window if window else None)
    if arch == "stablelm":
        return tf.StableLmConfig(**llama_like, partial_rotary_factor=0.5, use_qkv_bias=True)
    if arch == "starcoder2":
        # Multi-query: one key/value head.
        return tf.Starcoder2Config(**{**llama_like, "num_key_value_heads": 1},
                                   sliding_window=window and 2 * window)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
                             n_inner=size.intermediate, n_positions=size.max_positions,
                             initializer_range=size.init_std, **common)
    if arch == "gptj":
        return tf.GPTJConfig(n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
                             n_inner=size.intermediate, n_positions=size.max_positions,
                             rotary_dim=head_dim // 2, initializer_range=size.init_std,
                             **common)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=size.hidden, intermediate_size=size.intermediate,
                                num_hidden_layers=size.layers, num_attention_heads=size.heads,
                                max_position_embeddings=size.max_positions,
                                initializer_range=size.init_std, **common)
    if arch == "falcon":
        # Falcon-7B's layout: rotary positions, parallel attention, multi-query.
        return tf.FalconConfig(hidden_size=size.hidden, num_hidden_layers=size.layers,
                               num_attention_heads=size.heads, multi_query=True,
                               new_decoder_architecture=False, parallel_attn=True, alibi=False,
                               max_position_embeddings=size.max_positions,
                               initializer_range=size.init_std, **common)
    if arch == "bloom":
        return tf.BloomConfig(hidden_size=size.hidden, n_layer=size.layers, n_head=size.heads,
                              initializer_range=size.init_std, **common)
    if arch == "opt":
        return tf.OPTConfig(hidden_size=size.hidden, ffn_dim=size.intermediate,
                            num_hidden_layers=size.layers, num_attention_heads=size.heads,
                            max_position_embeddings=size.max_positions,
                            word_embed_proj_dim=size.hidden, init_std=size.init_std, **common)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


def make_model(out: str | Path, arch: str = "llama", size: str = "tiny", dtype: str = "float32",
               seed: int = 0) -> Path:
    """Write a random-weight model and its tokenizer to `out`; reuse it if already there."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    stamp = {"fixture_version": FIXTURE_VERSION, "arch": arch, "size": size, "dtype": dtype,
             "seed": seed}
    stamp_file = out / "seqserve_fixture.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    spec = SIZES[size]
    tokenizer = train_tokenizer(spec.vocab, seed)
    eos_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    pad_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[1])
    config = make_config(arch, spec, eos_id, pad_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    # Written beside `out` and renamed into place, so that processes making the same
    # fixture at once (pytest-xdist workers) never read a half-written one.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / stamp_file.name).write_text(json.dumps(stamp))
    if out.exists():  # an older fixture version, or one another process just wrote
        if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
            shutil.rmtree(staging, ignore_errors=True)
            return out
        shutil.rmtree(out, ignore_errors=True)
    try:
        staging.rename(out)
    except OSError:  # another process renamed its copy into place first
        shutil.rmtree(staging, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s %s model (%.1f M parameters, %s) to %s", size, arch, n_params / 1e6,
                dtype, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_service.fixtures",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-model", help="write a random-weight model and tokenizer")
    mk.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    mk.add_argument("--size", choices=sorted(SIZES), default="tiny")
    mk.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--out", required=True, help="directory to write (created)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_model(args.out, arch=args.arch, size=args.size, dtype=args.dtype, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
