"""Endpoint adverbs (``call``, ``call_one``, ``choose``, ``stream``, ``broadcast``) and their futures.

Every adverb submits plain Ray actor calls (``handle.method.remote``) and wraps the resulting
``concurrent.futures.Future`` (``ObjectRef.future()``, which is what ``await ref`` uses inside
Ray too). One completion callback per call keeps the caller's count of outstanding calls per
actor (for ``choose``); waiting on a whole mesh settles one asyncio future per call instead of one
per actor, which is why ``call`` on eight actors is no slower than ``asyncio.gather`` on raw refs.

Waiting: ``await fut``; ``await fut.within(seconds)``; ``fut.get(timeout=...)`` in synchronous
code (it refuses to run on a thread with a running event loop, where it would block the loop).
A mesh-wide wait fails as soon as any actor fails, without waiting for the rest.

``broadcast`` is fire and forget, but its failures are not lost: each one is logged with mesh,
rank and endpoint when it happens, and raised at the caller by the next adverb called on any view
of that mesh in this process, or by ``mesh.flush()``, which waits for outstanding broadcasts.

Simplifications: the outstanding-call counts are per process (what "from this caller" means);
``choose`` breaks ties round-robin; arguments are serialized once per actor (for a large argument
sent to many actors, pass ``ray.put(x)``, which Ray resolves before the call runs).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Generator, Generic, Iterator, ParamSpec, TypeVar

from meshrl.mesh.errors import translate
from meshrl.mesh.shape import Shape, ValueMesh

if TYPE_CHECKING:
    from meshrl.mesh.actor_mesh import _ActorMeshImpl

log = logging.getLogger("meshrl.mesh")

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L")
T = TypeVar("T")


class MeshState:
    """Per-process bookkeeping shared by every view (slice, copy) of one spawned mesh."""

    def __init__(self, size: int):
        self.lock = threading.Lock()
        self.outstanding = [0] * size
        self.next_choice = 0
        self.broadcasts: set[concurrent.futures.Future[Any]] = set()
        self.errors: collections.deque[BaseException] = collections.deque()

    def finished(self, rank: int, _cf: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.outstanding[rank] -= 1

    def broadcast_done(self, mesh: str, rank: int, method: str, cf: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.broadcasts.discard(cf)
        exc = cf.exception()
        if exc is not None:
            err = translate(exc, mesh, rank, method)
            log.error("broadcast of `%s` to %s/%d failed: %s", method, mesh, rank, err)
            self.errors.append(err)

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


_states: weakref.WeakValueDictionary[str, MeshState] = weakref.WeakValueDictionary()
_states_lock = threading.Lock()


def state_for(uid: str, size: int) -> MeshState:
    """The one ``MeshState`` of mesh ``uid`` in this process."""
    with _states_lock:
        state = _states.get(uid)
        if state is None:
            state = _states[uid] = MeshState(size)
        return state


def _refuse_on_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} would block the running event loop: use `await` instead")


def _on_settled(cfs: list[concurrent.futures.Future[Any]], notify: Callable[[], None]) -> None:
    """Call ``notify`` once every call finished, or as soon as one failed.

    The callback is registered after the mesh's own bookkeeping callbacks, so when ``notify``
    runs the outstanding counts and broadcast failures are already recorded.
    """
    remaining = [len(cfs)]
    lock = threading.Lock()

    def on_done(cf: concurrent.futures.Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last or cf.cancelled() or cf.exception() is not None:
            notify()

    if not cfs:
        notify()
    for cf in cfs:
        cf.add_done_callback(on_done)


def _settled(cfs: list[concurrent.futures.Future[Any]]) -> asyncio.Future[None]:
    """An asyncio future done when every call finished or any failed (one loop wake-up)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def notify() -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the waiting loop is closed: nobody is listening any more
            pass

    _on_settled(cfs, notify)
    return done


class Future(Generic[R]):
    """The pending answer of one adverb: ``await`` it, ``await f.within(s)`` or ``f.get(timeout=s)``."""

    __slots__ = ("_mesh", "_method", "_cfs", "_ranks", "_finish", "_check")

    def __init__(
        self,
        mesh: str,
        method: str,
        cfs: list[concurrent.futures.Future[Any]],
        ranks: tuple[int, ...],
        finish: Callable[[list[Any]], R],
        check: bool = True,
    ):
        self._mesh = mesh
        self._method = method
        self._cfs = cfs
        self._ranks = ranks
        self._finish = finish
        self._check = check  # False: ``finish`` reports failures itself (``flush``)

    def __await__(self) -> Generator[Any, None, R]:
        return self._wait(None).__await__()

    def within(self, seconds: float) -> Awaitable[R]:
        """Await the answer, raising ``TimeoutError`` after ``seconds``."""
        return self._wait(seconds)

    async def _wait(self, timeout: float | None) -> R:
        settled = _settled(self._cfs)
        if timeout is None:
            await settled
        else:
            try:
                await asyncio.wait_for(settled, timeout)
            except TimeoutError:
                raise self._timeout(timeout) from None
        return self._collect(timeout)

    def get(self, timeout: float | None = None) -> R:
        """Block until the answer is in (synchronous code only), at most ``timeout`` seconds."""
        _refuse_on_loop(f"`.get()` on `{self._method}`")
        settled = threading.Event()
        _on_settled(self._cfs, settled.set)
        settled.wait(timeout)
        return self._collect(timeout)

    def _collect(self, timeout: float | None) -> R:
        if self._check:
            for cf, rank in zip(self._cfs, self._ranks):
                if cf.done() and (exc := cf.exception()) is not None:
                    raise translate(exc, self._mesh, rank, self._method)
        if not all(cf.done() for cf in self._cfs):
            raise self._timeout(timeout)
        return self._finish([None if cf.exception() else cf.result() for cf in self._cfs])

    def _timeout(self, timeout: float | None) -> TimeoutError:
        waiting = [rank for cf, rank in zip(self._cfs, self._ranks) if not cf.done()]
        return TimeoutError(
            f"`{self._method}` on mesh {self._mesh!r}: rank(s) {waiting} did not answer within "
            f"{timeout} s ({len(self._ranks) - len(waiting)} of {len(self._ranks)} answered)"
        )


