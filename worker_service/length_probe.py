"""Response-length prediction on the worker, from the prompt's last hidden state.

At the prompt's last prefill chunk the packed forward already computes the final hidden
state of the last prompt position (post final norm: the vector the LM head reads for the
first token), so a probe on it costs no extra forward. The probe is a softmax classifier
over length buckets of `bucket_tokens` (the paper's 50-token buckets; the last bucket is
open), trained online on the worker from the sequences that finished:

- A sequence that ended by EOS or a stop string gives its exact length: its bucket.
- A sequence cut by max_new_tokens, or cancelled, only says its length is at least what
  it generated (right-censored). Dropping those would teach the probe that long answers
  do not exist (the long ones are the ones cut), and learning them at the cut length
  would teach a wrong bucket; so they train the censored likelihood, log P(bucket >= the
  cut's bucket), which pushes probability past the cut and says nothing about where.
- A preempted sequence ends nothing: its features wait until it finishes.

A prediction is the expected length under the classifier's bucket probabilities over the
buckets some label reached (an untrained classifier is uniform, and buckets no answer ever
reached would pull every early prediction to the middle of the range), each bucket
represented by the mean exact length learned in it (a censored one's: the mean cut, a
lower bound), so it is a length in tokens, not only a bucket. Before `min_samples` exact labels there is no
prediction (None): the scheduler keeps its own.

Training stays off a step's critical path: `learn` only stores the sample and owes it
`updates` minibatches; each `train(max_batches)` call (once per Step, after its tokens
are chosen) runs at most that many of the owed small Adam minibatches, each drawn uniformly
(seeded) from the kept window, and nothing when none is owed. Uniform, not newest first: a
label is owed minibatches when it arrives, so a burst of similar requests already weighs
more in the next updates, and a minibatch half made of the newest rows would let the
latest few labels pull the probe away from everything else it holds. Features are standardized by running moments, which the massive
activations of a few hidden dimensions would otherwise dominate.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from worker_service.step import Prefill


@dataclass(frozen=True)
class ProbeConfig:
    bucket_tokens: int = 50
    buckets: int = 21  # the last one open: >= (buckets - 1) * bucket_tokens
    min_samples: int = 32  # exact labels before the first prediction
    window: int = 4096  # samples kept for replay, oldest out
    batch: int = 32
    updates: int = 4  # minibatches owed per learned sample
    max_owed: int = 256  # owed minibatches beyond this are forgiven (a burst of labels)
    lr: float = 0.01
    weight_decay: float = 1e-3
    max_pending: int = 4096  # features of sequences waiting for their label
    seed: int = 0


class LengthProbe:
    """Features in, predicted output tokens out; learns from finished sequences."""

    def __init__(self, hidden_size: int, cfg: ProbeConfig = ProbeConfig()):
        self.cfg = cfg
        k = cfg.buckets
        self._w = torch.zeros(hidden_size, k)
        self._b = torch.zeros(k)
        self._ks = torch.arange(k)[None, :]
        self._moments = [(torch.zeros_like(t), torch.zeros_like(t)) for t in (self._w, self._b)]
        self._steps = [0, 0]
        self._gen = torch.Generator().manual_seed(cfg.seed)
        # Replay buffer: features, bucket, censored (label is a lower bound).
        self._x = torch.zeros(cfg.window, hidden_size)
        self._y = torch.zeros(cfg.window, dtype=torch.long)
        self._censored = torch.zeros(cfg.window, dtype=torch.bool)
        self._stored = 0  # samples ever stored; slot = stored % window
        self._owed = 0  # minibatches owed to the samples stored since the last train
        # Running moments of every feature learned from (Welford), for standardizing.
        self._n = 0
        self._mean = torch.zeros(hidden_size)
        self._m2 = torch.zeros(hidden_size)
        # Per bucket: the sum and count of exact lengths learned in it, and of censored
        # ones (cut lengths).
        self._len_sum = torch.zeros(k, dtype=torch.float64)
        self._len_n = torch.zeros(k, dtype=torch.float64)
        self._cut_sum = torch.zeros(k, dtype=torch.float64)
        self._cut_n = torch.zeros(k, dtype=torch.float64)
        self.exact = 0  # exact labels learned
        self.censored = 0  # censored labels learned
        self._pending: OrderedDict[int, torch.Tensor] = OrderedDict()

    # --- labels ----------------------------------------------------------------------

    def bucket(self, tokens: int) -> int:
        return min(max(tokens - 1, 0) // self.cfg.bucket_tokens, self.cfg.buckets - 1)

    def _values(self) -> torch.Tensor:
        """Each bucket's representative length: the mean exact length learned in it, else
        the mean cut (a lower bound)."""
        cuts = self._cut_sum / self._cut_n.clamp_min(1)
        return torch.where(self._len_n > 0, self._len_sum / self._len_n.clamp_min(1), cuts)

    # --- per sequence (the engine's calls) ---------------------------------------------

    def observe(self, seq_id: int, hidden: torch.Tensor) -> int | None:
        """A sequence's prompt-last hidden state: keep it for its label and predict."""
        with torch.inference_mode(False):  # a plain copy: it is trained on later
            x = hidden.detach().float().reshape(-1).cpu().clone()
        self._pending[seq_id] = x
        self._pending.move_to_end(seq_id)
        while len(self._pending) > self.cfg.max_pending:
            self._pending.popitem(last=False)
        return self.predict(x)

    def finished(self, seq_id: int, generated: int, exact: bool) -> None:
        """A sequence ended with `generated` tokens: by EOS or stop (`exact`), or cut or
        cancelled (its length is at least `generated`)."""
        x = self._pending.pop(seq_id, None)
        if x is not None:
            self.learn(x, generated, exact)

    def forget(self) -> None:
        """Drop the features waiting for labels (the scheduler reconnected: its sequence
        ids start over). What was learned stays."""
        self._pending.clear()

    # --- the model -------------------------------------------------------------------

    def _standardize(self, x: torch.Tensor) -> torch.Tensor:
        var = self._m2 / max(self._n - 1, 1)
        return (x - self._mean) / var.sqrt().clamp_min(1e-3)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> int | None:
        if self.exact < self.cfg.min_samples:
            return None
        logits = self._standardize(x) @ self._w + self._b
        reached = (self._len_n + self._cut_n) > 0
        p = torch.softmax(logits.masked_fill(~reached, -math.inf), -1).double()
        return max(1, round(float(p @ self._values())))

    def learn(self, x: torch.Tensor, generated: int, exact: bool) -> None:
        """Store one labelled sample; `train` fits it later."""
        b = self.bucket(generated)
        if not exact and b == 0:
            return  # at least a few tokens: every bucket allows that, nothing to learn
        slot = self._stored % self.cfg.window
        self._x[slot], self._y[slot], self._censored[slot] = x, b, not exact
        self._stored += 1
        self._owed = min(self._owed + self.cfg.updates, self.cfg.max_owed)
        self._n += 1
        delta = x - self._mean
        self._mean += delta / self._n
        self._m2 += delta * (x - self._mean)
        if exact:
            self.exact += 1
            self._len_sum[b] += generated
            self._len_n[b] += 1
        else:
            self.censored += 1
            self._cut_sum[b] += generated
            self._cut_n[b] += 1

    def train(self, max_batches: int = 2) -> int:
        """Run up to `max_batches` of the minibatches owed; returns how many ran."""
        ran = 0
        while self._owed > 0 and ran < max_batches:
            self._minibatch()
            self._owed -= 1
            ran += 1
        return ran

    @torch.no_grad()
    def _minibatch(self) -> None:
        """One Adam step of the (censored) log-likelihood, its gradient by hand: autograd's
        bookkeeping would cost more than the arithmetic of a 32-row softmax."""
        cfg = self.cfg
        idx = self._rows()
        x, y, cens = self._standardize(self._x[idx]), self._y[idx], self._censored[idx]
        p = torch.softmax(x @ self._w + self._b, -1)
        # d(-log P(bucket = y))/dlogits = p - onehot(y); censored, d(-log P(bucket >= y))
        # = p - p restricted to buckets >= y and renormalized.
        target = torch.zeros_like(p).scatter_(1, y[:, None], 1.0)
        upper = p * (self._ks >= y[:, None])
        upper /= upper.sum(-1, keepdim=True).clamp_min(1e-12)
        g = p - torch.where(cens[:, None], upper, target)
        self._adam(0, x.T @ g / cfg.batch + cfg.weight_decay * self._w, self._w)
        self._adam(1, g.mean(0), self._b)

    def _rows(self) -> torch.Tensor:
        """A minibatch's rows: uniform over the samples held (the window's slots once it
        has wrapped), from the probe's seeded generator."""
        held = min(self._stored, self.cfg.window)
        return torch.randint(held, (self.cfg.batch,), generator=self._gen)

    def _adam(self, i: int, grad: torch.Tensor, param: torch.Tensor) -> None:
        m, v = self._moments[i]
        self._steps[i] += 1
        t = self._steps[i]
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        step = self.cfg.lr * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        param.addcdiv_(m, v.sqrt().add_(1e-8), value=-step)

    # --- the engine's hook-up ----------------------------------------------------------

    def observe_prefills(self, prefills: list[Prefill], hidden: torch.Tensor,
                         tokens: list[int]) -> dict[int, int]:
        """Predictions for the sequences whose prompt's last chunk this forward ran, from
        `hidden` (the forward's final hidden states at its token indices `tokens`, which
        hold every sampled prompt's last) at their last prompt position. A re-admitted
        sequence (tokens generated before) or a beam search gets none."""
        first = [p for p in prefills if p.final and p.seq.num_generated == 0 and not p.seq.beam]
        if not first:
            return {}
        at = {token: i for i, token in enumerate(tokens)}
        rows = hidden[[at[p.segment.token_start + p.segment.num_tokens - 1] for p in first]]
        rows = rows.float().cpu()  # one copy off the device for all of them
        out = {}
        for p, row in zip(first, rows):
            predicted = self.observe(p.seq.seq_id, row)
            if predicted is not None:
                out[p.seq.seq_id] = predicted
        return out
