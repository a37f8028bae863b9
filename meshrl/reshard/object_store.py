"""Push a policy version from a trainer mesh to engine meshes through Ray's object store.

Protocol (endpoint names, so this module need not import the roles): the trainer mesh has
``export_weights() -> dict[name, Tensor]`` and each engine mesh ``update_weights(named, version)``
that applies the version atomically and returns the version it now serves.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from meshrl.mesh import ActorMesh
from meshrl.reshard.push import PushStats

__all__ = ["PushStats", "apply_weights", "push_weights"]


async def push_weights(trainer: ActorMesh, engines: ActorMesh, version: int, *, timeout_s: float = 300.0) -> PushStats:
    """Export the trainer's weights and apply them on every engine as ``version``."""
    start = time.perf_counter()
    try:
        named = await trainer.slice(**{d: 0 for d in trainer.sizes}).export_weights.call_one().within(timeout_s)
    except TimeoutError:
        raise TimeoutError(f"weight push v{version}: the trainer did not export its weights within {timeout_s}s") from None
    return await apply_weights(named, engines, version, timeout_s=timeout_s, start=start)


async def apply_weights(named: dict[str, Any], engines: ActorMesh, version: int, *, timeout_s: float = 300.0,
                        start: float | None = None) -> PushStats:
    """``named`` (full tensors) into every engine as ``version``: one ``ray.put``, then every engine
    fetches the same object and applies it atomically."""
    start = time.perf_counter() if start is None else start
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    ref = ray.put(named)  # once, then every engine fetches the same object
    try:
        applied = await engines.update_weights.call(ref, version).within(timeout_s)
    except TimeoutError:
        raise TimeoutError(f"weight push v{version}: engines did not apply it within {timeout_s}s") from None
    stale = [v for v in applied.values() if v != version]
    if stale:
        raise RuntimeError(f"weight push v{version}: engines report versions {stale} after the update")
    return PushStats(version=version, seconds=time.perf_counter() - start, bytes=nbytes)
