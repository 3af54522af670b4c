"""Decoding strategies: one enum for both processes, and its wire form."""

from __future__ import annotations

from enum import Enum

from seqserve.worker.v1 import worker_pb2


class DecodingStrategy(str, Enum):
    """How a sequence picks its tokens. The value is the name clients and options use."""

    GREEDY = "greedy"
    SAMPLE = "sample"
    CONTRASTIVE = "contrastive"
    BEAM = "beam"

    @property
    def interruptible(self) -> bool:
        """Whether an urgent Step may prefill it: greedy and sampled sequences keep no
        state across the rows of a Step that the urgent one may interrupt (contrastive and
        beam search do)."""
        return self in (DecodingStrategy.GREEDY, DecodingStrategy.SAMPLE)

    def to_proto(self) -> int:
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> "DecodingStrategy":
        return _FROM_PROTO[value]


_TO_PROTO = {DecodingStrategy.GREEDY: worker_pb2.SamplingParams.STRATEGY_GREEDY,
             DecodingStrategy.SAMPLE: worker_pb2.SamplingParams.STRATEGY_SAMPLE,
             DecodingStrategy.CONTRASTIVE: worker_pb2.SamplingParams.STRATEGY_CONTRASTIVE,
             DecodingStrategy.BEAM: worker_pb2.SamplingParams.STRATEGY_BEAM}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
