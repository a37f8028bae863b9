"""How the trainer's weights reach the engines: one object per run, chosen once by transport and
placement, with three verbs the train loop calls.

```text
arm(version)    while the step that makes ``version`` computes: the engines post their receives
                (distributed, staged apply, separate engines); a no-op for the others
push(version)   the trainer sends ``version`` to every engine; with ``publish``, the queue learns it
                once every engine serves it (admission assumes new reservations generate on it)
settle()        until every engine serves the newest pushed version (a detached push's second
                half); a failed push raises here, for every caller
rejoin()        after a rollout worker was restarted in place (meshrl.pipeline.revival): forget
                the failed push, and (distributed) every trainer and engine rank joins a new group
```

- ``DistributedSync`` (``reshard.transport=distributed``): every trainer rank sends its own
  shards over the process group joined at start, every engine receives and flips atomically. At
  ``max_staleness >= 1`` (staged apply, separate engines) the push is *detached*: ``push`` returns
  once the trainer has sent, the engines flip on their own time, and ``settle`` waits for them.
  Colocated engines take their weights in place (no arming).
- ``ObjectStoreSync``: ``trainer.gather_weights`` (dp > 1 or CUDA: full tensors onto rank 0),
  then ``reshard.push_weights`` through Ray's object store.
- ``SGLangSync``: every trainer rank gathers, rank 0 sends into every server (pause, buckets,
  flush, continue); a failure names the log of a server that died, if one did.

``phases()`` gives the last finished push's parts (``sync/send_s``, ...) once, for the step record
that finished it (a detached push finishes during a later step, which need not push itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable

from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.rollout_loop import Roles
from meshrl.reshard import PushStats, push_weights
from meshrl.reshard import meshes as reshard_meshes

__all__ = ["DistributedSync", "ObjectStoreSync", "SGLangSync", "WeightSync", "weight_sync"]


class WeightSync:
    """The verbs every transport has (module docstring); the base pushes nothing."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, publish: Callable[[int], Awaitable[None]]) -> None:
        self.cfg, self.roles, self._publish = cfg, roles, publish
        self.timeout_s = cfg.run.step_timeout_s
        self._phases: dict[str, float] = {}
        self._phases_logged = True

    def arm(self, version: int) -> None:
        """Post the engines' receives for ``version`` while the step computes it (a no-op here)."""

    async def push(self, version: int, *, publish: bool = False) -> int:
        raise NotImplementedError

    async def settle(self) -> None:
        """Until every engine serves the newest pushed version (pushes that finish in ``push``: at once)."""

    async def close(self) -> None:
        """Undo an ``arm`` whose push never came (the step failed)."""

    async def rejoin(self) -> None:
        """A rollout worker was re-created: forget a push that failed with it, and reach the new
        process from the next push on (the object store reaches it as it is)."""

    def phases(self) -> dict[str, float]:
        """The last finished push's parts, once."""
        if self._phases_logged:
            return {}
        self._phases_logged = True
        return self._phases

    def _record(self, phases: dict[str, float]) -> None:
        self._phases, self._phases_logged = phases, False


