"""``SampleQueue`` and ``Sampler`` as mesh actors: the same classes, with their public coroutines as
endpoints.

Both stay Ray-free (unit tests drive them in-process); this module only exposes them through
``meshrl.mesh`` so the pipeline can spawn them like every other role.
"""

from __future__ import annotations

import functools

from meshrl.mesh import Actor, endpoint
from meshrl.queues.sample_queue import SampleQueue
from meshrl.queues.sampler import Sampler

__all__ = ["QueueActor", "SAMPLER_ENDPOINTS", "SamplerActor"]

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


SAMPLER_ENDPOINTS = (
    "take", "put_encoded", "put_ref", "cancel", "release", "report", "state", "restore", "get_batch", "get_batch_encoded",
    "get_batch_refs", "set_version", "close", "metrics", "held_groups", "ledger", "step_batch", "hold_batches",
    "resume_batches",
)


class SamplerActor(Sampler, Actor):
    """A ``Sampler`` spawned on a mesh (the pipeline's ``queue`` role); calls share one event loop."""


for _name in SAMPLER_ENDPOINTS:
    setattr(SamplerActor, _name, _expose(getattr(Sampler, _name)))
