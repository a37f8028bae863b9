"""Errors the mesh layer raises at the caller, and the translation from Ray's own errors.

Two kinds of remote failure reach a caller, and they are kept apart on purpose:

- **The actor is gone** (its process died, was killed, or raised in ``__init__``): ``ActorFailure``,
  naming the mesh, the rank and Ray's description of the cause. Ray reports a dead actor to every
  pending and later call within about a second, so this never hangs.
- **The endpoint raised**: the caller gets the *original exception type* (Ray's
  ``RayTaskError(<type>)``, a subclass of both), so ``except KeyError`` works across actors. Its
  message carries the remote traceback, and a note names the mesh, rank and endpoint. Only when
  Ray cannot subclass the user's exception type does the caller see a plain ``RayTaskError``.

Timeouts raise the builtin ``TimeoutError`` with a message that says what was waited for.
"""

from __future__ import annotations

import re

import ray.exceptions

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ActorFailure(Exception):
    """An actor of a mesh died (killed, crashed, or raised in ``__init__``)."""

    def __init__(self, mesh: str, rank: int, cause: str) -> None:
        super().__init__(mesh, rank, cause)
        self.mesh = mesh
        self.rank = rank
        self.cause = cause

    def __str__(self) -> str:
        return f"actor {self.mesh}/{self.rank} failed: {self.cause}"

    @property
    def restarting(self) -> bool:
        """Ray is restarting the actor (a supervised one within its restarts): a call made again
        reaches the new process; False once it is dead for good."""
        return "temporarily unavailable" in self.cause or "restarting" in self.cause


def translate(exc: BaseException, mesh: str, rank: int, method: str) -> BaseException:
    """The exception to raise at the caller for ``exc`` from ``mesh``/``rank``'s ``method``."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return ActorFailure(mesh, rank, _ANSI.sub("", str(exc)))
    if isinstance(exc, ray.exceptions.RayTaskError):
        if isinstance(exc.cause, ActorFailure):  # an actor's failure, told by another (or by itself, restarted)
            exc.cause.add_note(f"raised by endpoint `{method}` of actor {mesh}/{rank}")
            return exc.cause
        exc = exc.as_instanceof_cause()
    if isinstance(exc, Exception):
        exc.add_note(f"raised by endpoint `{method}` of actor {mesh}/{rank}")
    return exc


def find_cause(exc: BaseException | None, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` behind ``exc``: itself, its causes, contexts and the members
    of exception groups; None when there is none."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kinds):
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None
