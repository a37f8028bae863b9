"""Monarch-shaped actor meshes on Ray, and the torch.distributed bootstrap inside them.

```python
procs = spawn_procs(per_host={"gpus": 2})              # ProcMesh: named dims, one placement group
trainers = procs.spawn("trainer", Trainer, cfg)        # ActorMesh: one Ray actor per process
losses = await trainers.step.call(batch)               # ValueMesh, one value per rank
one = await trainers.slice(gpus=0).version.call_one()  # exactly one actor
out = await rollouts.generate.choose(req)              # the least-loaded actor
async for r in rollouts.generate.stream(req): ...      # answers in arrival order
trainers.reload.broadcast(path)                        # fire and forget; failures still surface
procs.stop()
```

Modules: ``shape`` (dims, slicing, ValueMesh), ``actor`` (Actor, @endpoint, the threading rule),
``adverbs`` (endpoints, adverbs and futures), ``state`` (outstanding calls, broadcast failures),
``actor_mesh``, ``proc_mesh`` (placement), ``supervision`` (restarts), ``errors``, ``distributed``
(process groups).
"""

from meshrl.mesh.actor import Actor, Rank, current_rank, current_size, endpoint
from meshrl.mesh.actor_mesh import ActorMesh
from meshrl.mesh.distributed import (
    actor_address,
    current_device_mesh,
    free_port,
    free_ports,
    host_ip,
    init_torch_distributed,
    init_torch_distributed_on,
    join_process_group,
)
from meshrl.mesh.adverbs import Endpoint, Future, Stream, bounded
from meshrl.mesh.errors import ActorFailure
from meshrl.mesh.proc_mesh import ProcMesh, spawn_procs
from meshrl.mesh.shape import ValueMesh
from meshrl.mesh.supervision import RestartEvent

__all__ = [
    "Actor",
    "ActorFailure",
    "ActorMesh",
    "Endpoint",
    "Future",
    "ProcMesh",
    "Rank",
    "RestartEvent",
    "Stream",
    "ValueMesh",
    "actor_address",
    "bounded",
    "current_device_mesh",
    "current_rank",
    "current_size",
    "endpoint",
    "free_port",
    "free_ports",
    "host_ip",
    "init_torch_distributed",
    "init_torch_distributed_on",
    "join_process_group",
    "spawn_procs",
]
