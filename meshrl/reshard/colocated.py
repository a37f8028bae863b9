"""The colocated hand-over: a trainer rank's parameters copied into the engine of the same process.

When a trainer rank and an engine replica share a process (``meshrl.actors.hybrid``), a new
version needs no transport at all: the transfer plan from the trainer's layout to the engine's
(fused q/k/v and gate/up, the one HF <-> engine name mapping of ``layout``) is computed once, and
each push is ``torch._foreach_copy_`` from the trainer's parameters (cast to the engine's dtype
in the same kernel) into the engine's live parameters, run by ``engine.write_params`` between two
decode steps so no step mixes versions.

* dp = 1: the trainer's local tensors are whole; the copy lists (views of both sides) are built
  once, so a push is one ``_foreach_copy_`` call (what ``Resharder.write_in_place`` does, minus
  slicing ~12 views per layer every time).
* dp > 1 (FSDP2 shards, one full engine replica per rank): each bucket of the plan gathers the full
  tensors it needs (``DTensor.full_tensor``, a collective every rank runs in plan order) and copies
  them; at most one bucket of gathered tensors is alive.

* With ``layout_parameters`` (LoRA: the exported weights are merged afresh on each push, so there
  are no stable tensors to take views of), the plan is read from those, and each push copies what
  ``named_parameters()`` yields one tensor at a time (dp = 1: one merged weight alive at a time).

Simplifications, on purpose: one engine replica per process and no engine tensor parallelism.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from meshrl.reshard.layout import SourceLayout, dest_layout, local_tensors, source_layout, source_tensor, to_slices
from meshrl.reshard.plan import plan_transfers
from meshrl.reshard.push import PushStats, ReshardConfig, ReshardTarget
from meshrl.reshard.transport import GroupRanks

__all__ = ["LocalHandover"]


class LocalHandover:
    """Copies a trainer rank's parameters into an engine in the same process (module docstring)."""

    def __init__(self, named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: Any,
                 config: ReshardConfig = ReshardConfig(), *,
                 layout_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None):
        self.named_parameters, self.engine = named_parameters, engine
        self.fresh_sources = layout_parameters is not None
        """The exported tensors are new on every push (merged LoRA): no copy lists of stable views."""
        m = engine.model
        if m.tp_size != 1:
            raise ValueError(f"the colocated hand-over needs a whole engine replica per process, got tp_size={m.tp_size}")
        source = source_layout((layout_parameters or named_parameters)())
        self.sharded = source.num_ranks > 1
        if self.sharded:  # as if the full tensors sat on one source rank in this process
            source = SourceLayout(num_ranks=1, tensors=tuple(
                source_tensor(t.name, t.shape, t.dtype, (1,), (None,)) for t in source.tensors))
        dest = dest_layout(m.layout, 1, 1, engine.dtype)
        self.plan = plan_transfers(source, dest, config.bucket_bytes, GroupRanks.colocated(1).same_process())
        self.nbytes = self.plan.nbytes
        """Bytes written into the engine per hand-over."""
        self._dst: list[torch.Tensor] = []
        self._src: list[torch.Tensor] = []
        self.refresh()

    def refresh(self) -> None:
        """Build the copy lists (views of both sides) once: slicing ~12 views per layer on every push
        would cost milliseconds of host time. Call it again if the trainer's parameter tensors were
        replaced rather than written in place."""
        live = self.engine.model.params
        transfers = [t for b in self.plan.buckets for t in b.transfers]
        self._dst = [live[t.param][to_slices(t.dst_box)] for t in transfers]
        if self.fresh_sources:  # per name: a merged tensor is copied, then dropped, before the next is made
            self._by_name: dict[str, list[tuple[torch.Tensor, tuple[slice, ...]]]] = {}
            for t, dst in zip(transfers, self._dst):
                self._by_name.setdefault(t.hf_name, []).append((dst, to_slices(t.src_box)))
        elif not self.sharded:
            sources = local_tensors(self.named_parameters())
            missing = sorted({t.hf_name for t in transfers} - set(sources))
            if missing:
                raise KeyError(f"the trainer has no parameters {missing[:3]} that the engine needs")
            self._src = [sources[t.hf_name][to_slices(t.src_box)] for t in transfers]

    def _write_fresh(self, _live: dict[str, torch.Tensor]) -> None:
        done = set()
        for name, tensor in self.named_parameters():
            jobs = self._by_name.get(name)
            if jobs:
                local = local_tensors([(name, tensor)])[name]
                torch._foreach_copy_([dst for dst, _ in jobs], [local[src] for _, src in jobs])
                done.add(name)
        missing = sorted(self._by_name.keys() - done)
        if missing:
            raise KeyError(f"the trainer exported no parameters {missing[:3]} that the engine needs")

    def write(self, engine: ReshardTarget, version: int) -> PushStats:
        """Copy the current parameters into ``engine``'s live ones and serve them as ``version``.

        Synchronous; with dp > 1 a collective (every rank calls it for the same version).
        """
        if engine is not self.engine:
            raise ValueError("LocalHandover.write: a different engine than the one it was built for")
        start = time.perf_counter()
        if not self.sharded:
            if self.fresh_sources:
                engine.write_params(self._write_fresh, version)
            else:
                engine.write_params(lambda _live: torch._foreach_copy_(self._dst, self._src), version)
            return PushStats(version=version, seconds=time.perf_counter() - start, bytes=self.nbytes)
        params = dict(self.named_parameters())

        def write(_live: dict[str, torch.Tensor]) -> None:
            at = 0
            for bucket in self.plan.buckets:
                ts = bucket.transfers
                names = list(dict.fromkeys(t.hf_name for t in ts))  # plan order: the same on every rank
                full = {n: params[n].detach().full_tensor() if hasattr(params[n], "full_tensor") else params[n].detach()
                        for n in names}
                torch._foreach_copy_(self._dst[at: at + len(ts)], [full[t.hf_name][to_slices(t.src_box)] for t in ts])
                at += len(ts)
                del full

        engine.write_params(write, version)
        return PushStats(version=version, seconds=time.perf_counter() - start, bytes=self.nbytes)
