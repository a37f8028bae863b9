"""torch.distributed bootstrap inside mesh actors, and extra groups that span two meshes.

``init_torch_distributed()`` runs in every actor of a mesh (in ``__init__``, in an endpoint, or
from the driver with ``init_torch_distributed_on(mesh)``). World = the spawned mesh, rank = the
actor's flat rank. Rendezvous: rank 0 opens a ``TCPStore`` on a port the OS picks (no race
between "find a free port" and "bind it"), and publishes ``ip:port`` in Ray's internal key-value
store under the mesh's id; the other ranks poll for it, bounded by ``timeout``. Backend: NCCL
when the actor was given a GPU, gloo otherwise. The result is a ``DeviceMesh`` whose axis names
are the mesh dims.

GPUs: Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's own GPU(s), so the actor's device is
``cuda:0`` and ``LOCAL_RANK`` is set to ``0`` (the device index, which is what torch and most
training code use it for); with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` set, it is the
Ray-assigned GPU id instead. ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are
set as a launcher would.

``join_process_group`` (``meshrl.groups``, re-exported here) builds an extra group over processes
of different meshes (trainer and engines, for weight transfer) the way SGLang builds its own.

The rendezvous is keyed by a name for the group that every rank shares: ``init_torch_distributed_on``
draws a fresh one in the caller and hands it to every rank. Called in the actors directly, pass
``key=`` yourself, or leave it to a count of calls per process (every rank must then call it the
same number of times). An actor restarted by supervision cannot rejoin its old group (torch cannot
replace one member of a group): re-create the whole group, with ``init_torch_distributed_on`` or a
new ``key`` (a restarted process's count starts again at 0, the others' do not).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray

from meshrl.groups import free_port, free_ports, join_process_group  # noqa: F401 - re-exported
from meshrl.mesh.actor import current_rank, mesh_context
from meshrl.mesh.adverbs import Future

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_KV_NAMESPACE = "meshrl"
_POLL_S = 0.05
_generation = 0
_device_mesh: DeviceMesh | None = None


def host_ip() -> str:
    """This node's IP address as Ray knows it (what other nodes can reach)."""
    return ray.util.get_node_ip_address()


def _address() -> tuple[str, int]:
    return host_ip(), free_port()


def actor_address(mesh: Any) -> Future[tuple[str, int]]:
    """(IP, free port) on the host of the single actor of ``mesh``: a rank-0 address for a group."""
    return mesh._run_one(_address, what="actor_address")


def _local_device_index() -> int:
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        return int(ray.get_gpu_ids()[0])
    return 0


def _publish_or_fetch(key: str, rank: int, mesh: str, timeout: float) -> tuple[Any, str, int]:
    from torch.distributed import TCPStore

    from ray.experimental import internal_kv

    if rank == 0:
        ip = host_ip()
        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
        internal_kv._internal_kv_put(key, f"{ip}:{store.port}", overwrite=True, namespace=_KV_NAMESPACE)
        return store, ip, store.port
    deadline = time.monotonic() + timeout
    while (value := internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} of mesh {mesh!r} waited {timeout} s for rank 0 to publish its rendezvous "
                f"address: is every actor of the mesh calling init_torch_distributed()?"
            )
        time.sleep(_POLL_S)
    ip, port = value.decode().rsplit(":", 1)
    store = TCPStore(ip, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    return store, ip, int(port)


def init_torch_distributed(backend: str | None = None, timeout: float = 120.0, *, key: str | None = None) -> DeviceMesh:
    """Join this actor's mesh-wide process group; a ``DeviceMesh`` with the mesh's dims as axes.

    Call it in every actor of the mesh. ``backend``: ``"nccl"`` or ``"gloo"`` (default: NCCL if
    this actor has a GPU, else gloo). ``timeout`` bounds the rendezvous and every collective.
    ``key``: this group's name, the same on every rank (module docstring); None: this process's
    count of calls.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _generation, _device_mesh
    ctx = mesh_context()
    rank = current_rank().rank
    world = 1
    for size in ctx.sizes:
        world *= size
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialized in actor {ctx.mesh}/{rank}: "
            "call torch.distributed.destroy_process_group() first"
        )
    has_gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
    backend = backend or ("nccl" if has_gpu else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not has_gpu:
        raise ValueError(f"actor {ctx.mesh}/{rank} has no GPU for the nccl backend: spawn_procs(gpus_per_proc=1)")
    key = f"{ctx.uid}/dist/" + (f"key/{key}" if key is not None else str(_generation))
    _generation += 1
    store, ip, port = _publish_or_fetch(key, rank, ctx.mesh, timeout)
    device_type = "cuda" if backend == "nccl" else "cpu"
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": ip, "MASTER_PORT": str(port)}
    if device_type == "cuda":
        device = _local_device_index()
        env["LOCAL_RANK"] = str(device)
        # Set before any collective so NCCL binds this actor's GPU, not device 0 of a shared view.
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    os.environ.update(env)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        _device_mesh = init_device_mesh(device_type, ctx.sizes, mesh_dim_names=ctx.labels)
    except Exception as exc:
        exc.add_note(f"actor {ctx.mesh}/{rank} joining a {backend} group of {world} at {ip}:{port}")
        raise
    if rank == 0:  # every rank read the address to get here: the key would only pile up in Ray's KV
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=_KV_NAMESPACE)
    return _device_mesh


def current_device_mesh() -> DeviceMesh:
    """The ``DeviceMesh`` made by this actor's last ``init_torch_distributed``."""
    if _device_mesh is None:
        raise RuntimeError("init_torch_distributed() has not run in this actor")
    return _device_mesh


def _init_summary(backend: str | None, timeout: float, key: str | None = None) -> dict[str, Any]:
    import torch.distributed as dist

    init_torch_distributed(backend, timeout, key=key)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend()}


def init_torch_distributed_on(mesh: Any, backend: str | None = None, timeout: float = 120.0) -> Future[Any]:
    """Run ``init_torch_distributed`` in every actor of ``mesh`` (a whole spawned mesh).

    Resolves to a ``ValueMesh`` of ``{"rank", "world_size", "backend"}`` per actor; inside the
    actors, ``current_device_mesh()`` returns the ``DeviceMesh``.
    """
    if len(mesh) != mesh._world:
        raise ValueError(
            f"init_torch_distributed_on needs every actor of mesh {mesh.name!r} ({mesh._world}), "
            f"got a view of {len(mesh)}"
        )
    # one fresh key for this group on every rank: a rank restarted by supervision agrees with the rest
    return mesh._run_all(_init_summary, backend, timeout, uuid.uuid4().hex, what="init_torch_distributed")
