"""Endpoint adverbs (``call``, ``call_one``, ``choose``, ``stream``, ``broadcast``) and their futures.

Every adverb submits plain Ray actor calls (``handle.method.remote``) and keeps the refs; waiting
is as close to raw Ray as it gets, because the mesh layer must cost almost nothing over it:

- ``fut.get(timeout=...)`` (synchronous code) is one ``ray.get`` on all refs, which returns as
  soon as any of them holds an error. It refuses to run on a thread with a running event loop,
  where it would block the loop.
- ``await fut`` / ``await fut.within(seconds)`` turn each ref into Ray's own future (what
  ``await ref`` does) and wake the event loop once, when all answered or one failed.

Failures are attributed to a rank only on the error path. ``broadcast`` is fire and forget, but
its failures are kept (see ``state``): logged when seen and raised by the next adverb on any view
of the mesh in this process, or by ``mesh.flush()``.

Simplifications: ``choose`` breaks ties round-robin; arguments are serialized once per actor (for
a large argument sent to many actors, pass ``ray.put(x)``, which Ray resolves before the call).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Generator, Generic, Iterator, ParamSpec, TypeVar

import ray

from meshrl.mesh.errors import translate
from meshrl.mesh.shape import Shape, ValueMesh
from meshrl.mesh.state import MeshState

if TYPE_CHECKING:
    from meshrl.mesh.actor_mesh import _ActorMeshImpl

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L")
T = TypeVar("T")


def _refuse_on_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} would block the running event loop: use `await` instead")


def _settled(cfs: list[Any]) -> asyncio.Future[None]:
    """An asyncio future done when every call finished or any failed (one loop wake-up)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    remaining = [len(cfs)]
    lock = threading.Lock()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def on_done(cf: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last or cf.cancelled() or cf.exception() is not None:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the waiting loop is closed: nobody is listening any more
                pass

    for cf in cfs:
        cf.add_done_callback(on_done)
    return done


def _failure(refs: list[Any], ranks: tuple[int, ...], exc: BaseException, mesh: str, method: str) -> BaseException:
    """The error to raise for a failed wait on ``refs``, naming the rank that failed."""
    for ref, rank in zip(refs, ranks):
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError as err:
                return translate(err, mesh, rank, method)
    return translate(exc, mesh, ranks[0] if len(ranks) == 1 else -1, method)


def _not_ready(refs: list[Any], ranks: tuple[int, ...]) -> list[int]:
    ready = set(ray.wait(list(refs), num_returns=len(refs), timeout=0)[0])
    return [rank for ref, rank in zip(refs, ranks) if ref not in ready]


class Future(Generic[R]):
    """The pending answer of one adverb: ``await`` it, ``await f.within(s)`` or ``f.get(timeout=s)``."""

    __slots__ = ("_mesh", "_method", "_refs", "_ranks", "_finish", "_state", "_released")

    def __init__(
        self,
        mesh: str,
        method: str,
        refs: list[Any],
        ranks: tuple[int, ...],
        finish: Callable[[list[Any]], R],
        state: MeshState,
    ):
        self._mesh = mesh
        self._method = method
        self._refs = refs
        self._ranks = ranks
        self._finish = finish
        self._state = state
        self._released = False

    def _release(self, *, finished: bool = True) -> None:
        """Give the ranks' load (``choose``) back: at once for calls that finished; a wait that was
        cancelled or failed early (``finished=False``) leaves some running, released at their end."""
        if self._released:
            return
        self._released = True
        if finished:
            self._state.release(self._ranks)
            return
        state, refs = self._state, list(self._refs)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for ref, rank in zip(refs, self._ranks):
            if ref in ready:
                state.release([rank])
            else:
                ref.future().add_done_callback(lambda _, rank=rank: state.release([rank]))

    def __del__(self) -> None:
        # A dropped future no longer counts as load on its actors (see ``choose``).
        try:
            self._release()
        except Exception:
            pass

    def ref(self) -> Any:
        """The answer's ``ObjectRef`` (a call of one actor: ``call_one``, ``choose``), to pass as a
        top-level argument of another call: Ray hands the value to that actor straight from the
        node that holds it, without this process fetching it (the data plane; an error of this
        call surfaces in that one). The future is spent: its load counts until the call ends."""
        if len(self._refs) != 1:
            raise ValueError(f"`{self._method}` on mesh {self._mesh!r} called {len(self._refs)} actors: ref() is "
                             "for a call of one (call_one, choose)")
        self._release(finished=False)
        return self._refs[0]

    def get(self, timeout: float | None = None) -> R:
        """Block until the answer is in (synchronous code only), at most ``timeout`` seconds."""
        _refuse_on_loop(f"`.get()` on `{self._method}`")
        refs = self._refs
        try:
            values = [ray.get(refs[0], timeout=timeout)] if len(refs) == 1 else ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise self._timeout(timeout, _not_ready(refs, self._ranks)) from None
        except ray.exceptions.RayError as exc:
            self._release(finished=False)  # the other ranks' calls may still run
            raise _failure(refs, self._ranks, exc, self._mesh, self._method) from None
        self._release()
        return self._finish(values)

    def __await__(self) -> Generator[Any, None, R]:
        return self._wait(None).__await__()

    def within(self, seconds: float) -> Awaitable[R]:
        """Await the answer, raising ``TimeoutError`` after ``seconds``."""
        return self._wait(seconds)

    async def _wait(self, timeout: float | None) -> R:
        if len(self._refs) == 1 and timeout is None:  # the hot path of call_one / choose
            try:
                value = await self._refs[0]
            except ray.exceptions.RayError as exc:
                self._release()
                raise translate(exc, self._mesh, self._ranks[0], self._method) from None
            except BaseException:  # cancelled (wait_for, a task's cancel): the call runs on
                self._release(finished=False)
                raise
            self._release()
            return self._finish([value])
        cfs = [ref.future() for ref in self._refs]
        settled = _settled(cfs)
        try:
            if timeout is None:
                await settled
            else:
                try:
                    await asyncio.wait_for(settled, timeout)
                except TimeoutError:
                    waiting = [rank for cf, rank in zip(cfs, self._ranks) if not cf.done()]
                    raise self._timeout(timeout, waiting) from None
        except asyncio.CancelledError:
            self._release(finished=False)
            raise
        self._release(finished=all(cf.done() for cf in cfs))  # settled early on a failure: the rest run on
        for cf, rank in zip(cfs, self._ranks):
            if cf.done() and (err := cf.exception()) is not None:
                raise translate(err, self._mesh, rank, self._method)
        return self._finish([cf.result() for cf in cfs])

    def _timeout(self, timeout: float | None, waiting: list[int]) -> TimeoutError:
        return TimeoutError(
            f"`{self._method}` on mesh {self._mesh!r}: rank(s) {waiting} did not answer within "
            f"{timeout} s ({len(self._ranks) - len(waiting)} of {len(self._ranks)} answered)"
        )


async def bounded(call: Any, seconds: float, what: str) -> Any:
    """Await a mesh call (a ``Future``: its ``within``) or a coroutine at most ``seconds``; the
    ``TimeoutError`` says what was waited for (``what``)."""
    try:
        return await (call.within(seconds) if isinstance(call, Future) else asyncio.wait_for(call, seconds))
    except (TimeoutError, asyncio.TimeoutError):
        raise TimeoutError(f"gave up after {seconds:.0f}s waiting for {what}") from None


class Stream(Generic[R]):
    """Answers of every actor in arrival order: ``async for v in s``, ``s.iter(timeout)``, ``s.get(timeout)``."""

    def __init__(self, mesh: str, method: str, refs: list[Any], ranks: tuple[int, ...], state: MeshState):
        self._mesh = mesh
        self._method = method
        self._refs = refs
        self._ranks = ranks
        self._state = state
        self._unreleased = set(range(len(refs)))

    def _take(self, pos: int, value: Any, error: BaseException | None = None) -> Any:
        """Release position ``pos`` and return its value, or raise its translated ``error`` (an
        exception object the endpoint *returned* is a value like any other)."""
        if pos in self._unreleased:
            self._unreleased.discard(pos)
            self._state.release([self._ranks[pos]])
        if error is not None:
            raise translate(error, self._mesh, self._ranks[pos], self._method)
        return value

    def __del__(self) -> None:
        try:
            self._state.release([self._ranks[p] for p in self._unreleased])
        except Exception:
            pass

    async def __aiter__(self) -> AsyncIterator[R]:
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def on_done(pos: int, cf: Any) -> None:
            loop.call_soon_threadsafe(arrived.put_nowait, (pos, cf))

        for pos, ref in enumerate(self._refs):
            ref.future().add_done_callback(functools.partial(on_done, pos))
        for _ in self._refs:
            pos, cf = await arrived.get()
            error = cf.exception()
            yield self._take(pos, None if error else cf.result(), error)

    def iter(self, timeout: float | None = None) -> Iterator[R]:
        """Synchronous iteration; ``TimeoutError`` if not every actor answered within ``timeout``."""
        _refuse_on_loop(f"`.iter()` on the stream of `{self._method}`")
        pos_of = {ref: pos for pos, ref in enumerate(self._refs)}
        pending = list(self._refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                waiting = [self._ranks[pos_of[ref]] for ref in pending]
                raise TimeoutError(
                    f"stream of `{self._method}` on mesh {self._mesh!r}: rank(s) {waiting} did not "
                    f"answer within {timeout} s"
                )
            pos = pos_of[ready[0]]
            value, error = None, None
            try:
                value = ray.get(ready[0])
            except Exception as exc:
                error = exc
            yield self._take(pos, value, error)

    def get(self, timeout: float | None = None) -> list[R]:
        """Every answer, in arrival order."""
        return list(self.iter(timeout))


class Endpoint(Generic[P, R, L]):
    """``mesh.method``: the adverbs that call ``method`` on the actors of ``mesh``."""

    __slots__ = ("_mesh", "_method", "_label")

    def __init__(self, mesh: _ActorMeshImpl[Any], method: str, label: str | None = None):
        self._mesh = mesh
        self._method = method
        self._label = label or method  # what errors and timeouts call it (a library helper's own name)

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every actor; the answers as a ``ValueMesh`` over the mesh's dims."""
        mesh = self._mesh
        refs = mesh._submit_all(self._method, args, kwargs)
        shape: Shape = mesh._shape
        return Future(mesh._name, self._label, refs, shape.ranks, functools.partial(ValueMesh, shape), mesh._state)

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the mesh's only actor (slice the mesh down to one first)."""
        mesh = self._mesh
        if len(mesh._handles) != 1:
            raise ValueError(
                f"`{self._method}`.call_one needs a mesh of exactly one actor, but mesh "
                f"{mesh._name!r} has {len(mesh._handles)} ({mesh._shape.dims}): slice it first"
            )
        ref = mesh._submit_one(self._method, 0, args, kwargs)
        return Future(mesh._name, self._label, [ref], mesh._shape.ranks, _only, mesh._state)

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the one actor with the fewest outstanding calls from this process."""
        mesh = self._mesh
        pos = mesh._least_loaded()
        ref = mesh._submit_one(self._method, pos, args, kwargs)
        return Future(mesh._name, self._label, [ref], (mesh._shape.ranks[pos],), _only, mesh._state)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Stream[R]:
        """Call every actor; iterate over the answers as they arrive."""
        mesh = self._mesh
        refs = mesh._submit_all(self._method, args, kwargs)
        return Stream(mesh._name, self._label, refs, mesh._shape.ranks, mesh._state)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Call every actor without waiting; failures are logged and raised later (module doc)."""
        self._mesh._broadcast(self._method, args, kwargs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> L:
        raise TypeError(
            f"call endpoint `{self._method}` of mesh {self._mesh._name!r} through an adverb: "
            f".call(...), .call_one(...), .choose(...), .stream(...) or .broadcast(...)"
        )

    def __repr__(self) -> str:
        return f"Endpoint({self._mesh._name!r}.{self._method})"


def _only(values: list[T]) -> T:
    return values[0]
