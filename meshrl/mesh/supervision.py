"""Supervision: restart dead actors with Ray's own machinery and tell the owner.

``ProcMesh.spawn(..., max_restarts=N, on_restart=cb)`` creates the actors with Ray's
``max_restarts=N`` (and ``max_task_retries=0``: a call in flight when the actor died fails with
``ActorFailure`` rather than running twice). Ray re-runs the actor's ``__init__`` with the same
arguments in the same placement-group bundle; the new incarnation starts from a fresh object.

To notice deaths without polling, the owner keeps one *sentinel* call pending on every supervised
actor: ``_meshrl_watch`` never returns and runs in its own Ray concurrency group, so it never
takes the actor's own execution slot. One daemon thread per owner process waits on all sentinels
with ``ray.wait``. When a sentinel fails, the actor died; the thread probes the restarting actor
with ``__ray_ready__`` (every ``REPROBE_S`` while Ray says it is restarting, anew when a probe stays
unanswered ``REPROBE_AFTER_S``) and once it answers calls ``on_restart(RestartEvent(...))``. If the restart budget is
spent, the death is logged and callers get ``ActorFailure`` from Ray as usual.

Where the callback runs: on the event loop that was running when ``spawn`` was called (via
``call_soon_threadsafe``; a coroutine result is scheduled there as a task), otherwise on the
supervision thread. A callback's exception is logged, never raised.

``settle(timeout_s)`` waits until every restart that happened has been reported (an owner that
is about to stop calls it). ``stop()`` unwatches before it kills, and an unwatch also holds while
the thread is busy with that actor (e.g. running its callback): a deliberately stopped actor is
never reported as dead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import ray

from meshrl.mesh.actor import WATCH_GROUP

log = logging.getLogger("meshrl.mesh")

POLL_S = 0.5
"""How often the supervision thread looks for newly watched actors while none has failed."""
REPROBE_S = 0.1
"""How often a restarting actor is asked whether it is up."""
REPROBE_AFTER_S = 1.0
"""A probe unanswered this long is sent anew."""


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
    probed: float = 0.0

    def arm(self) -> None:
        self.ref = self.handle._meshrl_watch.options(concurrency_group=WATCH_GROUP).remote()

    def revive(self) -> None:
        """Ask the restarting actor whether it is up (``_revival``)."""
        self.ref, self.probed = _revival(self.handle), time.monotonic()


class _Supervisor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ref: dict[Any, _Watched] = {}
        self._later: list[tuple[float, _Watched]] = []
        """Entries whose restarted actor did not answer yet: probed again when due."""
        self._thread: threading.Thread | None = None

    def watch(self, entries: list[_Watched]) -> None:
        with self._lock:
            for entry in entries:
                entry.arm()
                self._by_ref[entry.ref] = entry
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="meshrl-supervisor", daemon=True)
                self._thread.start()

    def restarting(self) -> list[str]:
        """``mesh/rank`` of every watched actor that died and is not reported back yet."""
        with self._lock:
            entries = {id(e): e for e in [*self._by_ref.values(), *(e for _, e in self._later)]}
        return sorted(f"{e.mesh}/{e.rank}" for e in entries.values() if e.cause)

    def unwatch(self, match: Callable[[_Watched], bool]) -> None:
        with self._lock:
            for ref in [r for r, e in self._by_ref.items() if match(e)]:
                del self._by_ref[ref]
            self._later = [(due, e) for due, e in self._later if not match(e)]

    def _run(self) -> None:
        while True:
            with self._lock:
                self._reprobe(time.monotonic())
                refs = list(self._by_ref)
                if not refs and not self._later:
                    self._thread = None
                    return
            if not refs:
                time.sleep(REPROBE_S)
                continue
            try:
                reviving = self._later or any(self._by_ref[r].cause for r in refs if r in self._by_ref)
                ready, _ = ray.wait(refs, num_returns=1, timeout=REPROBE_S if reviving else POLL_S)
            except Exception as exc:  # Ray was shut down under us: nothing left to supervise
                (log.warning if ray.is_initialized() else log.debug)("supervision stops: %s", exc)
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

    def _reprobe(self, now: float) -> None:
        """Probe the restarting actors that are due (under the lock). An entry leaves its old place
        only once its new probe is sent, so a probe that cannot be sent is tried again next round."""
        for due, entry in [x for x in self._later if x[0] <= now]:
            if self._probe(entry):
                self._later.remove((due, entry))
                self._by_ref[entry.ref] = entry
        # a probe of a restarting actor can stay unanswered after the actor is back (seen with
        # Ray 2.56 to 2.60 when it was sent as the old process's connection closed): ask anew
        for ref, entry in [(r, e) for r, e in self._by_ref.items() if e.cause and now - e.probed > REPROBE_AFTER_S]:
            if self._probe(entry):
                del self._by_ref[ref]
                self._by_ref[entry.ref] = entry

    @staticmethod
    def _probe(entry: _Watched) -> bool:
        try:
            entry.revive()
            return True
        except Exception as exc:  # never let the supervision thread die: the actor goes unwatched
            log.warning("probing restarting actor %s/%d: %s; trying again", entry.mesh, entry.rank, exc)
            return False

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
            if entry.cause and not isinstance(exc, ray.exceptions.ActorUnavailableError):
                log.error("actor %s/%d died and was not restarted: %s", entry.mesh, entry.rank, exc)
                return False
            if not entry.cause:  # the sentinel failed: the actor died; is it back yet?
                entry.cause = str(exc)
                log.warning("actor %s/%d died (%s); waiting for its restart", entry.mesh, entry.rank, entry.cause)
                if self._probe(entry):
                    return True
            with self._lock:  # still restarting: probed again after REPROBE_S
                if self._by_ref.get(ref) is entry:  # (not unwatched meanwhile)
                    self._later.append((time.monotonic() + REPROBE_S, entry))
            return False
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
    """A call that answers once the restarted actor is up, or fails at once while it restarts
    (then the supervisor probes again after REPROBE_S: Ray's own retries of a call to a restarting
    actor back off, and the restart would be told of seconds after callers use the actor again)."""
    return handle.__ray_ready__.options(max_task_retries=0).remote()


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


def restarting() -> list[str]:
    """``mesh/rank`` of every supervised actor seen dead whose restart is not reported yet."""
    return _supervisor.restarting()


def settle(timeout_s: float) -> list[str]:
    """Wait (at most ``timeout_s``, blocking: call it off the event loop) until no supervised actor is
    between its death and the report of its restart, so an owner that is about to stop hears of the
    restarts that already happened (a probe answers up to ``REPROBE_AFTER_S`` after the actor is back).
    Returns the actors still restarting at the deadline (``mesh/rank``)."""
    deadline = time.monotonic() + timeout_s
    while (pending := restarting()) and time.monotonic() < deadline:
        time.sleep(REPROBE_S / 2)
    return pending


def unwatch(uid: str, ranks: set[int]) -> None:
    """Stop supervising ranks ``ranks`` of mesh ``uid`` (before killing them on purpose)."""
    _supervisor.unwatch(lambda e: e.uid == uid and e.rank in ranks)


def unwatch_procs(proc_uid: str) -> None:
    """Stop supervising every actor spawned on proc mesh ``proc_uid``."""
    _supervisor.unwatch(lambda e: e.proc_uid == proc_uid)