class Stream(Generic[R]):
    """Answers of every actor in arrival order: ``async for v in s``, ``s.iter(timeout)``, ``s.get(timeout)``."""

    def __init__(self, mesh: str, method: str, cfs: list[concurrent.futures.Future[Any]], ranks: tuple[int, ...]):
        self._mesh = mesh
        self._method = method
        self._cfs = cfs
        self._rank = dict(zip(map(id, cfs), ranks))

    def _value(self, cf: concurrent.futures.Future[Any]) -> Any:
        exc = cf.exception()
        if exc is not None:
            raise translate(exc, self._mesh, self._rank[id(cf)], self._method)
        return cf.result()

    async def __aiter__(self) -> AsyncIterator[R]:
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[concurrent.futures.Future[Any]] = asyncio.Queue()
        for cf in self._cfs:
            cf.add_done_callback(functools.partial(loop.call_soon_threadsafe, arrived.put_nowait))
        for _ in self._cfs:
            yield self._value(await arrived.get())

    def iter(self, timeout: float | None = None) -> Iterator[R]:
        """Synchronous iteration; ``TimeoutError`` if not every actor answered within ``timeout``."""
        _refuse_on_loop(f"`.iter()` on the stream of `{self._method}`")
        try:
            for cf in concurrent.futures.as_completed(self._cfs, timeout):
                yield self._value(cf)
        except TimeoutError:
            waiting = [self._rank[id(cf)] for cf in self._cfs if not cf.done()]
            raise TimeoutError(
                f"stream of `{self._method}` on mesh {self._mesh!r}: rank(s) {waiting} did not "
                f"answer within {timeout} s"
            ) from None

    def get(self, timeout: float | None = None) -> list[R]:
        """Every answer, in arrival order."""
        return list(self.iter(timeout))


class Endpoint(Generic[P, R, L]):
    """``mesh.method``: the adverbs that call ``method`` on the actors of ``mesh``."""

    __slots__ = ("_mesh", "_method")

    def __init__(self, mesh: _ActorMeshImpl[Any], method: str):
        self._mesh = mesh
        self._method = method

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every actor; the answers as a ``ValueMesh`` over the mesh's dims."""
        mesh = self._mesh
        cfs = mesh._submit_all(self._method, args, kwargs)
        shape: Shape = mesh._shape
        return Future(mesh._name, self._method, cfs, shape.ranks, functools.partial(ValueMesh, shape))

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the mesh's only actor (slice the mesh down to one first)."""
        mesh = self._mesh
        if len(mesh._handles) != 1:
            raise ValueError(
                f"`{self._method}`.call_one needs a mesh of exactly one actor, but mesh "
                f"{mesh._name!r} has {len(mesh._handles)} ({mesh._shape.dims}): slice it first"
            )
        cf = mesh._submit_one(self._method, 0, args, kwargs)
        return Future(mesh._name, self._method, [cf], mesh._shape.ranks, _only)

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the one actor with the fewest outstanding calls from this process."""
        mesh = self._mesh
        pos = mesh._least_loaded()
        cf = mesh._submit_one(self._method, pos, args, kwargs)
        return Future(mesh._name, self._method, [cf], (mesh._shape.ranks[pos],), _only)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Stream[R]:
        """Call every actor; iterate over the answers as they arrive."""
        mesh = self._mesh
        cfs = mesh._submit_all(self._method, args, kwargs)
        return Stream(mesh._name, self._method, cfs, mesh._shape.ranks)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Call every actor without waiting; failures are logged and raised later (module doc)."""
        mesh = self._mesh
        for pos, cf in enumerate(mesh._submit_all(self._method, args, kwargs)):
            mesh._track_broadcast(self._method, pos, cf)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> L:
        raise TypeError(
            f"call endpoint `{self._method}` of mesh {self._mesh._name!r} through an adverb: "
            f".call(...), .call_one(...), .choose(...), .stream(...) or .broadcast(...)"
        )

    def __repr__(self) -> str:
        return f"Endpoint({self._mesh._name!r}.{self._method})"


def _only(values: list[T]) -> T:
    return values[0]