class DistributedSync(WeightSync):
    """Pushes over the process group of every trainer and engine rank (module docstring)."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, publish: Callable[[int], Awaitable[None]]) -> None:
        super().__init__(cfg, roles, publish)
        self.arms = cfg.reshard.apply == "staged" and cfg.placement != "colocated"
        """The engines' receives are posted during the step (reshard.meshes.arm)."""
        self.detached = self.arms and cfg.queue.max_staleness >= 1
        """``push`` returns once the trainer has sent; the engines flip within the staleness bound."""
        self._armed: asyncio.Task | None = None
        self._flipping: asyncio.Task | None = None
        """A detached push whose engines may not all serve its version yet."""
        self._flip_error: BaseException | None = None
        """A detached push's failure, raised by every later ``settle``."""

    def arm(self, version: int) -> None:
        if self.arms:
            self._armed = asyncio.create_task(self._arm(version))

    async def _arm(self, version: int) -> None:
        await self.settle()  # the engines take one version at a time
        await reshard_meshes.arm(self.roles.engines, version, timeout_s=self.timeout_s + self.cfg.reshard.timeout_s)

    async def push(self, version: int, *, publish: bool = False) -> int:
        if self._armed is not None:
            armed, self._armed = self._armed, None
            await armed  # long done: it ran during the train step
        push = reshard_meshes.Push(self.roles.trainer, self.roles.engines, version, timeout_s=self.timeout_s)
        if self.detached:
            await push.sent()
            self._flipping = asyncio.ensure_future(self._flip(push, publish))
            return version
        stats = await self._flip(push, publish)
        self._record({f"sync/{k}": v for k, v in stats.phases.items()})
        return stats.version

    async def _flip(self, push: reshard_meshes.Push, publish: bool) -> PushStats:
        stats = await push.finish()
        if publish:
            await self._publish(stats.version)
        return stats

    async def settle(self) -> None:
        if self._flip_error is not None:  # every caller hears of a failed flip, not only the first
            raise self._flip_error
        if self._flipping is None:
            return
        flipping = self._flipping
        try:
            # shielded: a caller that gives up (a user's evaluate() under wait_for) must not cancel
            # the push itself, whose CancelledError the train loop would then take for the run's end
            stats = await asyncio.shield(flipping)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError) or flipping.cancelled():
                self._flip_error = exc
            raise
        finally:
            if self._flipping is flipping and flipping.done():  # (a cancelled caller leaves it to the next)
                self._flipping = None
        self._record({f"sync/{k}": v for k, v in stats.phases.items()})

    async def close(self) -> None:
        if self._armed is not None:  # a step failed between arming and its push
            self._armed.cancel()
            self._armed = None
            with contextlib.suppress(Exception):
                await self.roles.engines.reshard_disarm.call().within(10)


    async def rejoin(self) -> None:
        self._flipping, self._flip_error = None, None  # the failed push: pushed again by the caller
        await self.close()
        # the old group lost a member: every rank leaves it (an armed receive is withdrawn) and joins anew
        await reshard_meshes.connect(self.roles.trainer, self.roles.engines, self.cfg.reshard)


class ObjectStoreSync(WeightSync):
    """Full tensors from trainer rank 0 through Ray's object store (module docstring)."""

    async def push(self, version: int, *, publish: bool = False) -> int:
        trainer = self.roles.trainer
        if self.cfg.trainer.dp > 1 or self.cfg.trainer.device == "cuda":
            # a collective over the dp ranks: rank 0 then holds the full tensors push_weights exports
            await trainer.gather_weights.call().within(self.timeout_s)
        pushed = await push_weights(trainer, self.roles.engines, version, timeout_s=self.timeout_s)
        if publish:
            await self._publish(pushed.version)
        return pushed.version


class SGLangSync(WeightSync):
    """From the trainer into the SGLang servers (module docstring)."""

    async def push(self, version: int, *, publish: bool = False) -> int:
        start = time.perf_counter()
        try:
            stats = (await self.roles.trainer.sglang_push.call(version).within(self.timeout_s)).values()[0]
        except Exception:
            await self.roles.engines.check_engine.call().within(60)
            raise
        reissued = sum((await self.roles.rollouts.reissued.call().within(60)).values())
        self._record({"sync/push_s": time.perf_counter() - start, "sync/bytes": float(stats.bytes),
                      "sync/reissued_samples": float(reissued), **{f"sync/{k}": v for k, v in stats.phases.items()}})
        if publish:
            await self._publish(version)
        return version


def weight_sync(cfg: PipelineConfig, roles: Roles, publish: Callable[[int], Awaitable[None]]) -> WeightSync:
    """The run's weight sync: SGLang's when the engines are SGLang servers, else the transport's."""
    if cfg.rollout.engine.backend == "sglang":
        return SGLangSync(cfg, roles, publish)
    if cfg.reshard.transport == "distributed":
        return DistributedSync(cfg, roles, publish)
    return ObjectStoreSync(cfg, roles, publish)
