"""The actor side of a mesh: the ``Actor`` base, ``@endpoint``, and where an actor sits in its mesh.

Each actor of a mesh is one Ray actor (one process). ``ProcMesh.spawn`` does not hand the user's
class to Ray directly but a thin subclass built here that (1) records the actor's mesh name, rank
and dims before the user's ``__init__`` runs, so ``current_rank()`` works there and after a restart,
and (2) applies the threading rule below.

Threading rule (Ray runs a class with any ``async def`` method as an *async actor*: one event loop,
up to ``max_concurrency`` calls in flight, and it would run plain ``def`` methods *on that loop*,
so one CPU-heavy sync method would stall every other call):

- **Sync actor** (no ``async def``): one thread; calls run one at a time, in arrival order
  (Ray's ``max_concurrency=1``). A sync endpoint may block, e.g. on ``.get()`` of another mesh,
  but an actor that calls back into itself through another actor then deadlocks: make such an
  endpoint ``async``.
- **Async actor**: ``async`` endpoints run concurrently on the event loop and must not block it
  (``.get()`` there raises; use ``await``). Sync endpoints are moved off the loop onto one
  dedicated thread per actor, so they still run one at a time in arrival order, may block and
  may burn CPU without stalling the async endpoints. They do run concurrently with the async
  endpoints: state shared between the two kinds needs a lock. Ray's ``max_concurrency`` (1000
  for async actors; ``spawn(..., max_concurrency=N)``) bounds the calls in flight; keep it
  large where calls wait on each other (a queue's ``get`` waiting for a ``put``), or they deadlock.

Simplifications: one actor per process, so the mesh context is a module global; sync endpoints of
an async actor share a single thread (no per-endpoint pools).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Concatenate, Coroutine, Iterator, ParamSpec, TypeVar, overload

import ray
from ray._private.async_compat import has_async_methods, is_async_func

if TYPE_CHECKING:
    from typing import Self

    from meshrl.mesh.adverbs import Endpoint, Future
    from meshrl.mesh.state import Flush

P = ParamSpec("P")
R = TypeVar("R")

_ENDPOINT_MARK = "_meshrl_endpoint"
WATCH_GROUP = "meshrl_watch"
"""Ray concurrency group of the supervision sentinel, so it never occupies the actor's own slot."""
HEARTBEAT_GROUP = "meshrl_heartbeat"
"""Ray concurrency group of ``_meshrl_ping`` (a thread, or an event loop, of its own): a process
busy in a long call still answers, a frozen one does not (``ActorMesh.heartbeat``)."""


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Endpoint[P, R, Coroutine[Any, Any, R]]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R, R]: ...
def endpoint(fn: Any) -> Any:
    """Mark a method (sync or ``async``) of an ``Actor`` as callable through its mesh.

    Inside the actor the method stays a plain method. For type checkers it becomes an
    ``Endpoint[P, R, ...]``, so ``await mesh.f.call_one(x)`` is checked against ``f``'s
    parameters and typed as its return value.
    """
    if not callable(fn):
        raise TypeError(f"@endpoint decorates a method, got {fn!r}")
    setattr(fn, _ENDPOINT_MARK, True)
    return fn


def endpoint_names(cls: type) -> frozenset[str]:
    """Names of the ``@endpoint`` methods of ``cls`` (inherited ones included)."""
    return frozenset(
        name for name in dir(cls) if getattr(getattr(cls, name, None), _ENDPOINT_MARK, False)
    )


def method_names(cls: type) -> frozenset[str]:
    return frozenset(name for name in dir(cls) if callable(getattr(cls, name, None)) and not name.startswith("__"))


class Actor:
    """Base class of everything spawned on a mesh; mark the methods to expose with ``@endpoint``.

    ``ProcMesh.spawn(name, Cls, *args, **kwargs)`` runs ``Cls(*args, **kwargs)`` in every process
    of the mesh; inside, ``current_rank()`` / ``current_size()`` say where the actor sits.
    """

    if TYPE_CHECKING:
        # Type checkers see ``ActorMesh[A]`` as ``A`` (see ``actor_mesh``), so the mesh-side
        # surface is declared here for them; it does not exist on the actor object itself.
        name: str
        sizes: dict[str, int]

        def slice(self, **dims: int | slice) -> Self: ...
        def flatten(self, name: str) -> Self: ...
        def ready(self) -> Future[None]: ...
        def flush(self) -> Flush: ...
        def stop(self) -> None: ...
        def __len__(self) -> int: ...

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines and errors with this repr.
        ctx = _context
        where = f" {ctx.mesh}/{ctx.rank}" if ctx is not None else ""
        return f"{type(self).__name__}{where}"


