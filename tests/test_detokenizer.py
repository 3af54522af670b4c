"""Tests for scheduler_service.detokenizer against a real, locally trained byte-level BPE."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from scheduler_service.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopMatcher,
    ids_decoder,
)

EOS = "<|endoftext|>"

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? Grüße aus Köln, señor.",
    "你好，世界。你好吗？我很好，谢谢。",
    "🙂🚀 emoji time 🙂🚀🎉 party 🎉",
    "こんにちは世界、日本語のテキストです。",
    "Привет, мир! Как дела?",
    "def add(a, b):\n    return a + b\n",
]

# Texts whose characters are mostly rare in the corpus, so several of them are
# split into single-byte tokens.
_SAMPLES = [
    ("User: say hi\nAssistant:", " Hello world! 你好，世界 🙂🚀"),
    ("", "héllo wörld 日本語 🎉 done"),
    ("Translate: ", "Grüße 👋🏽 ∑∫ 漢字かな交じり"),
    ("x", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓ ok"),
    ("Привет", ", мир! 🙂"),
]

# Hypothesis alphabets: ASCII plus several multi-byte scripts and emoji, so the
# byte-level BPE sees 1-, 2-, 3- and 4-byte characters.
_ALPHABET = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(list("éöüçñßÀЖжщ")),
    st.sampled_from(list("你好世界日本語テキストこんにちは，。")),
    st.sampled_from(list("🙂🚀🎉👋🏽𝔘")),
    # U+FFFD itself is excluded: decode() output containing it is outside the
    # invariant (see test_literal_replacement_character).
    st.characters(codec="utf-8", exclude_characters=REPLACEMENT_CHAR),
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=1,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 10, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], gen_ids: list[int]
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    chunks = [detok.add(t) for t in gen_ids]
    return chunks, detok.flush()


class CountingTokenizer:
    """Decodes with `tokenizer` and records each decode call's length in `calls`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.calls: list[int] = []

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_multibyte_split_across_tokens_streams_exact_text(tokenizer: PreTrainedTokenizerBase) -> None:
    split_char_seen = False
    for prompt, generated in _SAMPLES:
        prompt_ids = _encode(tokenizer, prompt)
        gen_ids = _encode(tokenizer, generated)
        if any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in gen_ids):
            split_char_seen = True
        expected = tokenizer.decode(gen_ids, skip_special_tokens=True)
        assert expected == generated

        chunks, tail = _stream(tokenizer, prompt_ids, gen_ids)
        assert "".join(chunks) == expected
        assert tail == ""
        assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert split_char_seen, "the test corpus must split some character across tokens"


def test_prompt_text_is_never_emitted(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt_ids = _encode(tokenizer, "The quick brown fox 你好")
    gen_ids = _encode(tokenizer, " jumps 🙂")
    chunks, tail = _stream(tokenizer, prompt_ids, gen_ids)
    assert "".join(chunks) + tail == " jumps 🙂"


def test_partial_character_waits_then_completes(tokenizer: PreTrainedTokenizerBase) -> None:
    # "𝔘" is absent from the corpus, so its 4 UTF-8 bytes are 4 byte tokens.
    gen_ids = _encode(tokenizer, "a𝔘b")
    assert len(gen_ids) >= 3
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    outs = [detok.add(t) for t in gen_ids]
    assert "".join(outs) == "a𝔘b"
    char_tokens = [i for i, t in enumerate(gen_ids) if REPLACEMENT_CHAR in tokenizer.decode([t])]
    assert char_tokens, "expected the 4-byte character to be split into byte tokens"
    # Nothing is emitted for the tokens before the character's last byte.
    assert all(outs[i] == "" for i in char_tokens[:-1])
    assert "𝔘" in outs[char_tokens[-1]]


def test_flush_returns_incomplete_character_at_real_end(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "ok 𝔘")
    truncated = ids[:-1]  # generation stops in the middle of the character
    chunks, tail = _stream(tokenizer, [], truncated)
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) + tail == tokenizer.decode(truncated, skip_special_tokens=True)
    assert tail.endswith(REPLACEMENT_CHAR)


