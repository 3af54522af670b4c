"""How the ranks of a tensor-parallel group run the same Steps.

Only rank 0 hears from the scheduler (one Steps stream, one address). Every call that
changes the engine's state or runs the model (a Step, a reset, the lease's drop, the
warm-up) is broadcast over the process group to ranks 1..T-1 before rank 0 runs it, and
each follower runs the same call on its own engine. All ranks then issue the model's
collectives in the same order, hold the same sequences in the same groups (each with the
KV of its own heads), and pick the same tokens: the logits are all-gathered, so every
rank sees the same values, and sampling draws from generators seeded per sequence and
token. Rank 0 alone answers the scheduler.

Why a broadcast rather than a Step stream from the scheduler to every rank: the order of
calls on every rank is then rank 0's by construction (a Reset cannot overtake a Step on
one rank only), the scheduler and its recovery stay unchanged (a group is one worker),
and the cost is small: one gloo broadcast of a pickled call per Step (docs/architecture.md
has the measured numbers). Pickle is safe here: only the group's own ranks, joined
through rank 0's rendezvous, are on the channel.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from concurrent.futures import CancelledError

import torch
import torch.distributed as dist

from worker_service.engine import Engine, StepError

logger = logging.getLogger(__name__)

# Engine calls that every rank must run (they change state or run collectives).
MIRRORED = frozenset({"step", "reset", "drop_sequences", "warm_up", "release"})
NOOP, STOP = "noop", "stop"
# An idle group exchanges a no-op this often, so a follower's wait never nears the group's
# timeout and rank 0 notices a dead follower even when no request comes (under torchrun,
# which has no launcher watching the ranks).
HEARTBEAT_SECONDS = 5.0


class ControlChannel:
    """Rank 0's calls to the other ranks, pickled and broadcast over gloo on CPU (control
    never touches an accelerator). One broadcast of a fixed-size frame carries the length
    and, for every Step but those admitting many prompts, the whole call; a longer call
    sends its remainder in a second broadcast."""

    FRAME = 4096  # bytes: a decoding step's plan of 64 sequences pickles to under 200

    def __init__(self, group=None):
        self.group = group
        self.sent = 0
        self.send_seconds = 0.0

    def send(self, call: tuple) -> None:
        t0 = time.perf_counter()
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        head = self.FRAME - 8
        frame = torch.zeros(self.FRAME, dtype=torch.uint8)
        frame[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")),
                                     dtype=torch.uint8)
        frame[8:8 + min(len(data), head)] = torch.frombuffer(bytearray(data[:head]),
                                                             dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.group)
        if len(data) > head:
            dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8),
                           src=0, group=self.group)
        self.sent += 1
        self.send_seconds += time.perf_counter() - t0

    def receive(self) -> tuple:
        frame = torch.empty(self.FRAME, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.group)
        size = int.from_bytes(frame[:8].numpy().tobytes(), "little")
        data = frame[8:8 + size].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def group_failed(what: str, exc: BaseException) -> None:
    """A rank or the channel between them failed: the group cannot go on with some ranks
    out of step. Exit rank 0 now (its followers die with it), so the scheduler sees its
    worker fail and re-prefills its requests once the group is restarted."""
    logger.critical("the tensor-parallel group has failed during %s (%s: %s); rank 0 "
                    "exits so that the scheduler recovers its requests", what,
                    type(exc).__name__, exc)
    logging.shutdown()
    os._exit(1)


class LeaderEngine:
    """Rank 0's engine: mirrored calls go to every rank first; everything else (state the
    servicer reads, such as `runner` or `sequences`) is rank 0's own engine's."""

    # Every rank would have to stop at the same layer for one: the group takes none.
    urgent_steps = False

    def __init__(self, engine: Engine, channel: ControlChannel | None = None):
        self._engine = engine
        self._channel = channel or ControlChannel()
        self._last_call = time.monotonic()

    def __getattr__(self, name: str):
        value = getattr(self._engine, name)
        if name not in MIRRORED:
            return value

        def mirrored(*args, **kwargs):
            self._call(name, args, kwargs)
            try:
                return value(*args, **kwargs)
            except StepError:
                raise  # every rank refused the same Step; the group is still in step
            except Exception as exc:  # noqa: BLE001 - ranks may now be out of step
                group_failed(name, exc)
        return mirrored

    def _call(self, name: str, args: tuple, kwargs: dict) -> None:
        try:
            self._channel.send((name, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - a follower is gone
            group_failed(f"the broadcast of {name}", exc)
        self._last_call = time.monotonic()

    def heartbeat(self) -> None:
        """A no-op every rank receives; fails (and exits the group) if one is gone."""
        if time.monotonic() - self._last_call >= HEARTBEAT_SECONDS:
            self._call(NOOP, (), {})

    def keep_alive(self, submit, stop: threading.Event) -> None:
        """Run until `stop`: heartbeats through `submit` (the compute thread, where every
        collective of rank 0 is issued, so they stay in order)."""
        while not stop.wait(HEARTBEAT_SECONDS / 2):
            try:
                submit(self.heartbeat).result()
            except (RuntimeError, CancelledError):  # the compute loop has stopped
                return

    def stop(self) -> None:
        """Tell the followers to exit (rank 0 is shutting down cleanly)."""
        try:
            self._channel.send((STOP, (), {}))
        except Exception as exc:  # noqa: BLE001 - nothing left to stop
            logger.warning("could not tell the other ranks to stop: %s", exc)
        channel = self._channel
        if channel.sent:
            logger.info("control broadcasts: %d calls, %.1f us each on average",
                        channel.sent, 1e6 * channel.send_seconds / channel.sent)


def follow(engine: Engine, channel: ControlChannel | None = None) -> int:
    """A follower's life: run rank 0's calls on `engine` until it says stop (returns 0)
    or the group fails (returns 1)."""
    channel = channel or ControlChannel()
    while True:
        try:
            name, args, kwargs = channel.receive()
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone
            logger.error("rank 0 is gone (%s: %s); this rank exits", type(exc).__name__, exc)
            return 1
        if name == STOP:
            return 0
        if name == NOOP:
            continue
        try:
            getattr(engine, name)(*args, **kwargs)
        except StepError:
            continue  # rank 0 refused the same Step and reports it to the scheduler
        except Exception:  # noqa: BLE001 - this rank is out of step with the others
            logger.exception("%s failed on this rank; the group cannot go on", name)
            return 1
