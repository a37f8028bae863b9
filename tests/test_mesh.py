"""Actor meshes on a real local Ray cluster: every adverb, slicing, ranks, errors and threading."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Iterator

import pytest
import ray.cloudpickle

from meshrl.mesh import Actor, ActorMesh, ProcMesh, ValueMesh, current_rank, current_size, endpoint, spawn_procs

# Ray workers cannot import test modules: ship this module's classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter(Actor):
    """A sync actor: calls run one at a time, in order."""

    def __init__(self, start: int):
        self.value = start
        self.init_rank = current_rank().rank

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    def read(self) -> int:
        return self.value

    @endpoint
    def where(self) -> dict:
        r = current_rank()
        return {"rank": r.rank, "coords": dict(r), "size": current_size(), "init_rank": self.init_rank,
                "env": os.environ.get("MESHRL_TEST_ENV"), "omp": os.environ.get("OMP_NUM_THREADS")}

    @endpoint
    def fail(self, message: str) -> None:
        raise KeyError(message)

    @endpoint
    def relay(self, other: ActorMesh[Waiter], x: int) -> int:
        # A sync endpoint calls another mesh synchronously.
        return other.echo.call_one(x).get(timeout=30)

    def helper(self) -> None:
        """Not an endpoint."""


class Waiter(Actor):
    """An async actor with a sync endpoint that blocks, to check the threading rule."""

    def __init__(self):
        self.gates: dict[str, asyncio.Event] = {}  # by key: async calls may start out of order
        self.sync_gate = threading.Event()
        self.sync_active = 0
        self.sync_max = 0

    @endpoint
    async def echo(self, x: int) -> int:
        return x

    @endpoint
    async def rank(self) -> int:
        return current_rank().rank

    @endpoint
    async def hold(self, key: str) -> int:
        await self.gates.setdefault(key, asyncio.Event()).wait()
        return current_rank().rank

    @endpoint
    async def open_gate(self, key: str) -> None:
        self.gates.setdefault(key, asyncio.Event()).set()

    @endpoint
    async def rank_or_wait(self, key: str) -> int:
        if current_rank().rank == 0:
            await self.gates.setdefault(key, asyncio.Event()).wait()
        return current_rank().rank

    @endpoint
    def block(self) -> int:
        self.sync_active += 1
        self.sync_max = max(self.sync_max, self.sync_active)
        self.sync_gate.wait(30)
        self.sync_active -= 1
        return self.sync_max

    @endpoint
    async def blocked(self) -> int:
        return self.sync_active

    @endpoint
    async def unblock(self) -> None:
        self.sync_gate.set()

    @endpoint
    async def relay(self, other: ActorMesh[Counter], by: int) -> int:
        # An async endpoint awaits another mesh.
        return await other.slice(a=0, b=0).incr.call_one(by)


@pytest.fixture(scope="module")
def procs(ray_cluster) -> Iterator[ProcMesh]:
    procs = spawn_procs({"a": 2, "b": 2}, cpus_per_proc=0.1, env={"MESHRL_TEST_ENV": "yes"}, name="test-mesh")
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def counters(procs) -> ActorMesh[Counter]:
    mesh = procs.spawn("counters", Counter, 10, share=0.5)
    mesh.ready().get(timeout=60)
    return mesh


@pytest.fixture(scope="module")
def waiters(procs) -> ActorMesh[Waiter]:
    mesh = procs.slice(a=0).spawn("waiters", Waiter, share=0.5)
    mesh.ready().get(timeout=60)
    return mesh


def test_shape_names_and_ranks(counters):
    assert counters.sizes == {"a": 2, "b": 2} and len(counters) == 4
    where = counters.where.call().get(timeout=30)
    assert isinstance(where, ValueMesh) and where.sizes == {"a": 2, "b": 2}
    for coords, w in where.items():
        assert w["coords"] == coords
        assert w["rank"] == w["init_rank"] == coords["a"] * 2 + coords["b"]
        assert w["size"] == {"a": 2, "b": 2}
        assert w["env"] == "yes" and w["omp"] == "1"  # spawn env merges with the job's env
    import ray

    assert ray.get_actor("counters/3") is not None


def test_rank_is_only_known_inside_actors():
    with pytest.raises(RuntimeError, match="not inside a mesh actor"):
        current_rank()


def test_call_returns_one_value_per_rank(counters):
    before = counters.read.call().get(timeout=30)
    after = counters.incr.call(2).get(timeout=30)
    assert [b + 2 for b in before.values()] == after.values()
    assert after.item(a=1, b=0) == before.item(a=1, b=0) + 2


def test_slicing_keeps_or_drops_dims(counters):
    row = counters.slice(a=1)
    assert row.sizes == {"b": 2} and len(row) == 2
    assert [w["rank"] for w in row.where.call().get(timeout=30).values()] == [2, 3]
    col = counters.slice(b=slice(1, 2))
    assert col.sizes == {"a": 2, "b": 1}
    assert [w["rank"] for w in col.where.call().get(timeout=30).values()] == [1, 3]
    flat = counters.flatten("all")
    assert flat.sizes == {"all": 4}
    assert [w["rank"] for w in flat.where.call().get(timeout=30).values()] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="no dim named 'c'"):
        counters.slice(c=0)


def test_call_one_needs_exactly_one_actor(counters):
    one = counters.slice(a=1, b=1)
    assert one.where.call_one().get(timeout=30)["rank"] == 3
    with pytest.raises(ValueError, match=r"exactly one actor.*'counters' has 2"):
        counters.slice(a=0).read.call_one()


def test_non_endpoints_are_refused(counters):
    with pytest.raises(AttributeError, match="`helper` is not an endpoint: decorate it with `@endpoint`"):
        counters.helper
    with pytest.raises(AttributeError, match="`missing` is not an endpoint of Counter"):
        counters.missing
    with pytest.raises(TypeError, match="through an adverb"):
        counters.read()


def test_broadcast_then_call_sees_its_effect(counters):
    before = counters.read.call().get(timeout=30).values()
    counters.incr.broadcast(5)
    counters.flush().get(timeout=30)
    assert counters.read.call().get(timeout=30).values() == [b + 5 for b in before]


def test_broadcast_failure_surfaces_on_flush_and_on_next_call(counters):
    counters.slice(a=0, b=0).fail.broadcast("boom")
    with pytest.raises(KeyError, match="boom") as info:
        counters.flush().get(timeout=30)
    assert "counters/0" in "".join(info.value.__notes__)
    counters.read.call().get(timeout=30)  # reported once, then forgotten

    counters.slice(a=1, b=1).fail.broadcast("later")
    deadline = time.monotonic() + 20
    with pytest.raises(KeyError, match="later"):
        while time.monotonic() < deadline:  # the failure is raised by some later call
            counters.read.call().get(timeout=30)
            time.sleep(0.05)


class Sender(Actor):
    """Gets a mesh as an argument, broadcasts to it and returns: no copy of it is left in its process."""

    @endpoint
    def send_failing(self, target: ActorMesh[Counter]) -> None:
        target.slice(a=0, b=0).fail.broadcast("sent and forgotten")

    @endpoint
    def collect(self) -> None:
        import gc

        gc.collect()  # the first copy (held in cycles) is gone

    @endpoint
    def flush_again(self, target: ActorMesh[Counter]) -> str:
        try:
            target.flush().get(timeout=30)
        except KeyError as exc:
            return str(exc)
        return "no failure reported"


def test_a_broadcast_failure_outlives_the_mesh_copy_that_sent_it(procs, counters):
    """The pending broadcasts and their failures lived only while some copy of the mesh did: an actor
    that broadcast through a mesh it got as an argument lost the failure at the next GC, and a later
    flush reported success."""
    sender = procs.slice(a=1, b=1).spawn("sender", Sender, share=0.01)
    try:
        sender.send_failing.call_one(counters).get(timeout=30)
        sender.collect.call_one().get(timeout=30)
        assert "sent and forgotten" in sender.flush_again.call_one(counters).get(timeout=60)
    finally:
        sender.stop()


def test_endpoint_exception_keeps_type_message_and_remote_traceback(counters):
    with pytest.raises(KeyError) as info:
        counters.slice(a=0, b=1).fail.call_one("no such key").get(timeout=30)
    text = str(info.value)
    assert "no such key" in text and "in fail" in text  # the remote frame
    assert any("endpoint `fail` of actor counters/1" in n for n in info.value.__notes__)


def test_stream_yields_in_arrival_order(waiters):
    async def run():
        stream = waiters.rank_or_wait.stream("stream")
        seen = []
        async for rank in stream:
            seen.append(rank)
            if len(seen) == 1:  # rank 0 waits until rank 1 has been seen
                await waiters.slice(b=0).open_gate.call_one("stream")
        return seen

    assert asyncio.run(run()) == [1, 0]
    stream = waiters.echo.stream(3)
    assert sorted(stream.get(timeout=30)) == [3, 3]


def test_stream_passes_an_exception_the_endpoint_returned_as_a_value(waiters):
    """Only a call that raised is an error: an exception object returned as a result is a value,
    as ``call`` treats it (it used to raise from ``stream``)."""
    returned = [repr(v) for v in waiters.echo.stream(ValueError("a value")).get(timeout=30)]
    assert returned == [repr(ValueError("a value"))] * 2

    async def collect():
        return [repr(v) async for v in waiters.echo.stream(KeyError("k"))]

    assert asyncio.run(collect()) == [repr(KeyError("k"))] * 2


def test_choose_picks_the_least_loaded(waiters):
    async def run():
        first = waiters.hold.choose("choose")
        second = waiters.hold.choose("choose")  # rank of `first` has one call outstanding
        await waiters.open_gate.call("choose").within(30)
        return await first.within(30), await second.within(30)

    assert sorted(asyncio.run(run())) == [0, 1]
    # Idle actors are taken in turn.
    ranks = [waiters.rank.choose().get(timeout=30) for _ in range(4)]
    assert ranks[:2] == ranks[2:] and sorted(ranks[:2]) == [0, 1]


def test_a_cancelled_wait_keeps_counting_the_call_as_load_until_it_ends(waiters):
    """A choose() awaited under asyncio.wait_for and cancelled gave its rank's load back while the call
    still ran there: the next choose() sent work to the busy actor."""

    async def run() -> tuple[int, list[int]]:
        busy = waiters.hold.choose("cancel-load")
        busy_rank = waiters._state.outstanding.index(1)
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(busy, 0.2)  # cancels the await only: `hold` still runs on its actor
        picks = [await waiters.rank.choose().within(30) for _ in range(3)]  # idle ranks would take turns
        await waiters.open_gate.call("cancel-load").within(30)
        return busy_rank, picks

    busy_rank, picks = asyncio.run(run())
    assert busy_rank not in picks, (busy_rank, picks)
    deadline = time.monotonic() + 20
    while any(waiters._state.outstanding) and time.monotonic() < deadline:  # the held call's end releases it
        time.sleep(0.05)
    assert waiters._state.outstanding == [0, 0]


def test_flush_waits_for_the_broadcasts_before_it_on_the_loop(waiters):
    """flush() polled on a thread holding a lock every other call on the mesh waited for (the loop
    stalled), could not be cancelled, and waited for broadcasts sent after it too."""
    w0 = waiters.slice(b=0)

    async def run() -> tuple[float, bool]:
        w0.hold.broadcast("flush-1")
        flush = w0.flush()
        w0.hold.broadcast("flush-2")  # after the flush: not waited for
        with pytest.raises(TimeoutError, match=r"1 of the 1 broadcast call\(s\) sent before it did not finish"):
            await flush.within(0.3)
        t0 = time.monotonic()
        for _ in range(5):
            await w0.echo.call_one(1).within(30)  # not held up by a pending flush
        quick = time.monotonic() - t0
        waiting = asyncio.ensure_future(w0.flush().within(30))
        await asyncio.sleep(0.2)
        waiting.cancel()  # a cancelled flush leaves no thread behind
        await w0.open_gate.call_one("flush-1").within(30)
        await flush.within(30)  # done although "flush-2", sent after it, still holds
        return quick, not any(t.name.startswith("asyncio_") for t in threading.enumerate())

    quick, no_threads = asyncio.run(run())
    assert quick < 5 and no_threads
    w0.open_gate.call_one("flush-2").get(timeout=30)
    w0.flush().get(timeout=30)


def test_sync_endpoint_of_async_actor_runs_off_the_loop(waiters):
    one = waiters.slice(b=1)
    blocked = [one.block.call_one(), one.block.call_one()]
    deadline = time.monotonic() + 30
    # The event loop still answers while a sync endpoint blocks its thread.
    while one.blocked.call_one().get(timeout=10) == 0:
        assert time.monotonic() < deadline, "the sync endpoint never started"
        time.sleep(0.02)
    assert one.echo.call_one(7).get(timeout=10) == 7
    one.unblock.call_one().get(timeout=10)
    assert [f.get(timeout=30) for f in blocked] == [1, 1]  # sync endpoints never overlapped


def test_meshes_are_picklable_and_callable_from_actors(counters, waiters):
    assert counters.slice(a=1, b=0).relay.call_one(waiters.slice(b=0), 42).get(timeout=30) == 42
    before = counters.slice(a=0, b=0).read.call_one().get(timeout=30)
    assert waiters.slice(b=1).relay.call_one(counters, 3).get(timeout=30) == before + 3


def test_await_from_the_driver_loop_and_get_refuses_to_block_it(counters):
    async def run():
        values = await counters.read.call()
        with pytest.raises(RuntimeError, match="would block the running event loop"):
            counters.read.call().get()
        return values

    assert len(asyncio.run(run())) == 4


def test_timeouts_name_what_was_waited_for(waiters):
    pending = waiters.hold.call("timeouts")
    with pytest.raises(TimeoutError, match=r"`hold` on mesh 'waiters': rank\(s\) \[0, 1\] did not answer"):
        pending.get(timeout=0.2)

    async def run():
        with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
            await pending.within(0.2)

    asyncio.run(run())
    waiters.open_gate.call("timeouts").get(timeout=30)
    assert sorted(pending.get(timeout=30).values()) == [0, 1]


def test_spawn_refuses_bad_input(procs, counters, waiters):
    with pytest.raises(TypeError, match="subclass of meshrl.mesh.Actor"):
        procs.spawn("x", object)
    with pytest.raises(ValueError, match="without '/'"):
        procs.spawn("a/b", Counter, 0)
    with pytest.raises(ValueError, match=r"processes \[0, 1\] of proc mesh 'test-mesh' have 0.00 .* share=0.5"):
        procs.spawn("third", Counter, 0, share=0.5)  # counters and waiters took rows a=0

    class Clash(Actor):
        @endpoint
        def stop(self) -> None: ...

    with pytest.raises(ValueError, match=r"\['stop'\] of Clash shadow ActorMesh methods"):
        procs.spawn("clash", Clash)


def test_a_mesh_name_is_unique_per_namespace(ray_cluster, counters):
    """Actors are named ``name/rank`` in a Ray namespace: a second "counters" mesh clashes in the
    driver's, and lives beside the first in a namespace of its own."""
    other = spawn_procs({"a": 1}, cpus_per_proc=0.01, name="other")
    try:
        with pytest.raises(ValueError, match=r"an actor named 'counters/0' already exists: .*spawn_procs\(namespace"):
            other.spawn("counters", Counter, 0)
    finally:
        other.stop()
    apart = spawn_procs({"a": 1}, cpus_per_proc=0.01, name="apart", namespace="test-apart")
    try:
        mesh = apart.spawn("counters", Counter, 5, share=0.5)
        assert mesh.incr.call(1).get(timeout=60).values() == [6]
        assert ray_cluster.get_actor("counters/0", namespace="test-apart") is not None
        with pytest.raises(ValueError, match="already exists in Ray namespace 'test-apart'"):
            apart.spawn("counters", Counter, 0, share=0.5)
    finally:
        apart.stop()


