"""Request validation: from what a client sent to typed, range-checked decoding parameters.

The same rules serve the gRPC API and the HTTP /invocations route, so both take a plain
mapping of parameter names to values. Every error names the field and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from seqserve_common.decoding import DecodingStrategy

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 5
# Contrastive search runs one forward row per candidate per step: top_k of the vocabulary
# size would make one request cost as much as thousands of greedy ones and slow every
# sequence batched with it. HF's guidance is 4 to 10 candidates; 64 leaves ample room.
MAX_CONTRASTIVE_TOP_K = 64
# Beam search runs num_beams rows and reserves KV for each: a bound like contrastive's.
MAX_BEAMS = 16
DEFAULT_BEAMS = 4  # decoding_strategy "beam" without num_beams
EARLY_STOPPING = {True: True, False: False, "true": True, "false": False, "never": "never"}
STRATEGIES = tuple(s.value for s in DecodingStrategy)


class RequestError(ValueError):
    """The request is invalid; the message says which field and what is allowed."""


@dataclass(frozen=True)
class Limits:
    """Server-side bounds and defaults the rules depend on."""

    vocab_size: int
    max_position_embeddings: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    default_strategy: DecodingStrategy = DecodingStrategy.GREEDY


@dataclass(frozen=True)
class DecodingConfig:
    """A request's resolved decoding parameters."""

    max_new_tokens: int
    strategy: DecodingStrategy
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    penalty_alpha: float = 0.6
    logprobs: int = -1  # -1: not requested
    num_beams: int = 1  # > 1 with strategy BEAM only
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # False, True or "never"
    num_return_sequences: int = 1

    @property
    def rows(self) -> int:
        """Rows the sequence occupies on the worker: one per beam."""
        return self.num_beams


KNOWN = frozenset({"max_new_tokens", "decoding_strategy", "do_sample", "temperature", "top_k",
                   "top_p", "typical_p", "repetition_penalty", "seed", "stop", "ignore_eos",
                   "penalty_alpha", "logprobs", "num_beams", "length_penalty", "early_stopping",
                   "num_return_sequences"})