def test_literal_replacement_character(tokenizer: PreTrainedTokenizerBase) -> None:
    # Text that really contains U+FFFD still streams exactly; a trailing one is
    # only held until the next token (or flush) proves it is not a partial char.
    gen_ids = _encode(tokenizer, "a\ufffdb \ufffd")
    chunks, tail = _stream(tokenizer, [], gen_ids)
    assert "".join(chunks) + tail == "a\ufffdb \ufffd"


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    prompt_ids = [eos] + _encode(tokenizer, "Q: hi") + [eos]
    body = _encode(tokenizer, "Hello 🙂 world")
    # eos after every token, so also between the byte tokens of the emoji.
    gen_ids = [t for tok in body for t in (tok, eos)]
    chunks, tail = _stream(tokenizer, prompt_ids, gen_ids)
    assert "".join(chunks) + tail == "Hello 🙂 world"
    assert all(EOS not in c and REPLACEMENT_CHAR not in c for c in chunks)


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerBase) -> None:
    counting = CountingTokenizer(tokenizer)
    calls = counting.calls

    prompt_ids = _encode(tokenizer, "prompt " * 50)
    detok = IncrementalDetokenizer(counting, prompt_ids, skip_special_tokens=True)  # type: ignore[arg-type]
    gen_ids = _encode(tokenizer, "hello world 你好 " * 40)
    out = "".join(detok.add(t) for t in gen_ids) + detok.flush()
    assert out == tokenizer.decode(gen_ids)
    assert max(calls) <= 12


def test_invalid_byte_stream_is_bounded_and_exact(tokenizer: PreTrainedTokenizerBase) -> None:
    # A broken model emitting lone UTF-8 lead bytes: every one of them is a
    # real U+FFFD in decode(), and the decode window must not grow unbounded.
    lead_byte = tokenizer.convert_tokens_to_ids("ä")  # byte 0xE4 in the byte-level alphabet
    assert tokenizer.decode([lead_byte]) == REPLACEMENT_CHAR
    counting = CountingTokenizer(tokenizer)
    calls = counting.calls

    gen_ids = _encode(tokenizer, "hi ") + [lead_byte] * 100 + _encode(tokenizer, "ok 你好")
    detok = IncrementalDetokenizer(counting, [], skip_special_tokens=True)  # type: ignore[arg-type]
    out = "".join(detok.add(t) for t in gen_ids) + detok.flush()
    assert out == tokenizer.decode(gen_ids)
    assert max(calls) <= 80


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.text(alphabet=_ALPHABET, max_size=20),
    generated=st.lists(st.text(alphabet=_ALPHABET, max_size=12), max_size=6),
    eos_positions=st.lists(st.integers(min_value=0, max_value=200), max_size=3),
)
def test_stream_matches_full_decode_property(
    tokenizer: PreTrainedTokenizerBase, prompt: str, generated: list[str], eos_positions: list[int]
) -> None:
    gen_ids = [t for part in generated for t in _encode(tokenizer, part)]
    for pos in eos_positions:  # special tokens anywhere, even inside a character
        gen_ids.insert(pos % (len(gen_ids) + 1), tokenizer.eos_token_id)
    expected = tokenizer.decode(gen_ids, skip_special_tokens=True)
    assert REPLACEMENT_CHAR not in expected  # encoded from valid text
    chunks, tail = _stream(tokenizer, _encode(tokenizer, prompt), gen_ids)
    assert "".join(chunks) + tail == expected
    assert all(REPLACEMENT_CHAR not in c for c in chunks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=_ALPHABET, min_size=1, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_random_token_sequences_from_vocab(tokenizer: PreTrainedTokenizerBase, text: str, seed: int) -> None:
    # Tokens drawn (with repetition, any order) from the ids of encoded text:
    # the sequence may contain invalid UTF-8, which must then come out exactly
    # as decode() renders it. (At most 30 tokens: the forced slide after 32
    # pending tokens is allowed to differ on invalid streams.)
    pool = _encode(tokenizer, text)
    rng = random.Random(seed)
    gen_ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
    expected = tokenizer.decode(gen_ids, skip_special_tokens=True)
    chunks, tail = _stream(tokenizer, [], gen_ids)
    assert "".join(chunks) + tail == expected
    if REPLACEMENT_CHAR not in expected:
        assert all(REPLACEMENT_CHAR not in c for c in chunks)


# --- StopMatcher ---------------------------------------------------------------


def _run_stop(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        emitted, stopped = matcher.feed(chunk)
        out.append(emitted)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_split_across_two_chunks() -> None:
    matcher = StopMatcher(["lo w"])
    assert matcher.feed("Hel") == ("He", False)  # "l" might start "lo w"
    assert matcher.feed("lo wor") == ("l", True)
    assert matcher.matched == "lo w"
    assert matcher.feed("ld") == ("", True)
    assert matcher.flush() == ""


def test_stop_split_emits_prefix_only() -> None:
    assert _run_stop(StopMatcher(["lo w"]), ["Hel", "lo wor"]) == ("Hel", True)


def test_earliest_of_two_stops_wins() -> None:
    matcher = StopMatcher(["world", "o w"])
    assert _run_stop(matcher, ["Hello", " world"]) == ("Hell", True)
    assert matcher.matched == "o w"
    # Same chunk, both complete: earliest start wins regardless of list order.
    assert _run_stop(StopMatcher(["c", "ab"]), ["xabc"]) == ("x", True)


def test_earlier_partial_stop_takes_precedence_over_later_complete_one() -> None:
    # "bc" completes first, but "abcd" starts earlier and then completes too.
    assert _run_stop(StopMatcher(["abcd", "bc"]), ["a", "bc", "d"]) == ("", True)
    # If the longer one fails, the shorter one still stops the stream.
    assert _run_stop(StopMatcher(["abcd", "bc"]), ["a", "bc", "x"]) == ("a", True)
    # And at the end of the stream the waiting match is applied by flush().
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("abc") == ("", False)
    assert matcher.flush() == "a"
    assert matcher.stopped


def test_partial_match_released_when_not_a_stop() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("a </") == ("a ", False)
    assert matcher.feed("p> b") == ("</p> b", False)
    assert not matcher.stopped


def test_flush_returns_held_text() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("the end ST") == ("the end ", False)
    assert matcher.flush() == "ST"
    assert not matcher.stopped


def test_no_stop_strings_pass_through() -> None:
    matcher = StopMatcher([])
    for chunk in ["a", "", "lo w", "🙂"]:
        assert matcher.feed(chunk) == (chunk, False)
    assert matcher.flush() == ""


def test_stop_matcher_validates_input() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])
    with pytest.raises(ValueError):
        StopMatcher([str(i) for i in range(9)])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matcher_equals_offline_cut(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(found)], True) if found else (text, False)
    matcher = StopMatcher(stops)
    out, stopped = _run_stop(matcher, chunks)
    assert (out, stopped or matcher.stopped) == expected


