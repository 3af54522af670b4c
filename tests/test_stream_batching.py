"""A client stream that fell behind catches up in one message: the server's take-up of
the queued events (frontend.take_pending), the message of several tokens
(grpc_api.token_response) and the client reading it back token by token (client.api)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from seqserve.v1 import generate_pb2

from client.api import response_tokens, to_chunk, to_chunks
from scheduler_service.frontend import Frontend, take_pending
from scheduler_service.grpc_api import token_response
from scheduler_service.sequence import FinishEvent, FinishReason, TokenEvent

EVENTS = [TokenEvent(5, "Hel"),
          TokenEvent(6, "", -0.5, [(6, -0.5), (9, -1.25)], ["lo", " x"]),
          TokenEvent(7, "lo wörld", -0.125, [], [])]


def _queue(events) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for e in events:
        q.put_nowait(e)
    return q


def test_take_pending_takes_what_is_queued_up_to_the_finish_and_the_limit() -> None:
    end = FinishEvent(FinishReason.LENGTH, "", 3, 4, 0)
    q = _queue([EVENTS[1], end, EVENTS[2]])
    assert take_pending(q, EVENTS[0]) == [EVENTS[0], EVENTS[1], end]
    assert q.qsize() == 1  # nothing is taken past a finish
    q = _queue(EVENTS * 3)
    assert take_pending(q, EVENTS[0], limit=4) == [EVENTS[0], *EVENTS]
    assert q.qsize() == 6
    assert take_pending(_queue([]), EVENTS[0]) == [EVENTS[0]]


def test_several_tokens_in_one_message_read_back_as_one_by_one() -> None:
    one_by_one = [to_chunk(token_response("r", [e])) for e in EVENTS]
    wire = token_response("r", EVENTS).SerializeToString()
    msg = generate_pb2.GenerateResponse.FromString(wire)
    assert not msg.HasField("token") and msg.text == "Hello wörld"
    assert to_chunks(msg) == one_by_one
    assert [t.id for t in response_tokens(msg)] == [5, 6, 7]
    assert [c.token_id for c in one_by_one] == [5, 6, 7]
    assert one_by_one[1].logprob == -0.5 and one_by_one[1].top_logprobs == [(6, -0.5), (9, -1.25)]


def test_one_token_goes_in_the_token_field_as_before() -> None:
    msg = token_response("r", EVENTS[:1])
    assert msg.HasField("token") and not msg.tokens and msg.text == "Hel"
    assert [c.token_id for c in to_chunks(msg)] == [5]
    assert [t.id for t in response_tokens(msg)] == [5]


def _frontend() -> tuple[Frontend, list]:
    cancelled: list = []
    frontend = Frontend(lambda code: None)
    frontend.state = SimpleNamespace(workers=SimpleNamespace(cancel=cancelled.append))
    return frontend, cancelled


def test_events_one_by_one_and_batches_together_each_cancelling_when_left_early() -> None:
    end = FinishEvent(FinishReason.LENGTH, "", 3, 3, 0)

    async def scenario():
        frontend, cancelled = _frontend()
        seq = SimpleNamespace(events=_queue([*EVENTS, end]))
        one_by_one = [e async for e in frontend.events(seq)]
        seq = SimpleNamespace(events=_queue([*EVENTS, end]))
        batches = [b async for b in frontend.event_batches(seq)]
        assert cancelled == []  # both ran to the FinishEvent
        left = SimpleNamespace(events=_queue(EVENTS))
        events = frontend.events(left)
        assert await events.__anext__() == EVENTS[0]
        await events.aclose()  # the client went away after one token
        assert cancelled == [left]  # at once, not when the collector finds the generator
        return one_by_one, batches

    one_by_one, batches = asyncio.run(scenario())
    assert one_by_one == [*EVENTS, end]
    assert batches == [[*EVENTS, end]]


def test_all_events_wakes_once_at_the_end_and_cancels_when_the_caller_is() -> None:
    """A reply that is not streamed (GenerateUnary, /invocations) waits for the sequence's
    end, which emit_finish signals, not for each token, and gets every event in order."""
    from scheduler_service.output import emit_finish

    def sequence():
        return SimpleNamespace(events=asyncio.Queue(), ended=asyncio.Event(), prompt_ids=[1],
                               output_ids=[5, 6, 7], cached_tokens=0, hypotheses=None)

    async def scenario():
        frontend, cancelled = _frontend()
        seq = sequence()
        waiter = asyncio.create_task(frontend.all_events(seq))
        for e in EVENTS:
            seq.events.put_nowait(e)
            await asyncio.sleep(0)
            assert not waiter.done()  # a token does not end the wait
        emit_finish(seq, FinishReason.ERROR, "worker lost")
        got = await asyncio.wait_for(waiter, 5)
        left = sequence()
        waiter = asyncio.create_task(frontend.all_events(left))
        await asyncio.sleep(0)
        waiter.cancel()  # the client went away
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        return got, cancelled, left

    got, cancelled, left = asyncio.run(scenario())
    assert got[:-1] == EVENTS and got[-1].reason == FinishReason.ERROR
    assert got[-1].error == "worker lost" and got[-1].generated_tokens == 3
    assert cancelled == [left]
