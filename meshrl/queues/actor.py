"""``SampleQueue`` as a mesh actor: the same class, with its public coroutines as endpoints.

The queue itself stays Ray-free (unit tests drive it in-process); this module only exposes it
through ``meshrl.mesh`` so the pipeline can spawn it like every other role.
"""

from __future__ import annotations

import functools

from meshrl.mesh import Actor, endpoint
from meshrl.queues.sample_queue import SampleQueue

__all__ = ["QueueActor"]

_ENDPOINTS = (
    "reserve", "put", "put_encoded", "put_ref", "cancel", "get_batch", "get_batch_encoded", "get_batch_refs", "set_version",
    "close", "metrics", "held_groups", "ledger", "snapshot", "restore",
)


def _expose(fn):
    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        return await fn(self, *args, **kwargs)

    return endpoint(wrapper)


class QueueActor(SampleQueue, Actor):
    """A ``SampleQueue`` spawned on a mesh; calls share the actor's one event loop."""


for _name in _ENDPOINTS:
    setattr(QueueActor, _name, _expose(getattr(SampleQueue, _name)))