@dataclass(frozen=True)
class Context:
    """Where an actor sits: sent by ``spawn`` as the hidden first constructor argument."""

    mesh: str
    uid: str
    rank: int
    labels: tuple[str, ...]
    sizes: tuple[int, ...]


class Rank(Mapping[str, int]):
    """An actor's coordinates in its spawned mesh (``rank["gpus"]``) and its flat ``.rank``."""

    def __init__(self, rank: int, coords: dict[str, int]):
        self._rank = rank
        self._coords = coords

    @property
    def rank(self) -> int:
        return self._rank

    def __getitem__(self, dim: str) -> int:
        try:
            return self._coords[dim]
        except KeyError:
            raise KeyError(f"no dim named {dim!r}; this mesh has dims {tuple(self._coords)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        return f"Rank({self._rank}, {self._coords})"


_context: Context | None = None


def _set_context(ctx: Context) -> None:
    global _context
    _context = ctx


def mesh_context() -> Context:
    if _context is None:
        raise RuntimeError(
            "not inside a mesh actor: current_rank(), current_size() and init_torch_distributed() "
            "work in actors spawned with ProcMesh.spawn"
        )
    return _context


def current_rank() -> Rank:
    """This actor's flat rank and coordinates within the mesh it was spawned as."""
    ctx = mesh_context()
    coords: dict[str, int] = {}
    position = ctx.rank
    for label, size in zip(reversed(ctx.labels), reversed(ctx.sizes)):
        position, coords[label] = divmod(position, size)
    return Rank(ctx.rank, {label: coords[label] for label in ctx.labels})


def current_size() -> dict[str, int]:
    """Dim sizes of the mesh this actor was spawned as."""
    ctx = mesh_context()
    return dict(zip(ctx.labels, ctx.sizes))


def _off_loop(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """``fn`` as a coroutine that runs it on the actor's sync-endpoint thread."""

    @functools.wraps(fn)
    async def run_off_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(fn, self, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._meshrl_sync_thread, call)

    return run_off_loop


def _run(self: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a library function inside the actor (``init_torch_distributed_on``, addresses)."""
    return fn(*args, **kwargs)


def _watch_sync(self: Any) -> None:
    """Never returns: its failure tells the owner's supervisor that this process died."""
    threading.Event().wait()


async def _watch_async(self: Any) -> None:
    await asyncio.Event().wait()


def _ping_sync(self: Any) -> int:
    """The heartbeat: answered from its own concurrency group, whatever the actor is doing."""
    return os.getpid()


async def _ping_async(self: Any) -> int:
    return os.getpid()


_ray_classes: weakref.WeakKeyDictionary[type, dict[bool, Any]] = weakref.WeakKeyDictionary()


def ray_actor_class(cls: type, supervised: bool) -> Any:
    """The Ray actor class that runs ``cls`` on a mesh (cached: Ray exports a class once)."""
    per_cls = _ray_classes.setdefault(cls, {})
    if supervised in per_cls:
        return per_cls[supervised]
    is_async = has_async_methods(cls)
    user_init = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, ctx: Context, *args: Any, **kwargs: Any) -> None:
        _set_context(ctx)  # a by-reference call: this class travels to Ray by value
        if is_async:
            self._meshrl_sync_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{ctx.mesh}-sync")
        user_init(self, *args, **kwargs)

    ns: dict[str, Any] = {"__init__": __init__, "_meshrl_watch": _watch_async if is_async else _watch_sync,
                          "_meshrl_ping": _ping_async if is_async else _ping_sync}
    ns["_meshrl_run"] = _off_loop(_run) if is_async else _run
    if is_async:
        for name in endpoint_names(cls):
            fn = getattr(cls, name)
            if not is_async_func(fn):
                ns[name] = _off_loop(fn)
    sub = type(cls.__name__, (cls,), ns)
    sub.__qualname__ = cls.__qualname__
    sub.__module__ = cls.__module__
    sub.__doc__ = cls.__doc__
    groups = {HEARTBEAT_GROUP: 1, **({WATCH_GROUP: 1} if supervised else {})}
    remote = ray.remote(concurrency_groups=groups)  # type: ignore[call-overload]
    per_cls[supervised] = remote(sub)
    return per_cls[supervised]