def test_unplaceable_proc_mesh_times_out_with_the_reason(ray_cluster):
    with pytest.raises(TimeoutError, match=r"'gpu-mesh'.*'GPU': 1"):
        spawn_procs({"gpus": 1}, cpus_per_proc=0.1, name="gpu-mesh", timeout=0.5)
    with pytest.raises(ValueError, match='"hosts" is the dim'):
        spawn_procs({"hosts": 2})


def test_stopping_a_mesh_through_a_view_of_all_its_actors_gives_the_share_back(ray_cluster):
    """Only the spawned handle gave the processes' share back: stopping the same actors through a
    flattened view left the share taken, and the next spawn was refused."""
    procs = spawn_procs({"a": 2}, cpus_per_proc=0.02, name="view-stop")
    try:
        first = procs.spawn("first", Counter, 0)
        first.flatten("all").stop()
        second = procs.spawn("second", Counter, 1)  # refused before: "0.00 of their resources left"
        assert second.read.call().get(timeout=60).values() == [1, 1]
        second.slice(a=0).stop()  # a part of it: the share stays taken
        with pytest.raises(ValueError, match="resources left"):
            procs.spawn("third", Counter, 2)
    finally:
        procs.stop()


def test_cpu_procs_reserve_no_whole_cores_unless_asked(ray_cluster):
    """A new user's first script on a 2-core laptop: four processes, and four more beside them while
    the first mesh lives, place at once (each used to reserve a whole CPU and wait 60 s in vain)."""
    first = spawn_procs({"procs": 4}, name="laptop-a", timeout=10)
    try:
        second = spawn_procs({"procs": 4}, name="laptop-b", timeout=10)
        try:
            mesh = second.spawn("counters-b", Counter, 1)
            assert mesh.incr.call(1).get(timeout=60).values() == [2] * 4
        finally:
            second.stop()
        # asked for, whole cores are reserved: a third mesh of 4 whole CPUs cannot place beside the first
        with pytest.raises(TimeoutError, match=r"'greedy'.*needs \{'CPU': 4\.0\} on one node, and the cluster has \{'CPU': 2\.\d+\} less free"):
            spawn_procs({"procs": 4}, cpus_per_proc=1.0, name="greedy", timeout=0.5)
    finally:
        first.stop()


