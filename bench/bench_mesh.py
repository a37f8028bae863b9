"""The mesh layer's overhead over raw Ray: each case beside the same operation on raw actor handles.

Run: ``OMP_NUM_THREADS=1 pytest bench/bench_mesh.py --benchmark-only -s`` (``-s`` prints the
ratio table at the end). Both sides of a pair drive the *same* actor processes (the raw side uses
the mesh's own Ray handles), so the only difference is meshrl's Python on the caller's side.

Cases (one pytest-benchmark group each, three entries per group):

- ``call_one_sync``: one call to a sync endpoint, waited with ``.get()`` / ``ray.get``.
- ``call_one_async``: 20 sequential ``await``s of an async endpoint on the driver's event loop.
- ``choose``: one call to the least-loaded of 8 actors / round-robin over raw handles.
- ``broadcast``: 10 fire-and-forget calls to 8 actors, then one call to all 8 as a barrier.
- ``fanout8_sync`` / ``fanout8_async``: one call to 8 actors, all answers gathered.

Entries: ``test_ray[case]`` and ``test_mesh[case]`` time each side alone; ``test_interleaved[case]``
alternates the two within every round (order flipped each round), so load from other processes on
the machine hits both sides alike: its ``extra_info`` holds the medians and the ratio, and the
printed table is made from it.

Simplification on purpose: a local cluster on a shared 2-core machine, so absolute latencies are
those of a busy laptop; the ratios are what this file is for.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from typing import Callable

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402

from meshrl.mesh import Actor, endpoint, spawn_procs  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FANOUT = 8
ASYNC_CALLS = 20
BROADCASTS = 10
_ratios: dict[str, tuple[float, float]] = {}


class SyncEcho(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


class AsyncEcho(Actor):
    @endpoint
    async def echo(self, x: int) -> int:
        return x


def _cases(sync, asyn, loop) -> dict[str, tuple[Callable[[], object], Callable[[], object], int]]:
    """case → (raw Ray operation, meshrl operation, rounds)."""
    handles = sync._handles
    first = handles[0]
    one = sync.slice(procs=0)
    async_handle = asyn._handles[0]
    turn = [0]

    def ray_choose():
        turn[0] += 1
        return ray.get(handles[turn[0] % FANOUT].echo.remote(1), timeout=30)

    async def ray_awaits():
        for i in range(ASYNC_CALLS):
            await async_handle.echo.remote(i)

    async def mesh_awaits():
        for i in range(ASYNC_CALLS):
            await asyn.echo.call_one(i)

    def ray_broadcast():
        for i in range(BROADCASTS):
            for h in handles:
                h.echo.remote(i)
        ray.get([h.echo.remote(0) for h in handles], timeout=60)

    def mesh_broadcast():
        for i in range(BROADCASTS):
            sync.echo.broadcast(i)
        sync.echo.call(0).get(timeout=60)

    async def ray_gather():
        return await asyncio.gather(*[h.echo.remote(1) for h in handles])

    async def mesh_gather():
        return await sync.echo.call(1)

    return {
        "call_one_sync": (
            lambda: ray.get(first.echo.remote(1), timeout=30),
            lambda: one.echo.call_one(1).get(timeout=30),
            300,
        ),
        "call_one_async": (
            lambda: loop.run_until_complete(ray_awaits()),
            lambda: loop.run_until_complete(mesh_awaits()),
            30,
        ),
        "choose": (ray_choose, lambda: sync.echo.choose(1).get(timeout=30), 300),
        "broadcast": (ray_broadcast, mesh_broadcast, 30),
        "fanout8_sync": (
            lambda: ray.get([h.echo.remote(1) for h in handles], timeout=30),
            lambda: sync.echo.call(1).get(timeout=30),
            100,
        ),
        "fanout8_async": (
            lambda: loop.run_until_complete(ray_gather()),
            lambda: loop.run_until_complete(mesh_gather()),
            100,
        ),
    }


CASES = ["call_one_sync", "call_one_async", "choose", "broadcast", "fanout8_sync", "fanout8_async"]


@pytest.fixture(scope="module")
def cases():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    procs = spawn_procs({"procs": FANOUT}, cpus_per_proc=0.1, name="bench-mesh")
    sync = procs.spawn("bench-sync", SyncEcho, share=0.5)
    asyn = procs.slice(procs=0).spawn("bench-async", AsyncEcho, share=0.5)
    sync.ready().get(timeout=120)
    asyn.ready().get(timeout=120)
    loop = asyncio.new_event_loop()
    yield _cases(sync, asyn, loop)
    _print_ratios()
    loop.close()
    procs.stop()
    if started:
        ray.shutdown()


def _warmup(rounds: int) -> int:
    return max(3, rounds // 10)


def _pedantic(benchmark, fn, rounds: int) -> None:
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=_warmup(rounds))


@pytest.mark.parametrize("case", CASES)
def test_ray(benchmark, cases, case):
    benchmark.group = case
    raw, _, rounds = cases[case]
    _pedantic(benchmark, raw, rounds)


@pytest.mark.parametrize("case", CASES)
def test_mesh(benchmark, cases, case):
    benchmark.group = case
    _, mesh, rounds = cases[case]
    _pedantic(benchmark, mesh, rounds)


@pytest.mark.parametrize("case", CASES)
def test_interleaved(benchmark, cases, case):
    benchmark.group = case
    raw, mesh, rounds = cases[case]
    times: dict[str, list[float]] = {"raw": [], "mesh": []}
    flip = [False]

    def both():
        flip[0] = not flip[0]
        order = [("raw", raw), ("mesh", mesh)] if flip[0] else [("mesh", mesh), ("raw", raw)]
        for side, fn in order:
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)

    _pedantic(benchmark, both, rounds)
    # the warm-up rounds also ran both(): leave them out, as pytest-benchmark's own stats do
    raw_ms, mesh_ms = (statistics.median(times[s][_warmup(rounds):]) * 1e3 for s in ("raw", "mesh"))
    benchmark.extra_info.update(raw_median_ms=raw_ms, mesh_median_ms=mesh_ms, ratio=mesh_ms / raw_ms)
    _ratios[case] = (raw_ms, mesh_ms)


def _print_ratios() -> None:
    """The table this file exists for: meshrl / raw Ray, medians of the interleaved runs."""
    if not _ratios:
        return
    print("\ncase              raw Ray (ms)   meshrl (ms)   meshrl / raw   (interleaved medians)")
    for case, (raw_ms, mesh_ms) in _ratios.items():
        print(f"{case:16s} {raw_ms:12.3f} {mesh_ms:13.3f} {mesh_ms / raw_ms:14.3f}")
