"""``ActorMesh``: a picklable handle on the actors one ``spawn`` created, with named dims.

``mesh.method`` is an ``Endpoint`` (``call`` / ``call_one`` / ``choose`` / ``stream`` /
``broadcast``); ``mesh.slice(dim=...)`` and ``mesh.flatten(name)`` are views over the same actors.
A mesh pickles as its Ray actor handles plus its shape, so an actor can receive a mesh as an
argument and call it (from async endpoints with ``await``, from sync ones with ``.get()``).

Typing: Python has no way to say "an ``ActorMesh[A]`` has ``A``'s endpoints as attributes", so for
type checkers ``ActorMesh[A]`` *is* ``A`` (an ``Annotated`` alias) and ``@endpoint`` methods are
typed as ``Endpoint[P, R, ...]``; ``await mesh.f.call_one(x)`` is then checked against ``f`` and
typed as its return value. The mesh methods below are declared on ``Actor`` for the checker.
At run time ``ActorMesh`` is the class below.

Names an endpoint must not have, because the mesh itself uses them: see ``RESERVED``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar

import ray

from meshrl.mesh import supervision
from meshrl.mesh.actor import HEARTBEAT_GROUP, Actor
from meshrl.mesh.adverbs import Endpoint, Future
from meshrl.mesh.state import Flush, MeshState, state_for
from meshrl.mesh.shape import Shape

SENT: collections.Counter[str] = collections.Counter()
"""Actor calls this process has sent, one per actor called, by "mesh.method" (what a benchmark of
the control plane counts: ``bench/bench_controller.py``)."""

log = logging.getLogger("meshrl.mesh")

A = TypeVar("A", bound=Actor)

RESERVED = frozenset({"name", "sizes", "slice", "flatten", "ready", "flush", "stop"})


class _ActorMeshImpl(Generic[A]):
    """Actors of one spawn (or a view of them): dims, ranks, and endpoints by attribute."""

    def __init__(
        self,
        name: str,
        uid: str,
        cls_name: str,
        endpoints: frozenset[str],
        methods: frozenset[str],
        handles: tuple[Any, ...],
        shape: Shape,
        world: int,
    ):
        self._name = name
        self._uid = uid
        self._cls_name = cls_name
        self._endpoints = endpoints
        self._methods = methods
        self._handles = handles
        self._shape = shape
        self._world = world
        self._state: MeshState = state_for(uid, world)
        self._endpoint_cache: dict[str, Endpoint[Any, Any, Any]] = {}
        self._on_stop: list[Any] = [None]  # set by ProcMesh.spawn, shared by views: gives the processes' share back

    def __reduce__(self) -> Any:
        return (
            _ActorMeshImpl,
            (self._name, self._uid, self._cls_name, self._endpoints, self._methods, self._handles, self._shape, self._world),
        )

    def __getattr__(self, method: str) -> Endpoint[Any, Any, Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        ep = self._endpoint_cache.get(method)
        if ep is not None:
            return ep
        if method not in self._endpoints:
            if method in self._methods:
                raise AttributeError(f"`{method}` is not an endpoint: decorate it with `@endpoint`")
            raise AttributeError(f"`{method}` is not an endpoint of {self._cls_name} (mesh {self._name!r})")
        ep = self._endpoint_cache[method] = Endpoint(self, method)
        return ep

    @property
    def name(self) -> str:
        return self._name

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.dims

    def __len__(self) -> int:
        return len(self._handles)

    def __repr__(self) -> str:
        return f"ActorMesh({self._name!r}, {self._cls_name}, {self._shape.dims})"

    def _view(self, shape: Shape, positions: list[int]) -> _ActorMeshImpl[A]:
        handles = tuple(self._handles[p] for p in positions)
        view = _ActorMeshImpl(
            self._name, self._uid, self._cls_name, self._endpoints, self._methods, handles, shape, self._world
        )
        view._on_stop = self._on_stop
        return view

    def slice(self, **dims: int | slice) -> _ActorMeshImpl[A]:
        """A view: ``dim=slice(...)`` keeps the dim, ``dim=int`` drops it."""
        shape, positions = self._shape.slice(**dims)
        return self._view(shape, positions)

    def flatten(self, name: str) -> _ActorMeshImpl[A]:
        """A view with all dims merged into one called ``name``."""
        return self._view(self._shape.flatten(name), list(range(len(self._handles))))

    def ready(self) -> Future[None]:
        """Done when every actor finished ``__init__``; ``ActorFailure`` if one died instead."""
        refs = self._submit_all("__ray_ready__", (), {})
        return Future(self._name, "__init__", refs, self._shape.ranks, _none, self._state)

    def flush(self) -> Flush:
        """Done when every broadcast sent so far through this mesh finished; raises their failures.

        ``mesh.flush().get(timeout=...)`` or ``await mesh.flush().within(seconds)``.
        """
        return Flush(self._name, self._state)

    def stop(self) -> None:
        """Kill the actors of this mesh (no restart). Safe to call twice.

        On a view, only the view's actors die; the processes' share is given back to the proc
        mesh when the whole spawned mesh is stopped (through it, or a view of all its actors).
        """
        supervision.unwatch(self._uid, set(self._shape.ranks))
        if self._on_stop[0] is not None and len(self._handles) == self._world:
            self._on_stop[0]()
            self._on_stop[0] = None
        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # already dead, or Ray shut down: nothing left to stop
                log.debug("stopping an actor of %s: %s", self._name, exc)

    async def heartbeat(self, timeout_s: float) -> dict[int, str]:
        """Ping every actor of this mesh, from a concurrency group of its own (a long call does not
        delay the answer); ``{rank: "alive" | "hung" | "down"}``: it answered within ``timeout_s``;
        it did not (stopped, stuck in a call that holds the GIL, on a node cut off); it is dead or
        being restarted (supervision and the callers' failures tell of that)."""
        refs = [h._meshrl_ping.options(concurrency_group=HEARTBEAT_GROUP).remote() for h in self._handles]
        if refs:
            await asyncio.wait([asyncio.wrap_future(r.future()) for r in refs], timeout=timeout_s)
        states = {}
        for rank, ref in zip(self._shape.ranks, refs):
            try:
                ray.get(ref, timeout=0)
                states[rank] = "alive"
            except ray.exceptions.GetTimeoutError:
                states[rank] = "hung"
            except ray.exceptions.RayError:
                states[rank] = "down"
        return states

    def kill(self, rank: int) -> None:
        """Kill the actor of ``rank`` as if its process died: Ray restarts it if it has restarts
        left (``spawn(max_restarts=)``), its callers' calls fail with ``ActorFailure``."""
        ray.kill(self._handles[self._shape.ranks.index(rank)], no_restart=False)

    def _run_all(self, fn: Any, *args: Any, what: str | None = None) -> Future[Any]:
        """``fn(*args)`` in every actor (library helpers, e.g. ``init_torch_distributed_on``); errors
        and timeouts name ``what`` (default: the function's name)."""
        return Endpoint(self, "_meshrl_run", what or getattr(fn, "__name__", None)).call(fn, *args)

    def _run_one(self, fn: Any, *args: Any, what: str | None = None) -> Future[Any]:
        return Endpoint(self, "_meshrl_run", what or getattr(fn, "__name__", None)).call_one(fn, *args)

    # -- used by Endpoint --------------------------------------------------------------------

    def _submit_one(self, method: str, pos: int, args: Any, kwargs: Any) -> Any:
        SENT[f"{self._name}.{method}"] += 1
        state = self._state
        if state.broadcasts:
            state.check()
        if state.errors:
            state.raise_errors()
        ref = getattr(self._handles[pos], method).remote(*args, **kwargs)
        with state.lock:
            state.outstanding[self._shape.ranks[pos]] += 1
        return ref

    def _submit_all(self, method: str, args: Any, kwargs: Any, check: bool = True) -> list[Any]:
        SENT[f"{self._name}.{method}"] += len(self._handles)
        state = self._state
        if check and state.broadcasts:
            state.check()
        if state.errors:
            state.raise_errors()
        refs = [getattr(handle, method).remote(*args, **kwargs) for handle in self._handles]
        with state.lock:
            for rank in self._shape.ranks:
                state.outstanding[rank] += 1
        return refs

    def _least_loaded(self) -> int:
        state = self._state
        ranks = self._shape.ranks
        n = len(ranks)
        with state.lock:
            start = state.next_choice % n
            state.next_choice = start + 1
            best = start
            best_load = state.outstanding[ranks[start]]
            for i in range(1, n):
                pos = (start + i) % n
                load = state.outstanding[ranks[pos]]
                if load < best_load:
                    best, best_load = pos, load
        return best

    def _broadcast(self, method: str, args: Any, kwargs: Any) -> None:
        # A burst of broadcasts is checked once, by the next other adverb (or every CHECK_EVERY).
        refs = self._submit_all(method, args, kwargs, check=False)
        self._state.sent(refs, self._name, self._shape.ranks, method)


def _none(_values: list[Any]) -> None:
    return None


if TYPE_CHECKING:
    ActorMesh = Annotated[A, "ActorMesh"]
else:
    ActorMesh = _ActorMeshImpl
    ActorMesh.__name__ = ActorMesh.__qualname__ = "ActorMesh"
