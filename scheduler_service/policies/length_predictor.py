"""Response-length prediction on the scheduler, from the prompt's tokens alone, learned
online from finished requests.

Admission happens before prefill, so a prediction that orders admissions must exist
before the model has seen the prompt: this predictor uses what the scheduler has then,
the prompt's token ids. It keeps the output lengths of finished requests under three
keys, most specific first: the chained hash of each `block_tokens`-token prefix of the
prompt (requests that share a long prefix: the same conversation, template or retried
prompt), the prompt length's power-of-two bin, and everything. A prediction is the
median (it minimises the absolute error) of the most specific key with enough samples;
with none, the fallback is the request's max_new_tokens (what FCFS reserves). Memory is
bounded: `max_keys` prefix keys, least recently used out, `window` samples per key.
Predictions are then rounded up to `bucket_tokens` (length buckets, as the paper groups
lengths), which admission orders and reserves by.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PredictorConfig:
    bucket_tokens: int = 50
    block_tokens: int = 64
    window: int = 64
    min_samples: int = 3  # of a length bin or of everything (a shared prefix needs 1)
    max_keys: int = 100_000


class _Samples:
    """The last `window` lengths under one key, kept sorted for the median."""

    def __init__(self, window: int):
        self.recent: deque[int] = deque(maxlen=window)
        self.sorted: list[int] = []

    def add(self, n: int) -> None:
        if len(self.recent) == self.recent.maxlen:
            self.sorted.pop(bisect.bisect_left(self.sorted, self.recent[0]))
        self.recent.append(n)
        bisect.insort(self.sorted, n)

    def median(self) -> int:
        return self.sorted[len(self.sorted) // 2]


def prefix_keys(prompt_ids: list[int] | tuple[int, ...], block: int) -> list[int]:
    """Chained hashes of the prompt's whole `block`-token prefixes, shortest first."""
    keys, h = [], 0
    for end in range(block, len(prompt_ids) + 1, block):
        h = hash((h, tuple(prompt_ids[end - block:end])))
        keys.append(h)
    return keys


def length_bin(prompt_tokens: int) -> int:
    return max(0, math.ceil(math.log2(max(prompt_tokens, 1))))


class LengthPredictor:
    def __init__(self, cfg: PredictorConfig = PredictorConfig()):
        self.cfg = cfg
        self._prefix: OrderedDict[int, _Samples] = OrderedDict()
        self._bins: dict[int, _Samples] = {}
        self._all = _Samples(cfg.window * 16)
        self.learned = 0

    def predict(self, prompt_tokens: int, keys: list[int], max_new_tokens: int) -> int:
        """Predicted output tokens, in [1, max_new_tokens]; `keys` from prefix_keys."""
        for key in reversed(keys):  # the longest shared prefix first
            s = self._prefix.get(key)
            if s is not None:
                self._prefix.move_to_end(key)
                return _clip(s.median(), max_new_tokens)
        for s in (self._bins.get(length_bin(prompt_tokens)), self._all):
            if s is not None and len(s.sorted) >= self.cfg.min_samples:
                return _clip(s.median(), max_new_tokens)
        return max_new_tokens

    def learn(self, prompt_tokens: int, keys: list[int], generated: int) -> None:
        """A finished request's real output length."""
        for key in keys:
            s = self._prefix.get(key)
            if s is None:
                s = self._prefix[key] = _Samples(self.cfg.window)
                if len(self._prefix) > self.cfg.max_keys:
                    self._prefix.popitem(last=False)
            else:
                self._prefix.move_to_end(key)
            s.add(generated)
        self._bins.setdefault(length_bin(prompt_tokens), _Samples(self.cfg.window)).add(generated)
        self._all.add(generated)
        self.learned += 1

    def bucket(self, tokens: int) -> int:
        """`tokens` rounded up to a whole bucket."""
        b = self.cfg.bucket_tokens
        return -(-tokens // b) * b


def _clip(n: int, max_new_tokens: int) -> int:
    return max(1, min(n, max_new_tokens))


@dataclass
class Accuracy:
    """The paper's measures of a length predictor: mean absolute error (tokens) and the
    share of predictions within 50 and 100 tokens of the real length."""

    n: int = 0
    abs_error: float = 0.0
    within_50: int = 0
    within_100: int = 0

    def add(self, predicted: int, real: int) -> None:
        err = abs(predicted - real)
        self.n += 1
        self.abs_error += err
        self.within_50 += err <= 50
        self.within_100 += err <= 100

    def summary(self) -> dict[str, float]:
        n = max(self.n, 1)
        return {"n": self.n, "error": self.abs_error / n, "acc50": self.within_50 / n,
                "acc100": self.within_100 / n}
