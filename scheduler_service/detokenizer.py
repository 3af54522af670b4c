"""Incremental detokenization and stop-string matching for streamed generation.

The scheduler receives one generated token id per sequence per step and must
stream text to the client as soon as it is final. Two problems make the naive
``decode([token_id])`` wrong:

* A token does not always end on a character boundary. Byte-level BPE (GPT-2,
  Llama 3, Qwen, ...) can split one multi-byte UTF-8 character over several
  tokens; decoding a partial character yields U+FFFD, which must never reach
  the client as if it were real text.
* Decoders are context dependent (sentencepiece-style tokenizers strip the
  leading space of the first token of a decode), so text must be produced as
  the *difference* of two decodes over the same starting token.

:class:`IncrementalDetokenizer` implements the prefix/read-offset scheme used by
vLLM and TGI; :class:`StopMatcher` cuts the resulting text stream at stop
strings, including stop strings that span chunk (token) boundaries.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

try:  # transformers 5: the tokenizers-library backend of every fast tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # pragma: no cover - an older transformers: decode() everywhere
    TokenizersBackend = None

__all__ = [
    "MAX_STOP_STRINGS",
    "REPLACEMENT_CHAR",
    "IncrementalDetokenizer",
    "StopMatcher",
    "ids_decoder",
]

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder emits for bytes that are not (yet) a complete UTF-8 character."""

MAX_STOP_STRINGS = 8

# Prompt tokens decoded as context ahead of the generated ones. A handful is
# enough for decoders whose output depends on the neighbouring token (leading
# "▁"/space handling) while keeping every decode a few tokens long.
_PROMPT_CONTEXT_TOKENS = 5

# An incomplete UTF-8 tail is at most 3 bytes, so with byte-level tokens it is
# never spread over more than 3 pending tokens. Text still unfinished after this
# many tokens comes from genuinely invalid bytes or from tokens that keep
# straddling character boundaries; past this point the text before the trailing
# U+FFFD run is released anyway so a stream cannot stall.
_MAX_PENDING_TOKENS = 8

# Hard bound on the decode window: after this many pending tokens the window
# slides even if the text ends with U+FFFD, which is then emitted as is. Only a
# stream with this many consecutive tokens none of which ends on a character
# boundary (in practice: invalid bytes from a broken or random model) gets
# here; without it such a stream would make every decode O(generated length).
_FORCE_SLIDE_TOKENS = 32


# decode([token]) per tokenizer and skip_special_tokens, shared by every stream: once
# the window slides, the new context is usually the one token just emitted, and its
# text is what the next step's prefix decode would compute again. A single token's
# decode depends on nothing else, so the table is exact, and at most the vocabulary big.
_SINGLE_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def single_token_texts(tokenizer: PreTrainedTokenizerBase,
                       skip_special_tokens: bool) -> dict[int, str]:
    """The shared decode([token]) table of a tokenizer (filled as tokens are seen)."""
    try:
        tables = _SINGLE_TOKEN_TEXT.get(tokenizer)
        if tables is None:
            tables = _SINGLE_TOKEN_TEXT[tokenizer] = ({}, {})
    except TypeError:  # a tokenizer that takes no weak reference: a table of its own
        return {}
    return tables[skip_special_tokens]


