"""Request parameter validation (scheduler_service.params), without a server."""

from __future__ import annotations

import math

import pytest

from scheduler_service.params import Limits, RequestError, check_text, resolve
from seqserve_common.decoding import DecodingStrategy

LIMITS = Limits(vocab_size=1000, max_position_embeddings=1024, max_new_tokens_limit=512,
                default_max_new_tokens=64, default_strategy=DecodingStrategy.GREEDY)


def test_defaults_and_strategy_selection():
    cfg = resolve({}, LIMITS, 10)
    assert cfg.strategy == "greedy" and cfg.max_new_tokens == 64 and cfg.logprobs == -1
    assert resolve({"do_sample": True}, LIMITS, 10).strategy == "sample"
    c = resolve({"decoding_strategy": "contrastive"}, LIMITS, 10)
    assert c.top_k == 4 and c.penalty_alpha == 0.6
    assert resolve({"decoding_strategy": "greedy", "do_sample": True}, LIMITS, 10).strategy == "greedy"


@pytest.mark.parametrize("params, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 513}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"), ({"temperature": 0}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 1001}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"typical_p": 0}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": -1}, "seed"),
    ({"stop": ["a"] * 9}, "stop"), ({"stop": [""]}, "stop"), ({"stop": [1, 2]}, "stop"),
    ({"penalty_alpha": 1.5}, "penalty_alpha"), ({"logprobs": 6}, "logprobs"),
    ({"decoding_strategy": "beams"}, "decoding_strategy"), ({"do_sample": "yes"}, "do_sample"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"bogus": 1}, "bogus"),
    ({"decoding_strategy": "contrastive", "top_k": 0}, "top_k"),
])
def test_invalid_values_name_the_field(params, field):
    with pytest.raises(RequestError, match=field):
        resolve(params, LIMITS, 10)


def test_context_limit():
    with pytest.raises(RequestError, match="exceeds the model's context"):
        resolve({"max_new_tokens": 100}, LIMITS, 1000)
    assert resolve({"max_new_tokens": 24}, LIMITS, 1000).max_new_tokens == 24


def test_text_rules():
    with pytest.raises(RequestError, match="empty"):
        check_text("inputs", "", required=True)
    with pytest.raises(RequestError, match="NUL"):
        check_text("inputs", "a\x00b", required=True)
    with pytest.raises(RequestError, match="UTF-8"):
        check_text("inputs", "\ud800", required=True)
    check_text("cached_prompt", "", required=False)


@pytest.mark.parametrize("name", ["length_hint", "eos_after_tokens"])
def test_token_counts_of_a_json_body(name):
    """/invocations' length_hint and eos_after_tokens (in `parameters`): integers >= 1,
    left out as None; anything else is refused naming the field, as gRPC's are."""
    from scheduler_service.params import TOKEN_COUNTS, check_token_count

    assert name in TOKEN_COUNTS
    assert check_token_count(name, None) is None
    assert check_token_count(name, 5) == 5 and check_token_count(name, 5.0) == 5
    for bad, message in ((0, ">= 1 when given, got 0"), (-3, ">= 1 when given, got -3"),
                         ("5", "an integer >= 1 when given, got '5'"),
                         (True, "an integer >= 1 when given, got True"),
                         (2.5, "an integer >= 1 when given, got 2.5")):
        with pytest.raises(RequestError, match=f"^{name} must be {message}"):
            check_token_count(name, bad)


def test_openai_bodies_take_the_token_counts_as_extra_fields():
    from scheduler_service.openai_schemas import (SEQSERVE_EXTRAS, ApiError,
                                                  ChatCompletionRequest, CompletionRequest,
                                                  parse)

    assert {"length_hint", "eos_after_tokens"} <= set(SEQSERVE_EXTRAS)
    req = parse(CompletionRequest, b'{"prompt": "hi", "length_hint": 40, '
                                   b'"eos_after_tokens": 3}')
    assert (req.length_hint, req.eos_after_tokens) == (40, 3)
    chat = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert (chat.length_hint, chat.eos_after_tokens) == (None, None)
    for raw in (b'{"prompt": "hi", "length_hint": "40"}', b'{"prompt": "hi", '
                                                          b'"eos_after_tokens": 2.5}'):
        with pytest.raises(ApiError) as err:
            parse(CompletionRequest, raw)
        assert err.value.param in ("length_hint", "eos_after_tokens")
