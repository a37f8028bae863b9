"""What a calling process remembers about a mesh: outstanding calls per actor, broadcast failures.

One ``MeshState`` per spawned mesh per process, shared by every view and every unpickled copy of
that mesh in the process (looked up by the mesh's id), so "outstanding calls from this caller"
means from this process.

- ``outstanding[rank]``: calls sent and not yet collected by the caller (awaited, ``.get()``,
  streamed, or the future dropped) or, for broadcasts, not yet seen finished. ``choose`` reads it.
- Broadcasts: their refs are kept and checked without blocking (``ray.wait(..., timeout=0)``)
  at the start of every other adverb on the mesh, every ``CHECK_EVERY`` broadcasts, and by ``flush``
  (which waits for the ones sent before it, never holding a lock while it waits). A failure is
  logged when seen and raised by that adverb or ``flush``; the oldest is raised, the rest were
  logged. A mesh's state stays alive while it has broadcasts in flight or failures not raised yet,
  even when no copy of the mesh is left in this process: the next copy (an actor gets the mesh
  again) reports them. Checking lazily instead of with a completion callback
  per call keeps a broadcast as cheap as a raw ``.remote()`` (a callback per call costs a thread
  hop and a deserialization on Ray's thread while the caller runs).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import weakref
from typing import Any, Generator, NamedTuple

import ray

from meshrl.mesh.errors import translate

log = logging.getLogger("meshrl.mesh")

CHECK_EVERY = 1024
"""Pending broadcast calls after which ``broadcast`` itself looks for finished ones (bounds memory)."""


class _Sent(NamedTuple):
    ref: Any
    mesh: str
    rank: int
    method: str


class MeshState:
    """Per-process bookkeeping shared by every view (slice, copy) of one spawned mesh."""

    def __init__(self, size: int, uid: str = ""):
        self.uid = uid
        # Reentrant: a dropped future releases its count from ``__del__``, which the garbage
        # collector may run while this thread already holds the lock.
        self.lock = threading.RLock()
        self.outstanding = [0] * size
        self.next_choice = 0
        self.broadcasts: list[_Sent] = []  # broadcast calls not yet seen finished
        self._checking = threading.Lock()  # one checker at a time, so a call is collected once
        self.errors: collections.deque[BaseException] = collections.deque()

    def release(self, ranks: tuple[int, ...] | list[int]) -> None:
        with self.lock:
            for rank in ranks:
                self.outstanding[rank] -= 1

    def sent(self, refs: list[Any], mesh: str, ranks: tuple[int, ...], method: str) -> None:
        """Remember broadcast calls (their outstanding counts were taken at submission)."""
        with self.lock:
            self.broadcasts.extend(_Sent(ref, mesh, rank, method) for ref, rank in zip(refs, ranks))
            many = len(self.broadcasts) >= CHECK_EVERY
        _pin(self)
        if many:
            self.check()

    def check(self) -> bool:
        """Collect finished broadcasts, without waiting; True if none is left pending."""
        with self._checking:
            with self.lock:
                pending = list(self.broadcasts)
            if not pending:
                return True
            refs = [s.ref for s in pending]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            done = [s for s in pending if s.ref in ready]
            if done:
                try:
                    ray.get([s.ref for s in done])
                except ray.exceptions.RayError:
                    self._record_failures(done)
            with self.lock:
                finished = {id(s) for s in done}
                self.broadcasts = [s for s in self.broadcasts if id(s) not in finished]
                for s in done:
                    self.outstanding[s.rank] -= 1
                idle = not self.broadcasts
            if idle and not self.errors:
                _unpin(self)
            return idle

    def _record_failures(self, done: list[_Sent]) -> None:
        for s in done:
            try:
                ray.get(s.ref)
            except ray.exceptions.RayError as exc:
                err = translate(exc, s.mesh, s.rank, s.method)
                log.error("broadcast of `%s` to %s/%d failed: %s", s.method, s.mesh, s.rank, err)
                self.errors.append(err)

    def raise_errors(self) -> None:
        """Raise the oldest unreported broadcast failure (the rest were logged) and forget them."""
        if not self.errors:
            return
        errors = list(self.errors)
        self.errors.clear()
        if not self.broadcasts:
            _unpin(self)
        first = errors[0]
        if len(errors) > 1 and isinstance(first, Exception):
            first.add_note(f"{len(errors) - 1} more broadcast failure(s) were logged")
        raise first


class Flush:
    """Done when every broadcast sent before it finished; raises the first failure seen.

    ``get`` blocks (synchronous code); ``await`` waits on the event loop (no thread: cancelling the
    await ends the wait); ``within(s)`` bounds the await. Broadcasts sent after ``flush()`` are not
    waited for."""

    def __init__(self, mesh: str, state: MeshState):
        self._mesh = mesh
        self._state = state
        with state.lock:
            self._refs = [s.ref for s in state.broadcasts]

    def get(self, timeout: float | None = None) -> None:
        if self._refs:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=timeout)
            if len(ready) < len(self._refs):
                raise self._timeout(len(self._refs) - len(ready), timeout)
        self._state.check()
        self._state.raise_errors()

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait(None).__await__()

    async def within(self, seconds: float) -> None:
        await self._wait(seconds)

    async def _wait(self, timeout: float | None) -> None:
        # waits for: the broadcasts sent before the flush; unblocked by: each actor finishing its call
        waits = [asyncio.wrap_future(ref.future()) for ref in self._refs]
        if waits:
            done, pending = await asyncio.wait(waits, timeout=timeout)
            for w in pending:
                w.cancel()
            if pending:
                raise self._timeout(len(pending), timeout)
        self._state.check()
        self._state.raise_errors()

    def _timeout(self, left: int, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"flush of mesh {self._mesh!r}: {left} of the {len(self._refs)} broadcast call(s) sent "
                            f"before it did not finish within {timeout} s")


_states: weakref.WeakValueDictionary[str, MeshState] = weakref.WeakValueDictionary()
_states_lock = threading.Lock()


_pinned: dict[str, MeshState] = {}
"""States with broadcasts in flight or failures not raised: kept alive without a mesh copy."""


def _pin(state: MeshState) -> None:
    with _states_lock:
        _pinned[state.uid] = state


def _unpin(state: MeshState) -> None:
    with _states_lock:
        if _pinned.get(state.uid) is state:
            del _pinned[state.uid]


def state_for(uid: str, size: int) -> MeshState:
    """The one ``MeshState`` of mesh ``uid`` in this process."""
    with _states_lock:
        state = _states.get(uid)
        if state is None:
            state = _states[uid] = MeshState(size, uid)
        return state
