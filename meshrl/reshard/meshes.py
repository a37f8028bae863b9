"""Reshard between actor meshes: what the trainer and rollout actors hold, and what the controller calls.

Roles keep one helper each and expose it through a few endpoints (names are the protocol, so
this module never imports ``meshrl.actors``):

```text
trainer actor (SourceSide)                    rollout actor (DestSide)
  reshard_layout() -> SourceLayout              reshard_dest_layout(num_ranks) -> DestLayout
  reshard_join(dest, ranks, addr, port, cfg)    reshard_join(source, dest, ranks, addr, port, cfg)
  reshard_send(version) -> PushStats            reshard_receive(version) -> PushStats
                                                reshard_arm(version, timeout_s), reshard_disarm()
```

The controller, once: ``ranks = await connect(trainer, rollouts, cfg)`` (layouts from rank 0 of
each mesh, group rank 0 = trainer rank 0, which hosts the group's store; every actor joins at
once); then per version: ``stats = await push(trainer, rollouts, version)`` — every trainer rank
sends its own shards while every engine receives and flips (``Resharder``), all bounded by
``timeout_s``. The pipeline splits that in three: ``arm`` while the trainer computes the version
(the engines' receives are posted early), ``Push(...)`` after the step, whose ``sent()`` frees
the trainer, and ``finish()`` once the engines have flipped. Trainer rank r is source rank r; engine actor r (flat rank in its mesh, tp-major
within a replica) is destination rank r.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable

import torch

from meshrl.mesh.errors import ActorFailure
from meshrl.reshard.layout import DestLayout, SourceLayout, dest_layout, local_tensors, source_layout
from meshrl.reshard.push import PushStats, ReshardConfig, ReshardError, Resharder
from meshrl.reshard.transport import GroupRanks


class SourceSide:
    """A trainer rank's part: layout from its (FSDP2) parameters, group membership, send.

    ``named_parameters()`` gives what is sent; ``layout_parameters()``, when the two differ in cost
    (LoRA merges on export, a collective under FSDP2), tensors of the same shapes and shards that
    are cheap to list and need no other rank: ``layout`` runs on rank 0 alone.
    """

    def __init__(self, named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 device: torch.device | str = "cpu", *,
                 layout_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None):
        self.named_parameters, self.device = named_parameters, torch.device(device)
        self.layout_parameters = layout_parameters or named_parameters
        self.resharder: Resharder | None = None

    def layout(self) -> SourceLayout:
        return source_layout(self.layout_parameters())

    def join(self, dest: DestLayout, ranks: GroupRanks, src_rank: int, addr: str, port: int,
             config: ReshardConfig) -> None:
        """Blocks until every member has joined (or ``config.timeout_s``)."""
        self.close()
        self.resharder = Resharder.join(self.layout(), dest, ranks, ranks.src[src_rank], addr, port, config, self.device)

    def send(self, version: int) -> PushStats:
        if self.resharder is None:
            raise ReshardError("reshard_send before reshard_join: call meshrl.reshard.meshes.connect first")
        return self.resharder.send(local_tensors(self.named_parameters()), version)

    def close(self) -> None:
        if self.resharder is not None:
            self.resharder.close()
            self.resharder = None


class DestSide:
    """An engine rank's part: its declared layout, group membership, versioned receive."""

    def __init__(self, engine: Any):
        self.engine = engine  # a ReshardTarget with .model.layout/.tp_size (TorchEngine)
        self.resharder: Resharder | None = None

    def layout(self, num_ranks: int) -> DestLayout:
        """All ``num_ranks`` engine ranks (replicas x this engine's tp size), from this engine's TP plan."""
        m = self.engine.model
        if num_ranks % m.tp_size:
            raise ValueError(f"{num_ranks} engine ranks are not whole replicas of tp_size={m.tp_size}")
        return dest_layout(m.layout, m.tp_size, num_ranks // m.tp_size, self.engine.dtype)

    async def join(self, source: SourceLayout, dest: DestLayout, ranks: GroupRanks, dst_rank: int, addr: str,
                   port: int, config: ReshardConfig) -> None:
        if self.resharder is not None:  # an armed receive would leave the engine's update open: no later one begins
            await self.resharder.disarm(self.engine)
        self.close()
        device = self.engine.device
        # The rendezvous blocks: keep the actor's event loop (and generation) running meanwhile.
        self.resharder = await asyncio.to_thread(Resharder.join, source, dest, ranks, ranks.dst[dst_rank], addr, port,
                                                 config, device)

    async def receive(self, version: int) -> PushStats:
        return await self._joined("reshard_receive").receive(self.engine, version)

    async def arm(self, version: int, timeout_s: float) -> None:
        """Post the receive of ``version`` before the trainer sends it (``Resharder.arm``)."""
        await self._joined("reshard_arm").arm(self.engine, version, timeout_s=timeout_s)

    async def disarm(self) -> None:
        await self._joined("reshard_disarm").disarm(self.engine)

    def _joined(self, what: str) -> Resharder:
        if self.resharder is None:
            raise ReshardError(f"{what} before reshard_join: call meshrl.reshard.meshes.connect first")
        return self.resharder

    def close(self) -> None:
        if self.resharder is not None:
            self.resharder.close()
            self.resharder = None


def _first(mesh: Any) -> Any:
    return mesh.slice(**{d: 0 for d in mesh.sizes})


async def connect(trainer: Any, engines: Any, config: ReshardConfig = ReshardConfig()) -> GroupRanks:
    """Build the transfer group over every trainer and engine actor; returns its rank map."""
    from meshrl.mesh import actor_address

    t = config.timeout_s
    source = await _first(trainer).reshard_layout.call_one().within(t)
    dest = await _first(engines).reshard_dest_layout.call_one(len(engines)).within(t)
    ranks = GroupRanks.disjoint(source.num_ranks, dest.num_ranks)
    if source.num_ranks != len(trainer):
        raise ReshardError(f"the trainer's DTensors live on {source.num_ranks} ranks, its mesh has {len(trainer)}")
    addr, port = await actor_address(_first(trainer)).within(t)
    await asyncio.gather(trainer.reshard_join.call(dest, ranks, addr, port, config).within(t + 10),
                         engines.reshard_join.call(source, dest, ranks, addr, port, config).within(t + 10))
    return ranks


async def arm(engines: Any, version: int, *, timeout_s: float) -> None:
    """Every engine posts its receive of ``version`` now; a later ``push`` of it completes at once."""
    await engines.reshard_arm.call(version, timeout_s).within(timeout_s)


class Push:
    """One version on its way: the trainer's send and the engines' receive, started together."""

    def __init__(self, trainer: Any, engines: Any, version: int, *, timeout_s: float = 300.0):
        self.version, self.start = version, time.perf_counter()
        self.sending = asyncio.ensure_future(trainer.reshard_send.call(version).within(timeout_s))
        self.receiving = asyncio.ensure_future(engines.reshard_receive.call(version).within(timeout_s))

    async def sent(self) -> None:
        """Until every trainer rank has sent: its weights may change again from here on. A failed
        send raises (with the receive's error, if any) as ``finish`` does, and so does a process
        of either side that died (the other side would only wait for its timeout)."""
        await asyncio.wait([self.sending, self.receiving], return_when=asyncio.FIRST_EXCEPTION)
        self._raise_death()
        await asyncio.wait([self.sending])
        if self.sending.exception() is not None:
            await self.finish()

    def _raise_death(self) -> None:
        """A side that failed because one of its processes died: the push fails now, naming it."""
        for side in (self.sending, self.receiving):
            exc = side.exception() if side.done() and not side.cancelled() else None
            if isinstance(exc, ActorFailure):
                raise ReshardError(f"push of v{self.version} failed: {exc}") from exc

    async def finish(self) -> PushStats:
        """Until every engine serves ``version``; the push's parts, the slowest process's of each."""
        await asyncio.wait([self.sending, self.receiving], return_when=asyncio.FIRST_EXCEPTION)
        self._raise_death()
        sent, got = await asyncio.gather(self.sending, self.receiving, return_exceptions=True)
        errors = [e for e in (sent, got) if isinstance(e, BaseException)]
        if errors:
            death = next((e for e in errors if isinstance(e, ActorFailure)), errors[0])
            raise ReshardError(f"push of v{self.version} failed: " + "; ".join(f"{type(e).__name__}: {e}"
                                                                             for e in errors)) from death
        return pushed(self.version, list(sent.values()), list(got.values()), self.start)


def pushed(version: int, sent: list[PushStats], got: list[PushStats], start: float) -> PushStats:
    """A finished push of ``version``: every engine must report it; its parts, the slowest process's
    of each (``sent``: the trainer ranks' stats, ``got``: the engines'; ``start``: perf_counter)."""
    stale = [s.version for s in got if s.version != version]
    if stale:
        raise ReshardError(f"push of v{version}: engines report versions {stale}")
    phases = {"send_s": max((s.seconds for s in sent), default=0.0), "receive_s": max(s.seconds for s in got)}
    for s in (*sent, *got):
        for k, v in s.phases.items():
            phases[k] = max(phases.get(k, 0.0), v)
    return PushStats(version=version, seconds=time.perf_counter() - start, bytes=sum(s.bytes for s in got), phases=phases)


async def push(trainer: Any, engines: Any, version: int, *, timeout_s: float = 300.0) -> PushStats:
    """Move ``version`` from every trainer rank into every engine; each engine flips atomically."""
    return await Push(trainer, engines, version, timeout_s=timeout_s).finish()
