"""Rollout workers restarted in place (issue 28): which ones serve, and what a restarted one waits for.

```text
a rollout worker dies        (its generate fails, a push to it fails, or supervision reports its restart)
  Revivals.died(rank)        it takes no request and no evaluation from now on
  Ray re-creates it          the same actor, __init__ again: the checkpoint's weights, version 0
  the trainer's chunk ends   at its next step that pushed (sampler.hold_batches; or at the push that
                             failed with it); between chunks the trainer and every engine join a new
                             transfer group, the version is pushed to all (meshrl.pipeline.training)
  Revivals.back(ranks, v)    it serves v: its rollout loops re-issue the requests it had in flight
                             (same reservation, prompts, group ids and so seeds)
```

Only where it can work: ``run.max_worker_restarts > 0``, TorchEngine, ``rollout.tp_size=1`` (a
tensor-parallel group does not take a new member), separate engines (``placement=colocated``: the
process is also a trainer rank), and several workers (one worker holds the run's sampler, which dies
with it). Elsewhere a rollout worker's death resumes the run from its newest checkpoint
(``run.auto_resume``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from meshrl.mesh import ActorFailure
from meshrl.mesh.errors import find_cause
from meshrl.pipeline.config import PipelineConfig
from meshrl.queues.parcels import SamplesLost

__all__ = ["Revivals", "death", "restarts_rollout_in_place"]


def restarts_rollout_in_place(cfg: PipelineConfig) -> bool:
    """A rollout worker's death is answered by its restart in place, not a resume (module docstring)."""
    return (cfg.run.max_worker_restarts > 0 and cfg.rollout.engine.backend == "torch" and not cfg.sampler_in_rollout
            and cfg.rollout.tp_size == 1
            and cfg.placement != "colocated")


def death(exc: BaseException) -> BaseException | None:
    """The role's death behind ``exc`` (an ``ActorFailure``, or ``SamplesLost``), through causes,
    contexts and exception groups; None when it is not one (a bug stops the run)."""
    return find_cause(exc, (ActorFailure, SamplesLost))


class Revivals:
    """Which rollout workers serve the current weights, and the ones on their way back."""

    def __init__(self, cfg: PipelineConfig, workers: int, *, record: Callable[..., Any] = lambda *a, **k: None) -> None:
        self.enabled = restarts_rollout_in_place(cfg)
        self.timeout_s = cfg.run.step_timeout_s
        self._serving = [asyncio.Event() for _ in range(workers)]
        for e in self._serving:
            e.set()
        self.down: dict[int, float] = {}
        """rank -> when it was seen dead (time.time())."""
        self.wake = asyncio.Event()
        """Set by ``died``: the train loop's reviver has work."""
        self.revived = 0
        self._loads = [0] * workers
        """Per rank: restarted incarnations loaded so far (``back``)."""
        self.reissued_requests = 0
        """Requests sent again because the rollout worker generating them died."""
        self._record = record

    def restartable(self, exc: BaseException) -> int | None:
        """The rank of the rollout worker whose death (restarting) is behind ``exc``; else None."""
        dead = death(exc)
        if self.enabled and isinstance(dead, ActorFailure) and dead.mesh == "rollout" and dead.restarting:
            return dead.rank
        return None

    def loads(self) -> list[int]:
        """Per rank, how many restarted incarnations were loaded: taken before a call, it tells a
        failure of the incarnation called from one of an earlier one (``died(before=)``)."""
        return list(self._loads)

    def died(self, rank: int, *, before: int | None = None) -> None:
        """``rank`` died; ``before``: its ``loads()`` when the failed call was made (a later load
        means the failure was of an incarnation already replaced and loaded: nothing to do)."""
        if before is not None and self._loads[rank] > before:
            return
        if rank not in self.down:
            self.down[rank] = time.time()
            self._serving[rank].clear()
        self.wake.set()

    def restarted(self, rank: int, restarts: int) -> None:
        """Supervision: Ray re-created ``rank`` for the ``restarts``-th time (an event that may come
        after the train loop found the death itself and loaded the new process)."""
        if self._loads[rank] < restarts:
            self.died(rank)

    def back(self, ranks: list[int], version: int, step: int) -> None:
        """``ranks`` serve ``version`` again: recorded (seconds since the death) and said."""
        for rank in ranks:
            self._loads[rank] += 1
            since = self.down.pop(rank, None)
            self._serving[rank].set()
            if since is not None:
                self.revived += 1
                seconds = round(time.time() - since, 3)
                self._record(rank=rank, version=version, step=step, recovery_s=seconds)

    def serving(self) -> list[int]:
        return [i for i, e in enumerate(self._serving) if e.is_set()]

    async def until_serving(self, rank: int, what: str) -> None:
        """Until ``rank`` serves the current weights (at once, normally)."""
        if self._serving[rank].is_set():
            return
        try:
            # waits for: the worker's restart and its load at a push; unblocked by: TrainLoop.revive
            await asyncio.wait_for(self._serving[rank].wait(), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"gave up after {self.timeout_s:.0f}s waiting for rollout/{rank} to be restarted and "
                               f"loaded with the current weights ({what})") from None

    async def any_serving(self, what: str, *, every: bool = False) -> list[int]:
        """The serving ranks, once there is one (``every``: once all serve)."""
        deadline = time.monotonic() + self.timeout_s
        while not (ranks := self.serving()) or (every and self.down):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up after {self.timeout_s:.0f}s waiting for a rollout worker to be restarted "
                                   f"and loaded with the current weights ({what})")
            await asyncio.sleep(0.05)
        return ranks

    async def back_up(self, engines: Any, ranks: list[int]) -> None:
        """Until Ray has re-created each of ``ranks`` (its ``__init__`` done); a worker past its
        restarts raises its failure."""
        deadline = time.monotonic() + self.timeout_s
        for rank in ranks:
            while True:
                try:
                    await engines.slice(procs=rank).ready().within(max(1.0, deadline - time.monotonic()))
                    break
                except ActorFailure as exc:
                    if not exc.restarting or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
                except TimeoutError:
                    raise TimeoutError(f"gave up after {self.timeout_s:.0f}s waiting for rollout/{rank} to be "
                                       "restarted by Ray") from None
