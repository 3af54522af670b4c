"""Prompts as token ids through the gRPC API: the same output as the text they encode,
checked against the vocabulary, and never mixed with a cached_prompt."""

from __future__ import annotations

import grpc
import pytest
from transformers import AutoTokenizer

from client import Client
from tests import reference


def test_token_id_prompts(llama_dir, deploy):
    d = deploy(llama_dir)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    text = "the dragon flew over the castle"
    ids = tok(text).input_ids
    with Client(d.address, timeout=120) as c:
        by_text = c.generate(text, max_new_tokens=8, ignore_eos=True)
        by_ids = c.generate(ids, max_new_tokens=8, ignore_eos=True)
        assert by_ids.token_ids == by_text.token_ids
        assert by_ids.prompt_tokens == len(ids)
        assert reference.same_until_eos(by_ids.token_ids, reference.greedy(llama_dir, text, 8),
                                        tok.eos_token_id)
        info = c.model_info()
        for bad, field in (([], "no token ids"), ([5, info.vocab_size], "vocabulary"),
                           ([5, 10**9], "vocabulary")):
            with pytest.raises(grpc.RpcError) as err:
                c.generate(bad, max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(ids, max_new_tokens=2, cached_prompt="a system prompt")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cached_prompt" in err.value.details()