def test_stop_spanning_two_real_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "The quick brown fox jumps over the lazy dog, then says hello world."
    ids = _encode(tokenizer, text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "".join(pieces) == text
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces) + 1)]

    chosen = None
    for i in range(len(pieces) - 1):
        first, second = pieces[i], pieces[i + 1]
        if len(first) >= 2 and len(second) >= 2:
            stop = first[-2:] + second[:2]
            if text.find(stop) == offsets[i + 1] - 2:  # its first occurrence spans the boundary
                chosen = (i, stop)
                break
    assert chosen is not None
    i, stop = chosen

    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Story:"), skip_special_tokens=True)
    matcher = StopMatcher([stop])
    out: list[str] = []
    stopped_at = None
    for k, tok_id in enumerate(ids):
        emitted, stopped = matcher.feed(detok.add(tok_id))
        out.append(emitted)
        if stopped:
            stopped_at = k
            break
    assert stopped_at == i + 1  # caught on the second token, not before
    assert "".join(out) == text[: text.find(stop)]
    assert stop not in "".join(out)


def test_single_token_context_is_decoded_once_per_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    # After each slide the context is the one token just emitted; its text comes from the
    # tokenizer's shared table, so a stream over known tokens decodes once per token.
    counting = CountingTokenizer(tokenizer)
    calls = counting.calls
    prompt_ids = _encode(tokenizer, "prompt " * 5)
    gen_ids = _encode(tokenizer, "hello world and more " * 5)
    for _ in range(2):
        calls.clear()
        detok = IncrementalDetokenizer(counting, prompt_ids, skip_special_tokens=True)  # type: ignore[arg-type]
        out = "".join(detok.add(t) for t in gen_ids) + detok.flush()
        assert out == tokenizer.decode(gen_ids)
    assert len(calls) <= len(gen_ids) + 2  # the prompt's context, then one per token


def _wordpiece_with_cleanup() -> PreTrainedTokenizerBase:
    """A WordPiece tokenizer whose decode cleans up spaces before punctuation (BERT's):
    transformers' decode does more than the tokenizers library's there."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # transformers' decode cleans up
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator(_CORPUS * 10, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("skip", [True, False])
def test_ids_decoder_gives_the_text_of_decode(tokenizer: PreTrainedTokenizerBase,
                                              skip: bool) -> None:
    """The byte-level BPE fixture takes the tokenizers library's decode directly; a
    WordPiece tokenizer whose decode cleans up spaces keeps transformers' decode. Both give
    decode's text for random ids, special tokens among them."""
    wordpiece = _wordpiece_with_cleanup()
    rng = random.Random(7)
    for tok, direct in ((tokenizer, True), (wordpiece, False)):
        decode = ids_decoder(tok, skip)
        assert (decode.func == tok.backend_tokenizer.decode) is direct
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids
    assert wordpiece.decode(wordpiece.encode("a , b .")) != \
        wordpiece.backend_tokenizer.decode(wordpiece.encode("a , b ."))  # the clean-up
