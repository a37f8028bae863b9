"""What a calling process remembers about a mesh: outstanding calls per actor, broadcast failures.

One ``MeshState`` per spawned mesh per process, shared by every view and every unpickled copy of
that mesh in the process (looked up by the mesh's id), so "outstanding calls from this caller"
means from this process.

- ``outstanding[rank]``: calls sent and not yet collected by the caller (awaited, ``.get()``,
  streamed, or the future dropped) or, for broadcasts, not yet finished. ``choose`` reads it.
- Broadcast failures: logged when they happen, kept until the next adverb on the mesh (or
  ``flush``) raises the oldest, then forgotten.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import weakref
from typing import Any, Generator

from meshrl.mesh.errors import translate

log = logging.getLogger("meshrl.mesh")


class MeshState:
    """Per-process bookkeeping shared by every view (slice, copy) of one spawned mesh."""

    def __init__(self, size: int):
        # Reentrant: a dropped future releases its count from ``__del__``, which the garbage
        # collector may run while this thread already holds the lock.
        self.lock = threading.RLock()
        self.outstanding = [0] * size
        self.next_choice = 0
        self.broadcasts: set[Any] = set()  # concurrent futures of unfinished broadcast calls
        self.broadcast_done_cv = threading.Condition(self.lock)
        self.errors: collections.deque[BaseException] = collections.deque()

    def release(self, ranks: tuple[int, ...] | list[int]) -> None:
        with self.lock:
            for rank in ranks:
                self.outstanding[rank] -= 1

    def broadcast_done(self, mesh: str, rank: int, method: str, cf: Any) -> None:
        exc = cf.exception()
        if exc is not None:
            err = translate(exc, mesh, rank, method)
            log.error("broadcast of `%s` to %s/%d failed: %s", method, mesh, rank, err)
            self.errors.append(err)
        with self.lock:
            self.outstanding[rank] -= 1
            self.broadcasts.discard(cf)
            self.broadcast_done_cv.notify_all()

    def raise_errors(self) -> None:
        """Raise the oldest unreported broadcast failure (the rest were logged) and forget them."""
        if not self.errors:
            return
        errors = list(self.errors)
        self.errors.clear()
        first = errors[0]
        if len(errors) > 1 and isinstance(first, Exception):
            first.add_note(f"{len(errors) - 1} more broadcast failure(s) were logged")
        raise first


class Flush:
    """Done when the broadcasts sent before it finished; raises their first failure."""

    def __init__(self, mesh: str, state: MeshState):
        self._mesh = mesh
        self._state = state
        with state.lock:
            self._pending = set(state.broadcasts)

    def get(self, timeout: float | None = None) -> None:
        state = self._state
        deadline = None if timeout is None else time.monotonic() + timeout
        with state.lock:
            while self._pending & state.broadcasts:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"flush of mesh {self._mesh!r}: {len(self._pending & state.broadcasts)} "
                        f"broadcast call(s) did not finish within {timeout} s"
                    )
                state.broadcast_done_cv.wait(left)
        state.raise_errors()

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.to_thread(self.get).__await__()

    async def within(self, seconds: float) -> None:
        await asyncio.to_thread(self.get, seconds)


_states: weakref.WeakValueDictionary[str, MeshState] = weakref.WeakValueDictionary()
_states_lock = threading.Lock()


def state_for(uid: str, size: int) -> MeshState:
    """The one ``MeshState`` of mesh ``uid`` in this process."""
    with _states_lock:
        state = _states.get(uid)
        if state is None:
            state = _states[uid] = MeshState(size)
        return state
