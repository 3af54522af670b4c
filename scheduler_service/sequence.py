"""A request as the scheduler tracks it, from waiting to finished."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.params import DecodingConfig


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class TokenEvent:
    """One generated token and the text it completed."""

    token_id: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob) alternatives, best first
    top_text: list[str] | None = None  # each alternative's text on its own, as `top`


@dataclass(frozen=True)
class Hypothesis:
    """One finished beam search hypothesis as returned to the client."""

    token_ids: list[int]
    text: str
    score: float
    reason: FinishReason  # EOS when it ends with an end-of-sequence token, else LENGTH


@dataclass
class FinishEvent:
    """The end of a generation: remaining text and counts."""

    reason: FinishReason
    text: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    error: str | None = None
    # Beam search: the num_return_sequences best hypotheses, best first (the first is
    # the one whose tokens were streamed).
    sequences: list[Hypothesis] | None = None


@dataclass
class Sequence:
    """One request. The loop fills `events`; the RPC handler drains it to the client."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: DecodingConfig
    # Text side; None in the core of a split deployment (the front end has them).
    detokenizer: IncrementalDetokenizer | None
    stops: StopMatcher | None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    pin_tokens: int = 0  # leading tokens of the cached_prompt (pinned in the prefix cache)
    sampling_seed: int | None = None  # fixed at admission so a re-prefill draws the same
    in_flight: int = 0  # tokens of this sequence in Steps sent but not yet answered
    # Chunked prefill: the tokens to prefill when admitted (prompt, and those generated
    # before a re-admission), and how many of them the Steps sent so far prefill.
    prefill_target: int = 0
    prefilled: int = 0
    worker: str = ""  # address of the worker it is placed on (worker_pool.py)
    released: bool = False  # the worker was told to drop it (its last token is in flight)
    # Beam search: steps the worker's beams advanced (their tokens come at the end), and
    # then the hypotheses it returned.
    beam_steps: int = 0
    hypotheses: list[Hypothesis] | None = None
    # Scheduling (scheduler_service/policies): lower is more urgent, as in vLLM.
    priority: int = 0
    aged_steps: int = 0  # Steps spent waiting before the current wait (aging credit)
    enqueued_step: int = 0  # the waiting queue's clock when the current wait began
    # Id of the Step that (re)prefilled it: tokens of earlier Steps belong to a run that
    # was preempted and are dropped.
    admitted_step: int = 0
    preemptions: int = 0
    # Preempted by swap (preemption.py): its KV waits in the worker's host memory, and its
    # re-admission copies it back instead of prefilling.
    swapped: bool = False
    # Policy length-aware: the predicted output length, and the new tokens KV is
    # reserved for (None: max_new_tokens).
    predicted_tokens: int | None = None
    reserve_new_tokens: int | None = None
    # The client's expected output length (policy length-batched uses it as the
    # prediction), and a benchmark's EOS position that no policy reads (generate.proto).
    length_hint: int | None = None
    eos_after_tokens: int | None = None
    # The worker's prediction from the prompt's hidden state, with the first token.
    hidden_predicted_tokens: int | None = None
    # Kept on the request, not in a policy, because a request may move to another
    # worker's loop and policy (data parallel): stopped by FCR at its group's limit
    # (length-batched: it is not stopped or counted again), and learned from by the
    # shared length predictor (a policy that also admitted it does not learn it again).
    fcr_failed: bool = False
    length_learned: bool = False
    # Where its tokens go (output.OutputSink); None: events in this process.
    sink: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set with the FinishEvent (output.emit_finish): a reply that is not streamed waits
    # for it once instead of waking for every token.
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def generated(self) -> int:
        """Tokens generated so far: received, or the steps a beam search advanced."""
        return len(self.output_ids) + self.beam_steps

    @property
    def length(self) -> int:
        """KV length of each of its rows once the Steps in flight are answered: prompt,
        generated and in-flight tokens (what the partition balances). A sequence still
        prefilling counts its whole prompt: the worker reserves that room at once, and its
        row then stays in one group over its chunks instead of moving as it grows."""
        return len(self.prompt_ids) + self.generated + self.in_flight

    @property
    def rows(self) -> int:
        """Rows it occupies on the worker: one, or one per beam."""
        return self.params.rows

    def start_running(self, now: float) -> bool:
        """Admitted into the running batch (again, after a preemption or a worker failure):
        the worker prefills its prompt and any tokens it produced before, or swaps its KV
        back in. Returns whether
        this is its first admission; its sampling seed is fixed then, so a re-prefill draws
        the same tokens."""
        self.status = Status.RUNNING
        # A swapped-out sequence prefills nothing: its KV comes back from host memory.
        target = 0 if self.swapped else len(self.prompt_ids) + len(self.output_ids)
        self.prefill_target, self.prefilled = target, 0
        if self.sampling_seed is None:
            self.sampling_seed = random.getrandbits(63)
        first = self.scheduled_time is None
        if first:
            self.scheduled_time = now
        return first

    @property
    def prefilling(self) -> bool:
        """Admitted, and part of its prompt is in no Step sent yet: no token comes back for it
        until a Step with its last chunk."""
        return self.prefilled < self.prefill_target

    @property
    def advancing(self) -> bool:
        """Whether it needs another Step: its length limit is not met by the tokens
        received and those in flight (an EOS or stop string may still end it sooner)."""
        return self.generated + self.in_flight < self.params.max_new_tokens

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this request may grow to (every row of a beam search); admission
        reserves them up front."""
        new = self.params.max_new_tokens if self.reserve_new_tokens is None else \
            self.reserve_new_tokens
        return (len(self.prompt_ids) + new) * self.rows

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
