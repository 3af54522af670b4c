"""The offline batch API (client/offline.py): the continuous-batching seed's example shape,
left-padded prompts in and a list of texts out, over the real processes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from client import Client
from client.offline import OfflineModel, strip_padding
from tests import reference
from tests.test_beam import beam_reference

# The seed's prompts (continuous-batching.md, "Offline").
PROMPTS = [
    "Tell me an interesting fact about llamas.",
    "What is the best way to cook a steak?",
    "Are you familiar with the Special Theory of Relativity and can you explain it to me?",
    "Recommend some interesting books to read.",
    "What is the best way to learn a new language?",
]


def test_strip_padding_left_right_auto_and_mask():
    left = [[0, 0, 5, 6], [7, 0, 8, 9]]
    assert strip_padding(left, 0) == [[5, 6], [7, 0, 8, 9]]  # a pad inside a prompt stays
    right = [[5, 6, 0, 0], [7, 8, 9, 0]]
    assert strip_padding(right, 0) == [[5, 6], [7, 8, 9]]
    assert strip_padding(right, 0, "right") == [[5, 6], [7, 8, 9]]
    assert strip_padding(right, 0, "left") == right  # told left: nothing leads with a pad
    assert strip_padding(torch.tensor([[1, 2], [3, 4]]), 0) == [[1, 2], [3, 4]]
    # pad == a real token at both ends: the mask decides, auto refuses to guess.
    both = [[2, 5, 2], [6, 7, 8]]
    assert strip_padding(both, 2, attention_mask=[[0, 1, 1], [1, 1, 1]]) == [[5, 2], [6, 7, 8]]
    with pytest.raises(ValueError, match="ambiguous"):
        strip_padding(both, 2)
    with pytest.raises(ValueError, match=r"rows \[1\] are all padding"):
        strip_padding([[5, 6], [0, 0]], 0)
    with pytest.raises(ValueError, match="2-D"):
        strip_padding([1, 2, 3], 0)
    with pytest.raises(ValueError, match="padding_side"):
        strip_padding(left, 0, "middle")


def test_seed_example_left_padded_prompts_in_texts_out(llama_dir, deploy):
    d = deploy(llama_dir, max_rolling_batch_size=4)  # fewer slots than rows: rows queue
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token  # as the seed does
    pad_token_id = tokenizer.pad_token_id
    inputs = tokenizer(PROMPTS, padding=True, return_tensors="pt").input_ids
    assert (inputs[:, 0] == pad_token_id).any(), "the batch must be left-padded"

    with OfflineModel(d.address, timeout=120) as model:
        assert model.max_in_flight == 8
        outputs = model.generate(inputs, max_new_tokens=12, do_sample=False,
                                 pad_token=pad_token_id)
        ans = tokenizer.batch_decode(outputs, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        assert isinstance(ans, list) and len(ans) == len(PROMPTS)
        for prompt, out, text in zip(PROMPTS, outputs, ans):
            ids = tokenizer(prompt).input_ids
            assert out[: len(ids)] == ids  # the prompt without its padding
            assert out[len(ids):] == reference.greedy(llama_dir, prompt, 12)
            assert text.startswith(prompt)

        # Right padding and pad_token_id (Hugging Face's name) give the same outputs.
        right = AutoTokenizer.from_pretrained(llama_dir, padding_side="right")
        right.pad_token = right.eos_token
        batch = right(PROMPTS, padding=True, return_tensors="pt")
        assert model.generate(batch.input_ids, attention_mask=batch.attention_mask,
                              max_new_tokens=12, pad_token_id=pad_token_id) == outputs
        assert model.generate(batch.input_ids, max_new_tokens=12, pad_token_id=pad_token_id,
                              include_prompt=False) == [
            o[len(tokenizer(p).input_ids):] for p, o in zip(PROMPTS, outputs)]


def test_sampling_rows_reproduce_single_requests(llama_dir, deploy):
    d = deploy(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, padding_side="left")
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    params = dict(max_new_tokens=10, top_k=50, top_p=0.9, temperature=1.3)
    with OfflineModel(d.address, timeout=120) as model, Client(d.address, timeout=120) as c:
        outputs = model.generate(batch.input_ids, pad_token=tokenizer.pad_token_id,
                                 do_sample=True, seed=11, include_prompt=False, **params)
        # Row i samples with seed 11 + i: what a request of its own with that seed gets.
        for i, prompt in enumerate(PROMPTS):
            alone = c.generate(tokenizer(prompt).input_ids, do_sample=True, seed=11 + i,
                               **params)
            assert outputs[i] == alone.token_ids
        greedy = model.generate(batch.input_ids, pad_token=tokenizer.pad_token_id,
                                include_prompt=False, max_new_tokens=10)
        assert outputs != greedy  # it did sample


def test_beam_search_rows_equal_generate_num_beams(llama_dir, deploy):
    d = deploy(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, padding_side="left")
    batch = tokenizer(PROMPTS[:3], padding=True, return_tensors="pt")
    beam = dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping=True)
    with OfflineModel(d.address, timeout=120) as model:
        outputs = model.generate(batch.input_ids, pad_token=tokenizer.pad_token_id,
                                 max_new_tokens=10, include_prompt=False, **beam)
    assert len(outputs) == 3 * 2  # generate's [batch * num_return_sequences]
    for i, prompt in enumerate(PROMPTS[:3]):
        expected = [ids for ids, _ in beam_reference(llama_dir, prompt, 10, **beam)]
        assert outputs[2 * i : 2 * i + 2] == expected