CONTRASTIVE_DEFAULT_TOP_K = 4


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {type(value).__name__}")
    # JSON can carry integers of any size; float() of one past ~1e308 raises OverflowError.
    if isinstance(value, int) and not _fits_float(value):
        raise RequestError(f"{name} must be finite, got an integer of {len(str(abs(value)))} digits")
    if not math.isfinite(value):
        raise RequestError(f"{name} must be finite, got {value}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return value


def _fits_float(value: int) -> bool:
    try:
        float(value)
        return True
    except OverflowError:
        return False


def _in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False,
              hi_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        hi_text = "inf" if math.isinf(hi) else f"{hi:g}"
        # f"{v:g}" of an integer past float range (JSON allows any size) raises OverflowError.
        got = f"{value:g}" if _fits_float(value) else f"an integer of {len(str(abs(value)))} digits"
        raise RequestError(f"{name} must be in {left}{lo:g}, {hi_text}{right}, got {got}")


def resolve(params: Mapping[str, Any], limits: Limits, prompt_tokens: int) -> DecodingConfig:
    """Check every given parameter and fill the rest from the server's defaults."""
    unknown = sorted(set(params) - KNOWN)
    if unknown:
        raise RequestError(f"unknown parameter {unknown[0]!r}; known parameters: "
                           f"{', '.join(sorted(KNOWN))}")
    p = dict(params)
    strategy = p.get("decoding_strategy")
    if strategy is not None:
        if not isinstance(strategy, str) or strategy not in STRATEGIES:
            raise RequestError(f"decoding_strategy must be one of {', '.join(STRATEGIES)}, "
                               f"got {strategy!r}")
    elif "do_sample" in p:
        if not isinstance(p["do_sample"], bool):
            raise RequestError(f"do_sample must be true or false, got {p['do_sample']!r}")
        strategy = "sample" if p["do_sample"] else "greedy"
    else:
        strategy = limits.default_strategy
    strategy = DecodingStrategy(strategy)
    strategy, beams = _beams(p, strategy)

    max_new = _integer("max_new_tokens", p.get("max_new_tokens", limits.default_max_new_tokens))
    _in_range("max_new_tokens", max_new, 1, limits.max_new_tokens_limit)
    context = limits.max_position_embeddings
    if prompt_tokens + max_new > context:
        room = context - prompt_tokens  # what max_new_tokens may be with this prompt
        shorten = f"shorten the prompt to at most {context - max_new} tokens"
        lower = f"max_new_tokens must be at most {room} (the context minus the prompt)"
        if room < 1:
            fix = (shorten if max_new < context else
                   "shorten the prompt and lower max_new_tokens until both fit")
        elif max_new >= context:
            fix = lower  # no prompt is short enough: only a lower max_new_tokens helps
        else:
            fix = f"{shorten}, or lower max_new_tokens: {lower}"
        raise RequestError(
            f"prompt of {prompt_tokens} tokens plus max_new_tokens {max_new} exceeds the "
            f"model's context of {context} tokens; {fix}")

    temperature = _number("temperature", p.get("temperature", 1.0))
    _in_range("temperature", temperature, 0, math.inf, lo_open=True)
    default_k = CONTRASTIVE_DEFAULT_TOP_K if strategy is DecodingStrategy.CONTRASTIVE else 0
    top_k = _integer("top_k", p.get("top_k", default_k))
    if strategy is DecodingStrategy.CONTRASTIVE:
        try:
            _in_range("top_k", top_k, 1, min(MAX_CONTRASTIVE_TOP_K, limits.vocab_size))
        except RequestError as exc:
            raise RequestError(f"{exc} (contrastive search runs a forward row per candidate "
                               f"per step; the server allows at most {MAX_CONTRASTIVE_TOP_K} "
                               "candidates)") from None
    else:
        _in_range("top_k", top_k, 0, limits.vocab_size)
    top_p = _number("top_p", p.get("top_p", 1.0))
    _in_range("top_p", top_p, 0, 1, lo_open=True)
    typical_p = _number("typical_p", p.get("typical_p", 1.0))
    _in_range("typical_p", typical_p, 0, 1, lo_open=True)
    rep = _number("repetition_penalty", p.get("repetition_penalty", 1.0))
    _in_range("repetition_penalty", rep, 0, math.inf, lo_open=True)
    seed = p.get("seed")
    if seed is not None:
        seed = _integer("seed", seed)
        _in_range("seed", seed, 0, 2**63 - 1)
    stop = p.get("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise RequestError(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters, "
                               f"got {len(s)}")
    ignore_eos = p.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, got {ignore_eos!r}")
    alpha = _number("penalty_alpha", p.get("penalty_alpha", 0.6))
    _in_range("penalty_alpha", alpha, 0, 1)
    logprobs = p.get("logprobs")
    if logprobs is None:
        logprobs = -1
    else:
        logprobs = _integer("logprobs", logprobs)
        _in_range("logprobs", logprobs, 0, MAX_LOGPROBS)
    if strategy is DecodingStrategy.BEAM:
        for name, bad in (("stop", bool(stop)), ("ignore_eos", ignore_eos),
                          ("logprobs", logprobs >= 0)):
            if bad:
                raise RequestError(f"{name} does not work with beam search (num_beams > 1): "
                                   "its tokens are known only when the search ends; "
                                   f"leave {name} out or use num_beams 1")
    return DecodingConfig(
        max_new_tokens=max_new, strategy=strategy, temperature=temperature, top_k=top_k,
        top_p=top_p, typical_p=typical_p, repetition_penalty=rep, seed=seed,
        stop=tuple(stop), ignore_eos=ignore_eos, penalty_alpha=alpha, logprobs=logprobs,
        **beams)


def _beams(p: Mapping[str, Any], strategy: DecodingStrategy
           ) -> tuple[DecodingStrategy, dict[str, Any]]:
    """The strategy once num_beams is known, and the beam search fields. As in Hugging Face
    generate, num_beams > 1 without sampling is beam search."""
    explicit = p.get("decoding_strategy") is not None
    default = DEFAULT_BEAMS if strategy is DecodingStrategy.BEAM else 1
    num_beams = _integer("num_beams", p.get("num_beams", default))
    _in_range("num_beams", num_beams, 1, MAX_BEAMS)
    if num_beams > 1 and strategy is not DecodingStrategy.BEAM:
        if explicit or p.get("do_sample") is True:
            chosen = (f"decoding_strategy {strategy.value!r}" if explicit else "do_sample true")
            raise RequestError(f"num_beams {num_beams} asks for beam search, which does not "
                               f"go with {chosen}; send num_beams 1, or leave that out")
        strategy = DecodingStrategy.BEAM
    if strategy is DecodingStrategy.BEAM and num_beams < 2:
        raise RequestError("decoding_strategy 'beam' needs num_beams of at least 2 (one beam "
                           "is greedy decoding)")
    n = _integer("num_return_sequences", p.get("num_return_sequences", 1))
    if n > num_beams:
        raise RequestError(f"num_return_sequences {n} exceeds num_beams {num_beams}: beam "
                           "search returns at most one hypothesis per beam (several sampled "
                           "choices are `n`)")
    _in_range("num_return_sequences", n, 1, MAX_BEAMS)
    length_penalty = _number("length_penalty", p.get("length_penalty", 1.0))
    early = p.get("early_stopping", False)
    if isinstance(early, str):
        early = early.lower()
    if not isinstance(early, (bool, str)) or early not in EARLY_STOPPING:
        raise RequestError(f"early_stopping must be true, false or \"never\", got {early!r}")
    if strategy is not DecodingStrategy.BEAM:
        return strategy, {}
    return strategy, {"num_beams": num_beams, "length_penalty": length_penalty,
                      "early_stopping": EARLY_STOPPING[early], "num_return_sequences": n}


# Request fields beside the decoding parameters that count tokens: `length_hint` (policy
# length-batched's prediction, generate.proto 14) and `eos_after_tokens` (benchmarks: end
# as by EOS after that many tokens, generate.proto 15). /invocations takes them in
# `parameters` and hands them to the front end apart from the decoding parameters.
TOKEN_COUNTS = ("length_hint", "eos_after_tokens")


def check_token_count(name: str, value: Any) -> int | None:
    """A token-count field (TOKEN_COUNTS) of a JSON body: None when left out, else an
    integer >= 1, or RequestError naming the field (the front end's rule for gRPC)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, float) and value.is_integer()):
            raise RequestError(f"{name} must be an integer >= 1 when given, got {value!r}")
        value = int(value)
    if value < 1:
        raise RequestError(f"{name} must be >= 1 when given, got {value}")
    return value


def check_text(name: str, text: str, required: bool) -> None:
    """Prompt text rules: non-empty when required, no NUL characters, no lone surrogates."""
    if required and not text:
        raise RequestError(f"{name} is empty; send the prompt text")
    if "\x00" in text:
        raise RequestError(f"{name} contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} is not valid UTF-8") from None
