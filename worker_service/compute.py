"""Where the worker's torch work runs: one thread for model load and every Step.

OpenMP gives each thread that enters a parallel region its own team of compute threads.
gRPC runs each call on any of its pool's threads, so Steps there would leave several teams
behind; once libgomp manages more threads than there are cores it stops spinning between
parallel regions and sleeps instead, which on a 2-core machine made every forward about a
fifth slower. One thread, one team.

The serving process gives that job to its main thread (MainThreadExecutor). glibc serves
other threads from secondary arenas, which unmap any 64 MB heap that becomes wholly free,
whatever the trim threshold (host_memory.py): KV buffers that grow and shrink then fault in
fresh pages again. The main thread's heap keeps them mapped: the 64-request benchmark
burst (docs/benchmarks.md) replayed in process took 18.5-20.5 s, regrouping 1.0-1.3 s, on
a second thread, and 17.7-18.3 s, regrouping 0.5-0.6 s, on the main thread (70 k fewer
page faults).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)


def compute_thread() -> ThreadPoolExecutor:
    """A single background thread for the torch work (in-process use and tests)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


class MainThreadExecutor(Executor):
    """Runs submitted calls, one at a time, on the thread that calls `serve()`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._owner: int | None = None
        self._stopped = threading.Event()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._stopped.is_set():
            raise RuntimeError("the compute loop has stopped; no more work is taken")
        future: Future = Future()
        if threading.get_ident() == self._owner:
            # Called from the loop itself: waiting on the future would deadlock.
            self._run(future, fn, args, kwargs)
        else:
            self._calls.put((future, fn, args, kwargs))
        return future

    def serve(self) -> None:
        """Run calls until shutdown(); pending calls after that are cancelled."""
        self._owner = threading.get_ident()
        while not self._stopped.is_set():
            try:
                # A timeout, so a signal handler that calls shutdown() is seen promptly.
                item = self._calls.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is not None:
                self._run(*item)
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopped.set()
        self._calls.put(None)  # SimpleQueue.put is reentrant: safe in a signal handler

    @staticmethod
    def _run(future: Future, fn, args, kwargs) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)