def ids_decoder(tokenizer: PreTrainedTokenizerBase,
                skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A function of a list of token ids with the text of tokenizer.decode(ids,
    skip_special_tokens=...): the tokenizers library's own decode where transformers' would
    only call it (a class that keeps its decode and _decode, and no clean-up of spaces
    that applies), which saves 1.5-3 us of Python argument handling per call (two calls per
    generated token); else decode itself."""
    plain = (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
             and type(tokenizer).decode is PreTrainedTokenizerBase.decode
             and type(tokenizer)._decode is TokenizersBackend._decode)
    backend = tokenizer.backend_tokenizer if plain else None
    if plain and tokenizer.clean_up_tokenization_spaces:
        # transformers skips the clean-up for BPE models unless told to corrupt them
        plain = (type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False))
    if plain:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    limit = min(len(a), len(b))
    # Fast path: the context text is almost always an exact prefix.
    if b.startswith(a[:limit]):
        return limit
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of final text chunks.

    The detokenizer keeps a small window of token ids, ``window[:read]`` being
    tokens whose text was already emitted (or is prompt context) and
    ``window[read:]`` tokens whose text is still pending. Each :meth:`add`
    decodes the window twice (with and without the pending tokens) and emits the
    difference once it no longer ends with an incomplete character; the window
    then slides forward so the decode cost stays bounded by a few tokens instead
    of growing with the generated length.

    Invariant: ``"".join(add(t) for t in ids) + flush()`` equals the decode of
    ``prompt + ids`` minus the decode of ``prompt`` (both restricted to the
    context window). For byte-level BPE this is exactly
    ``tokenizer.decode(ids, skip_special_tokens=...)`` whenever the prompt does
    not end in the middle of a character. For sentencepiece-style decoders that
    drop the leading space of the first decoded token, the stream keeps that
    space (e.g. ``" Hello"`` after a prompt) where ``tokenizer.decode(ids)``
    alone would give ``"Hello"``; the streamed form is the one that concatenates
    correctly onto the prompt.

    If the prompt ends with a partial character that the generated tokens
    complete, the completed character is emitted with the generated text (it
    belongs to neither decode alone). The one deliberate exception to the
    invariant is the forced slide after ``_FORCE_SLIDE_TOKENS`` tokens without a
    character boundary, which trades exactness on an already invalid byte
    stream for a bounded decode window.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self._single = single_token_texts(tokenizer, skip_special_tokens)
        # Only the last few prompt tokens are kept: they are context for the
        # decoder, never emitted.
        start = max(len(prompt_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._window: list[int] = [int(t) for t in prompt_ids[start:]]
        self._read = len(self._window)
        # decode(window[:read]); cached because it only changes when the window
        # slides, which saves one decode per step while a character is pending.
        self._prefix_text: str | None = None
        # Characters past the prefix text already emitted by the stall release
        # (see _MAX_PENDING_TOKENS); zero in the common case.
        self._released = 0
        self._num_generated = 0

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def num_generated(self) -> int:
        """Number of generated token ids added so far."""
        return self._num_generated

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            if self._read == 1:
                token = self._window[0]
                text = self._single.get(token)
                if text is None:
                    text = self._single[token] = self._decode(self._window[:1])
                self._prefix_text = text
            else:
                self._prefix_text = self._decode(self._window[: self._read]) if self._read else ""
        return self._prefix_text

    def _slide(self) -> None:
        """Make the pending tokens the new context; drop the old context."""
        # Context only has to give the decoder its left neighbours, so a long
        # pending run (forced slide) is cut to the same few tokens as a prompt.
        del self._window[: max(self._read, len(self._window) - _PROMPT_CONTEXT_TOKENS)]
        self._read = len(self._window)
        self._prefix_text = None
        self._released = 0

    def add(self, token_id: int) -> str:
        """Append one generated token id; return the text it completed (maybe "")."""
        self._window.append(int(token_id))
        self._num_generated += 1
        prefix_text = self._get_prefix_text()
        text = self._decode(self._window)
        base = _common_prefix_len(prefix_text, text)
        start = base + self._released
        pending = len(self._window) - self._read

        if not text.endswith(REPLACEMENT_CHAR):
            # Only slide once the token produced visible text: a token that
            # decodes to nothing at a window edge (e.g. a lone "▁" that the
            # decoder strips when it is first) must stay as context.
            if len(text) > start or pending > _MAX_PENDING_TOKENS:
                chunk = text[start:]
                self._slide()
                return chunk
            return ""

        if pending > _FORCE_SLIDE_TOKENS:
            chunk = text[start:]
            self._slide()
            return chunk
        if pending > _MAX_PENDING_TOKENS:
            # Everything before the trailing U+FFFD run is final (UTF-8 is
            # self-synchronising), so it can go out while the tail waits.
            stable_end = len(text.rstrip(REPLACEMENT_CHAR))
            if stable_end > start:
                self._released = stable_end - base
                return text[start:stable_end]
        return ""

    def flush(self) -> str:
        """Return any text still pending at the end of generation.

        A trailing U+FFFD is returned as decoded: at this point the generation
        really ended in the middle of a character.
        """
        if len(self._window) == self._read:
            return ""
        prefix_text = self._get_prefix_text()
        text = self._decode(self._window)
        chunk = text[_common_prefix_len(prefix_text, text) + self._released :]
        self._slide()
        return chunk


class StopMatcher:
    """Cuts a stream of text chunks at the earliest occurrence of a stop string.

    Text that could be the beginning of a stop string (the longest suffix of the
    pending text that is a proper prefix of some stop string) is held back until
    later chunks resolve it, so a stop string split across tokens is still
    caught and never partially emitted. The result is the same as applying the
    stop strings to the complete text: output ends right before the earliest
    occurrence of any stop string, and the stop string itself is not emitted.
    """

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        stops = list(dict.fromkeys(stop_strings))  # dedupe, keep order
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(not s for s in stops):
            # An empty stop string would match before the first character.
            raise ValueError("stop strings must be non-empty")
        self._stops: tuple[str, ...] = tuple(stops)
        self._max_hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been matched."""
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, if any (for finish reasons)."""
        return self._matched

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = text.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _hold_start(self, text: str) -> int:
        """Start index of the longest suffix of ``text`` that begins a stop string."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            suffix = text[-k:]
            if any(len(stop) > k and stop.startswith(suffix) for stop in self._stops):
                return len(text) - k
        return len(text)

    def feed(self, chunk: str) -> tuple[str, bool]:
        """Add detokenized text; return (text safe to emit now, stopped)."""
        if self._matched is not None:
            return "", True
        if not self._stops:
            return chunk, False
        # The pending text is shorter than the longest stop, so searching it
        # together with the chunk stays cheap and catches boundary-spanning stops.
        text = self._pending + chunk
        hold = self._hold_start(text)
        match = self._earliest_match(text)
        # A partial match that starts before a complete one may still grow
        # into an earlier stop, so the complete one waits until it resolves.
        if match is not None and match[0] <= hold:
            idx, stop = match
            self._pending = ""
            self._matched = stop
            return text[:idx], True
        self._pending = text[hold:]
        return text[:hold], False

    def flush(self) -> str:
        """Return held-back text when the generation ended without a stop string."""
        if self._matched is not None:
            return ""
        text, self._pending = self._pending, ""
        # No more text can arrive, so a complete match that was waiting on an
        # earlier partial one now wins.
        match = self._earliest_match(text)
        if match is not None:
            self._matched = match[1]
            return text[: match[0]]
        return text