def test_a_mesh_is_pinned_by_a_resource_and_packed_by_groups(ray_cluster):
    """``resources=`` pins a mesh to the nodes that have them (one it never finds times out naming
    it, and how to give it); ``pack=dim`` reserves one bundle per group (a bundle never spans
    nodes), ``pack=False`` one per process that Ray may spread; ``resources={"CPU": 1}`` asks for
    whole cores."""
    node = f"node:{ray_cluster.util.get_node_ip_address()}"
    groups = spawn_procs({"replica": 2, "tp": 2}, resources={node: 0.01}, pack="tp", name="pack-tp", timeout=10)
    loose = spawn_procs({"procs": 3}, pack=False, name="pack-none", timeout=10)
    try:
        assert groups._bundle_of == (0, 0, 1, 1) and loose._bundle_of == (0, 1, 2)
        table = ray_cluster.util.placement_group_table(groups._pg)
        assert table["strategy"] == "PACK" and [b[node] for b in table["bundles"].values()] == [0.02, 0.02]
        mesh = groups.spawn("pack-counters", Counter, 0)
        assert mesh.incr.call(1).get(timeout=60).values() == [1] * 4
        assert set(groups.nodes()) == set(loose.nodes()) and len(set(groups.nodes())) == 1
    finally:
        groups.stop()
        loose.stop()
    with pytest.raises(TimeoutError, match=r"'pinned'.*no node has 'trainer_node' \(give it with ray start "
                                           r"--resources='\{\"trainer_node\": N\}'\)"):
        spawn_procs({"procs": 1}, resources={"trainer_node": 0.01}, name="pinned", timeout=0.5)
    with pytest.raises(ValueError, match=r"resources\['CPU'\] and cpus_per_proc"):
        spawn_procs({"procs": 1}, cpus_per_proc=1, resources={"CPU": 1})
    with pytest.raises(ValueError, match=r"pack='tp' names no dim"):
        spawn_procs({"procs": 2}, pack="tp")
    cores = spawn_procs({"procs": 1}, resources={"CPU": 1}, name="one-core", timeout=10)
    try:
        assert ray_cluster.util.placement_group_table(cores._pg)["bundles"][0]["CPU"] == 1
    finally:
        cores.stop()
