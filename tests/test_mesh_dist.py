"""torch.distributed inside meshes, on real gloo process groups between real Ray actors."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle

from meshrl.mesh import (
    Actor,
    actor_address,
    current_device_mesh,
    current_rank,
    endpoint,
    init_torch_distributed,
    init_torch_distributed_on,
    join_process_group,
    spawn_procs,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Starting four torch-importing processes on two shared cores takes 10-20 s.
pytestmark = pytest.mark.slow


class Worker(Actor):
    def __init__(self):
        import torch

        torch.set_num_threads(1)
        self.groups = {}

    @endpoint
    def all_reduce(self) -> dict:
        import torch
        import torch.distributed as dist

        dm = current_device_mesh()
        world = torch.tensor([float(current_rank().rank + 1)])
        dist.all_reduce(world)
        along_tp = torch.tensor([float(current_rank().rank + 1)])
        dist.all_reduce(along_tp, group=dm.get_group("tp"))
        return {"world": world.item(), "tp": along_tp.item(), "dims": dm.mesh_dim_names, "shape": tuple(dm.shape)}

    @endpoint
    def join_and_broadcast(self, rank_offset: int, world: int, addr: str, port: int) -> list[float]:
        import torch
        import torch.distributed as dist

        rank = rank_offset + current_rank().rank
        pg = join_process_group("weights", rank, world, addr, port, backend="gloo", timeout=60)
        t = torch.arange(4, dtype=torch.float32) * 10 if rank == 0 else torch.zeros(4)
        dist.broadcast(t, src=0, group=pg)
        dist.destroy_process_group(pg)
        return t.tolist()

    @endpoint
    def init_alone(self, timeout: float) -> str:
        from meshrl.mesh import init_torch_distributed

        try:
            init_torch_distributed(timeout=timeout)
        except TimeoutError as exc:
            return str(exc)
        return "joined"

    @endpoint
    def has_default_group(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized()


@pytest.fixture(scope="module")
def trainers(ray_cluster):
    """A 2-D {dp: 2, tp: 2} mesh with a gloo group and a DeviceMesh in every actor."""
    procs = spawn_procs({"dp": 2, "tp": 2}, cpus_per_proc=0.1, name="test-dist")
    mesh = procs.spawn("trainers", Worker)
    info = init_torch_distributed_on(mesh, timeout=60).get(timeout=120)
    assert [i["rank"] for i in info.values()] == [0, 1, 2, 3]
    assert {i["backend"] for i in info.values()} == {"gloo"} and {i["world_size"] for i in info.values()} == {4}
    yield mesh
    procs.stop()


def test_gloo_all_reduce_over_the_mesh_and_along_an_axis(trainers):
    out = trainers.all_reduce.call().get(timeout=60)
    for coords, o in out.items():
        assert o["world"] == 1 + 2 + 3 + 4
        dp = coords["dp"]
        assert o["tp"] == (2 * dp + 1) + (2 * dp + 2)  # ranks 2dp, 2dp+1 are one tp group
        assert o["dims"] == ("dp", "tp") and o["shape"] == (2, 2)


def test_the_rendezvous_key_is_removed_once_the_group_stands(trainers):
    """Rank 0 published its store's address in Ray's KV under a key per group, and nobody removed
    it: a long-lived cluster that re-creates groups piled them up."""
    from ray.experimental import internal_kv

    assert internal_kv._internal_kv_list(f"{trainers._uid}/dist/", namespace="meshrl") == []


def test_two_meshes_join_one_group_and_broadcast(trainers):
    # One side has a default group already (the trainers), the other has none.
    senders = trainers.slice(dp=0)
    procs = spawn_procs({"procs": 2}, cpus_per_proc=0.1, name="test-dist-receivers")
    receivers = procs.spawn("receivers", Worker)
    assert receivers.has_default_group.call().get(timeout=60).values() == [False, False]
    addr, port = actor_address(senders.slice(tp=0)).get(timeout=30)
    a = senders.join_and_broadcast.call(0, 4, addr, port)
    b = receivers.join_and_broadcast.call(2, 4, addr, port)
    expected = [0.0, 10.0, 20.0, 30.0]
    assert a.get(timeout=90).values() == [expected] * 2
    assert b.get(timeout=90).values() == [expected] * 2
    # A rendezvous whose rank 0 never comes times out and says what it waited for.
    alone = receivers.slice(procs=1).init_alone.call_one(1.0).get(timeout=60)
    assert "rank 1 of mesh 'receivers' waited 1.0 s for rank 0" in alone
    procs.stop()


def test_init_outside_a_whole_mesh_is_refused(trainers):
    with pytest.raises(ValueError, match="needs every actor of mesh 'trainers'"):
        init_torch_distributed_on(trainers.slice(dp=0))
    with pytest.raises(RuntimeError, match="not inside a mesh actor"):
        init_torch_distributed()


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range(monkeypatch):
    """A port found by binding port 0 is an ephemeral one, which any outgoing connection (a gloo
    pair, Ray's gRPC) can take before the group's store binds it: free_ports draws from below."""
    import socket

    from meshrl import groups as distributed  # where the port helpers live (meshrl.mesh re-exports them)
    from meshrl.mesh import free_ports

    low, _ = distributed._ephemeral_ports()
    ports = free_ports(32)
    assert len(set(ports)) == 32
    assert all(distributed._FIRST_FREE_PORT <= p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # still free
    # No room below the ephemeral range: the OS picks.
    monkeypatch.setattr(distributed, "_ephemeral_ports", lambda: (distributed._FIRST_FREE_PORT + 10, 60999))
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(p > distributed._FIRST_FREE_PORT + 10 for p in ports)
