"""Sync calls off the event loop on daemon threads, each bounded from its start and abandoned past it.

``in_thread`` runs one call on a thread of its own; ``CallThread`` runs a series of calls in order on
one thread (an object bound to the thread that made it stays usable). Not the loop's default
executor (``asyncio.to_thread``): a hung call would hold one of its few threads for good, and
``asyncio.run`` waits for those threads at exit. Rewards and environments use these, and so does the
SGLang weight sender for its group rendezvous.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import traceback
from typing import Any, Callable

__all__ = ["CallThread", "in_thread"]

log = logging.getLogger(__name__)


async def in_thread(fn: Callable, *args: Any, timeout_s: float, what: str,
                    late: Callable[[Any], None] | None = None) -> Any:
    """``fn(*args)`` on a daemon thread of its own, awaited at most ``timeout_s`` from the call's
    start; past it ``TimeoutError(what)``, and the thread is abandoned (a sync function cannot be
    interrupted). Not the loop's default executor (``asyncio.to_thread``): a hung call would hold
    one of its few threads for good, so later calls (a weight receive included) would wait behind
    it, and ``asyncio.run`` would wait for it at exit. ``late(value)`` runs on the abandoned thread
    with what the call returned after all (e.g. to close an environment made too late)."""
    call = _Call(asyncio.get_running_loop(), fn, args, late)
    threading.Thread(target=call.run, name="meshrl-call", daemon=True).start()
    return await call.result(timeout_s, what)


class CallThread:
    """One daemon thread that runs the sync calls given to it, one after another, each awaited as
    ``in_thread`` awaits its own (bounded from the call's start, abandoned past it). An environment's
    factory and methods all go to one, so an object bound to the thread that made it (an sqlite
    connection, a sync Playwright browser, a GL context) works. ``close()`` ends the thread after
    the calls given so far. A call waits for the ones before it, and its timeout counts that wait:
    behind a call that hangs, it times out too, and runs if that one ever returns (an environment's
    ``close`` after a hung ``step``: the object is only ever touched from its own thread)."""

    def __init__(self, name: str = "meshrl-env") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable, *args: Any, timeout_s: float, what: str,
                   late: Callable[[Any], None] | None = None) -> Any:
        job = _Call(asyncio.get_running_loop(), fn, args, late)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return await job.result(timeout_s, what)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()


class _Call:
    """One sync call and the hand-over of its outcome to the event loop that awaits it (or, once
    that gave up, to ``late``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple, late: Callable[[Any], None] | None):
        self.loop, self.fn, self.args, self.late = loop, fn, args, late
        self.done = loop.create_future()
        self.lock = threading.Lock()
        self.abandoned = self.delivered = False

    def run(self) -> None:  # on the worker thread
        value, error = None, None
        try:  # also when its caller gave up while it waited in a CallThread's queue (a close after a hung step)
            value = self.fn(*self.args)
        except Exception as exc:  # the caller's to judge
            error = exc
        except BaseException as exc:  # SystemExit and the like: raised into the loop they would end it
            error = RuntimeError(f"{getattr(self.fn, '__qualname__', self.fn)} raised {type(exc).__name__}: {exc}")
        with self.lock:
            self.delivered = not self.abandoned
        if self.delivered:
            try:
                self.loop.call_soon_threadsafe(self._settle, value, error)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for the value
                pass
        elif self.late is not None and error is None and value is not None:
            try:
                self.late(value)
            except Exception:
                log.warning("cleaning up after an abandoned call of %s failed:\n%s",
                            getattr(self.fn, "__qualname__", self.fn), traceback.format_exc())

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(value) if error is None else self.done.set_exception(error)

    async def result(self, timeout_s: float, what: str) -> Any:
        try:
            # waits for: the call to return; unblocked by: run's settle (or the timeout)
            return await asyncio.wait_for(asyncio.shield(self.done), None if math.isinf(timeout_s) else timeout_s)
        except asyncio.TimeoutError:
            with self.lock:
                self.abandoned = not self.delivered
            if not self.abandoned:  # it returned just now: its value is on its way
                return await self.done
            raise TimeoutError(what) from None
        except asyncio.CancelledError:
            with self.lock:
                self.abandoned = True  # a value not delivered yet goes to ``late``
            raise
