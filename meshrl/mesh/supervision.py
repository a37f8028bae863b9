"""Supervision: restart dead actors with Ray's own machinery and tell the owner.

``ProcMesh.spawn(..., max_restarts=N, on_restart=cb)`` creates the actors with Ray's
``max_restarts=N`` (and ``max_task_retries=0``: a call in flight when the actor died fails with
``ActorFailure`` rather than running twice). Ray re-runs the actor's ``__init__`` with the same
arguments in the same placement-group bundle; the new incarnation starts from a fresh object.

To notice deaths without polling, the owner keeps one *sentinel* call pending on every supervised
actor: ``_meshrl_watch`` never returns and runs in its own Ray concurrency group, so it never
takes the actor's own execution slot. One daemon thread per owner process waits on all sentinels
with ``ray.wait``. When a sentinel fails, the actor died; the thread waits for ``__ray_ready__`` of
the restarted actor and then calls ``on_restart(RestartEvent(...))``. If the restart budget is
spent, the death is logged and callers get ``ActorFailure`` from Ray as usual.

Where the callback runs: on the event loop that was running when ``spawn`` was called (via
``call_soon_threadsafe``; a coroutine result is scheduled there as a task), otherwise on the
supervision thread. A callback's exception is logged, never raised.

``stop()`` unwatches before it kills, and an unwatch also holds while the thread is busy with that
actor (e.g. running its callback): a deliberately stopped actor is never reported as dead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import ray

from meshrl.mesh.actor import WATCH_GROUP

log = logging.getLogger("meshrl.mesh")

POLL_S = 0.5
"""How often the supervision thread looks for newly watched actors while none has failed."""


class RestartEvent(msgspec.Struct, frozen=True):
    """An actor of a supervised mesh died and Ray restarted it."""

    mesh: str
    """Name of the actor mesh."""
    rank: int
    """Flat rank of the restarted actor in its spawned mesh."""
    cause: str
    """Ray's description of the death (signal, exit code, node loss...)."""
    restarts: int
    """How many times this actor has been restarted so far (1 after the first restart)."""


@dataclass(eq=False)
class _Watched:
    handle: Any
    mesh: str
    uid: str
    proc_uid: str
    rank: int
    on_restart: Callable[[RestartEvent], Any] | None
    loop: asyncio.AbstractEventLoop | None
    restarts: int = 0
    cause: str = ""
    ref: Any = field(default=None)

    def arm(self) -> None:
        self.ref = self.handle._meshrl_watch.options(concurrency_group=WATCH_GROUP).remote()


class _Supervisor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ref: dict[Any, _Watched] = {}
        self._thread: threading.Thread | None = None

    def watch(self, entries: list[_Watched]) -> None:
        with self._lock:
            for entry in entries:
                entry.arm()
                self._by_ref[entry.ref] = entry
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="meshrl-supervisor", daemon=True)
                self._thread.start()

    def unwatch(self, match: Callable[[_Watched], bool]) -> None:
        with self._lock:
            for ref in [r for r, e in self._by_ref.items() if match(e)]:
                del self._by_ref[ref]

    def _run(self) -> None:
        while True:
            with self._lock:
                refs = list(self._by_ref)
                if not refs:
                    self._thread = None
                    return
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
            except Exception as exc:  # Ray was shut down under us: nothing left to supervise
                log.debug("supervision stops: %s", exc)
                with self._lock:
                    self._by_ref.clear()
                    self._thread = None
                return
            for ref in ready:
                with self._lock:
                    entry = self._by_ref.get(ref)
                if entry is None:  # unwatched: its mesh was stopped on purpose
                    continue
                # the entry stays under `ref` while it advances (which runs a loop-less on_restart
                # here, for as long as it takes), so that an unwatch meanwhile still removes it
                keep = self._advance(entry, ref)
                with self._lock:
                    if self._by_ref.pop(ref, None) is entry and keep:
                        self._by_ref[entry.ref] = entry

    def _advance(self, entry: _Watched, ref: Any) -> bool:
        """Act on ``entry``'s ready ``ref``; re-arm ``entry.ref`` and return True to watch on."""
        try:
            ray.get(ref, timeout=0)
            if entry.cause:  # the restarted actor answered __ray_ready__
                entry.restarts += 1
                self._deliver(entry, RestartEvent(entry.mesh, entry.rank, entry.cause, entry.restarts))
                entry.cause = ""
                entry.arm()
            else:  # a sentinel returned: only happens if someone called it by hand; re-arm
                entry.arm()
        except ray.exceptions.RayActorError as exc:
            if entry.cause:
                log.error("actor %s/%d died and was not restarted: %s", entry.mesh, entry.rank, exc)
                return False
            entry.cause = str(exc)
            log.warning("actor %s/%d died (%s); waiting for its restart", entry.mesh, entry.rank, entry.cause)
            entry.ref = _revival(entry.handle)
        except Exception as exc:
            log.error("supervising actor %s/%d: %s", entry.mesh, entry.rank, exc)
            return False
        return True

    @staticmethod
    def _deliver(entry: _Watched, event: RestartEvent) -> None:
        if entry.on_restart is None:
            log.warning("actor %s/%d restarted (restart %d)", event.mesh, event.rank, event.restarts)
            return
        callback = entry.on_restart

        def failed(exc: BaseException) -> None:
            log.error("on_restart callback for %s/%d failed", event.mesh, event.rank, exc_info=exc)

        def call() -> None:
            try:
                result = callback(event)
                if inspect.isawaitable(result):
                    if entry.loop is not None and not entry.loop.is_closed():
                        task = asyncio.ensure_future(result, loop=entry.loop)
                        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or failed(t.exception()))
                    else:  # spawned inside an asyncio.run() that has returned: run it here
                        asyncio.run(_awaited(result))
            except Exception as exc:
                failed(exc)

        loop = entry.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(call)
                return
            except RuntimeError:  # the loop closed just now
                pass
        call()


def _revival(handle: Any) -> Any:
    """A call that answers once the restarted actor is up (Ray retries it while it restarts)."""
    return handle.__ray_ready__.options(max_task_retries=-1).remote()


async def _awaited(result: Any) -> Any:
    return await result


_supervisor = _Supervisor()


def watch(
    handles: list[Any],
    ranks: list[int],
    mesh: str,
    uid: str,
    proc_uid: str,
    on_restart: Callable[[RestartEvent], Any] | None,
) -> None:
    """Supervise the actors ``handles`` (ranks ``ranks`` of mesh ``mesh``)."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    _supervisor.watch(
        [_Watched(h, mesh, uid, proc_uid, r, on_restart, loop) for h, r in zip(handles, ranks)]
    )


def unwatch(uid: str, ranks: set[int]) -> None:
    """Stop supervising ranks ``ranks`` of mesh ``uid`` (before killing them on purpose)."""
    _supervisor.unwatch(lambda e: e.uid == uid and e.rank in ranks)


def unwatch_procs(proc_uid: str) -> None:
    """Stop supervising every actor spawned on proc mesh ``proc_uid``."""
    _supervisor.unwatch(lambda e: e.proc_uid == proc_uid)
