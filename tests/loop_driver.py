"""Drive the scheduler's IterationLoop in-process against a fake worker (no gRPC)."""

from __future__ import annotations

import asyncio

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.loop import IterationLoop
from scheduler_service.params import DecodingConfig
from scheduler_service.sequence import FinishEvent, Sequence
from seqserve_common.decoding import DecodingStrategy


def greedy_sequence(loop: IterationLoop, tok, text: str, max_new_tokens: int) -> Sequence:
    ids = tok(text).input_ids
    return Sequence(seq_id=loop.new_seq_id(), request_id=text, prompt_ids=ids,
                    params=DecodingConfig(max_new_tokens=max_new_tokens, strategy=DecodingStrategy.GREEDY),
                    detokenizer=IncrementalDetokenizer(tok, ids), stops=StopMatcher(()))


async def run_to_the_end(loop: IterationLoop, seqs: list[Sequence],
                         timeout: float = 30) -> tuple[asyncio.Task, list[FinishEvent]]:
    """Submit `seqs`, start the loop, and wait for every FinishEvent; the loop task is left
    running for the caller to stop."""
    for s in seqs:
        loop.submit(s)
    task = asyncio.create_task(loop.run())

    async def finish(s: Sequence) -> FinishEvent:
        while True:
            ev = await s.events.get()
            if isinstance(ev, FinishEvent):
                return ev
    ends = await asyncio.wait_for(asyncio.gather(*(finish(s) for s in seqs)), timeout)
    return task, list(ends)
