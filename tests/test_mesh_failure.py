"""Dead actors on a real local Ray cluster: ActorFailure within seconds, never a hang; restarts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

from meshrl.mesh import Actor, ActorFailure, RestartEvent, current_rank, endpoint, spawn_procs, supervision

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAIL_WITHIN_S = 10.0


def first_failure(call) -> tuple[ActorFailure, float]:
    """Call ``call`` until it raises ``ActorFailure`` (Ray kills asynchronously); (error, seconds)."""
    start = time.monotonic()
    while time.monotonic() - start < FAIL_WITHIN_S:
        try:
            call()
        except ActorFailure as exc:
            return exc, time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"no ActorFailure within {FAIL_WITHIN_S} s")


class Fragile(Actor):
    def __init__(self):
        self.calls = 0
        self.gate = threading.Event()

    @endpoint
    def ping(self) -> int:
        self.calls += 1
        return self.calls

    @endpoint
    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @endpoint
    def report_failure(self, mesh: str, rank: int) -> None:
        raise ActorFailure(mesh, rank, "restarting: told by another actor")

    @endpoint
    def die_on_rank0_else_wait(self) -> int:
        if current_rank().rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self.gate.wait(120)  # far longer than the caller may wait
        return current_rank().rank


class BadInit(Actor):
    def __init__(self, setting: str):
        raise ValueError(f"bad config: {setting}")

    @endpoint
    def ping(self) -> int:
        return 1


@pytest.fixture(scope="module")
def procs(ray_cluster):
    procs = spawn_procs({"procs": 2}, cpus_per_proc=0.2, name="test-failure")
    yield procs
    procs.stop()


def test_killed_process_raises_actor_failure_within_seconds(procs):
    mesh = procs.slice(procs=0).spawn("victim", Fragile, share=0.25)
    assert mesh.ping.call_one().get(timeout=60) == 1
    start = time.monotonic()
    with pytest.raises(ActorFailure, match="actor victim/0 failed") as info:
        mesh.die.call_one().get(timeout=60)
    assert time.monotonic() - start < FAIL_WITHIN_S
    assert info.value.mesh == "victim" and info.value.rank == 0 and info.value.cause
    with pytest.raises(ActorFailure, match="victim/0"):  # and every later call, at once
        mesh.ping.call_one().get(timeout=FAIL_WITHIN_S)


def test_ray_kill_surfaces_as_actor_failure_with_the_rank(procs):
    mesh = procs.spawn("killed", Fragile, share=0.25)
    mesh.ready().get(timeout=60)
    ray.kill(ray.get_actor("killed/1"))
    failure, _ = first_failure(lambda: mesh.ping.call().get(timeout=60))
    assert failure.mesh == "killed" and failure.rank == 1
    mesh.stop()


def test_an_actor_failure_raised_in_an_endpoint_reaches_the_caller_as_itself(procs):
    # an actor that tells of a death (its own restart, a peer's) is read like Ray's own: mesh, rank, cause
    mesh = procs.slice(procs=0).spawn("teller", Fragile, share=0.25)
    with pytest.raises(ActorFailure) as info:
        mesh.report_failure.call_one("rollout", 3).get(timeout=60)
    assert type(info.value) is ActorFailure and (info.value.mesh, info.value.rank) == ("rollout", 3)
    assert info.value.restarting and any("teller/0" in n for n in info.value.__notes__)
    mesh.stop()


def test_a_death_fails_the_whole_call_without_waiting_for_the_rest(procs):
    mesh = procs.spawn("halfdead", Fragile, share=0.25)
    mesh.ready().get(timeout=60)
    start = time.monotonic()
    with pytest.raises(ActorFailure, match="halfdead/0"):
        mesh.die_on_rank0_else_wait.call().get(timeout=60)  # rank 1 would answer after 120 s
    assert time.monotonic() - start < FAIL_WITHIN_S
    mesh.stop()


def test_failing_init_raises_actor_failure_naming_the_cause(procs):
    mesh = procs.slice(procs=1).spawn("badinit", BadInit, "lr=-1", share=0.25)
    start = time.monotonic()
    with pytest.raises(ActorFailure, match=r"(?s)badinit/0 failed.*BadInit.__init__.*bad config: lr=-1"):
        mesh.ready().get(timeout=60)
    with pytest.raises(ActorFailure, match="bad config"):
        mesh.ping.call_one().get(timeout=60)
    assert time.monotonic() - start < FAIL_WITHIN_S + 20  # includes the process start


def test_supervised_actor_restarts_and_tells_the_owner(procs):
    events: list[RestartEvent] = []
    restarted = threading.Event()

    def on_restart(event: RestartEvent) -> None:
        events.append(event)
        restarted.set()

    mesh = procs.slice(procs=1).spawn("phoenix", Fragile, max_restarts=1, on_restart=on_restart, share=0.25)
    assert mesh.ping.call_one().get(timeout=60) == 1
    assert mesh.ping.call_one().get(timeout=60) == 2
    with pytest.raises(ActorFailure, match="phoenix/0"):
        mesh.die.call_one().get(timeout=60)
    # an owner about to stop waits for the report of a restart under way (settle)
    for _ in range(600):
        if restarted.is_set() or supervision.restarting() == ["phoenix/0"]:
            break
        time.sleep(0.05)
    assert supervision.settle(60) == [] and restarted.is_set(), "settle returned before the restart was reported"
    assert events[0].mesh == "phoenix" and events[0].rank == 0 and events[0].restarts == 1
    assert "actor" in events[0].cause  # Ray's words for the death
    # A fresh incarnation, with its rank context, answers again.
    assert mesh.ping.call_one().get(timeout=60) == 1
    mesh.stop()
    first_failure(lambda: mesh.ping.call_one().get(timeout=60))


class Busy(Actor):
    """A sync actor (one thread) and an async one: each answers its heartbeat during a long call."""

    @endpoint
    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


class BusyAsync(Actor):
    @endpoint
    async def work(self, seconds: float) -> int:
        time.sleep(seconds)  # blocks its event loop: the heartbeat has a loop of its own
        return os.getpid()


@pytest.mark.parametrize("cls", [Busy, BusyAsync])
def test_a_frozen_process_misses_its_heartbeat_and_is_restarted_a_busy_one_does_not(procs, cls):
    restarted = threading.Event()
    mesh = procs.spawn(f"heart-{cls.__name__}", cls, max_restarts=1, on_restart=lambda _: restarted.set(), share=0.25)
    pids = mesh.work.call(0).get(timeout=60).values()
    busy = mesh.work.call(4)  # both ranks in a long call
    assert asyncio.run(mesh.heartbeat(2.0)) == {0: "alive", 1: "alive"}
    assert busy.get(timeout=60).values() == pids
    os.kill(pids[1], signal.SIGSTOP)
    try:
        assert asyncio.run(mesh.heartbeat(2.0)) == {0: "alive", 1: "hung"}
        mesh.kill(1)  # what the pipeline does with a hung rank
        assert restarted.wait(60), "the killed rank was not restarted"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the kill did not land: never leave a stopped process
            os.kill(pids[1], signal.SIGCONT)
    again = mesh.work.call(0).get(timeout=60).values()
    assert again[0] == pids[0] and again[1] != pids[1]
    assert asyncio.run(mesh.heartbeat(10.0)) == {0: "alive", 1: "alive"}
    mesh.stop()  # (Ray kills asynchronously)
    deadline = time.monotonic() + FAIL_WITHIN_S
    while (beat := asyncio.run(mesh.heartbeat(2.0))) != {0: "down", 1: "down"} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert beat == {0: "down", 1: "down"}


def test_async_on_restart_runs_after_the_spawning_loop_has_closed(procs):
    """Spawned inside an ``asyncio.run`` that has returned: the async callback cannot go to that
    loop, so it must run on the supervision thread (it raised "Event loop is closed", only logged)."""
    restarted = threading.Event()

    async def on_restart(event: RestartEvent) -> None:
        await asyncio.sleep(0)
        restarted.set()

    async def spawn():
        return procs.slice(procs=1).spawn("phoenix_async", Fragile, max_restarts=1, on_restart=on_restart, share=0.25)

    mesh = asyncio.run(spawn())
    assert mesh.ping.call_one().get(timeout=60) == 1
    with pytest.raises(ActorFailure, match="phoenix_async/0"):
        mesh.die.call_one().get(timeout=60)
    assert restarted.wait(60), "the async on_restart never ran"
    mesh.stop()


def test_stop_during_on_restart_does_not_watch_the_stopped_actor_again(procs, caplog):
    """A restart's callback runs on the supervision thread when ``spawn`` had no event loop; a
    ``stop()`` meanwhile must not be undone when the callback returns: the killed actor would be
    watched again and reported as "died and was not restarted" after a deliberate shutdown."""
    in_callback, release = threading.Event(), threading.Event()

    def slow_on_restart(event: RestartEvent) -> None:
        in_callback.set()
        release.wait(60)  # e.g. reloading the restarted actor's state

    mesh = procs.slice(procs=0).spawn("interrupted", Fragile, max_restarts=2, on_restart=slow_on_restart, share=0.25)
    mesh.ready().get(timeout=60)
    with pytest.raises(ActorFailure, match="interrupted/0"):
        mesh.die.call_one().get(timeout=60)
    assert in_callback.wait(60), "on_restart was not called"
    caplog.set_level("WARNING", logger="meshrl.mesh")
    caplog.clear()
    mesh.stop()
    release.set()
    # the thread ends once it supervises nothing: after that no report can come any more
    for thread in [t for t in threading.enumerate() if t.name == "meshrl-supervisor"]:
        thread.join(30)
        assert not thread.is_alive(), "the supervision thread still watches a stopped mesh"
    reports = [r.getMessage() for r in caplog.records if r.name == "meshrl.mesh" and "interrupted" in r.getMessage()]
    assert reports == [], f"a deliberately stopped actor was reported: {reports}"


class Member(Fragile):
    @endpoint
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    @endpoint
    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_group_is_re_created_after_a_supervised_restart(procs):
    """The documented recovery (re-create the whole group) timed out on every rank: the rendezvous key
    counted init calls per process, and the restarted process counted from 0 again while the other
    was at 1. init_torch_distributed_on now hands every rank one fresh key."""
    from meshrl.mesh import init_torch_distributed_on

    restarted = threading.Event()
    mesh = procs.spawn("regroup", Member, max_restarts=1, on_restart=lambda _: restarted.set(), share=0.25)
    try:
        init_torch_distributed_on(mesh, backend="gloo", timeout=30).get(timeout=90)
        assert mesh.all_reduce.call().get(timeout=60).values() == [2.0, 2.0]
        with pytest.raises(ActorFailure):
            mesh.slice(procs=1).die.call_one().get(timeout=60)
        assert restarted.wait(60), "the actor was not restarted"
        mesh.ready().get(timeout=60)
        mesh.leave.call().get(timeout=60)  # the survivor leaves its broken group
        info = init_torch_distributed_on(mesh, backend="gloo", timeout=30).get(timeout=90)
        assert [i["world_size"] for i in info.values()] == [2, 2]
        assert mesh.all_reduce.call().get(timeout=60).values() == [2.0, 2.0]
    finally:
        mesh.stop()


def test_a_stopped_proc_mesh_refuses_to_spawn(ray_cluster):
    """After stop() its reservation is gone: a spawn on it (or a view of it) returned actors that could
    never be placed, and every call on them waited out its timeout."""
    procs = spawn_procs({"procs": 2}, cpus_per_proc=0.05, name="stopped")
    view = procs.slice(procs=0)
    procs.stop()
    for handle in (procs, view):
        with pytest.raises(RuntimeError, match="proc mesh 'stopped' was stopped: spawn_procs"):
            handle.spawn("late", Fragile)
