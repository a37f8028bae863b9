"""The colocated hand-over: a trainer rank's parameters copied into the engine of the same process.

When a trainer rank and an engine replica share a process (``meshrl.actors.hybrid``), a new
version needs no transport at all: the transfer plan from the trainer's layout to the engine's
(fused q/k/v and gate/up, the one HF <-> engine name mapping of ``layout``) is computed once, and
each push is ``torch._foreach_copy_`` from the trainer's parameters (cast to the engine's dtype
in the same kernel) into the engine's live parameters, run by ``engine.write_params`` between two
decode steps so no step mixes versions.

* dp = 1: the trainer's local tensors are whole; ``Resharder.write_in_place`` does the copy.
* dp > 1 (FSDP2 shards, one full engine replica per rank): each bucket of the plan gathers the full
  tensors it needs (``DTensor.full_tensor``, a collective every rank runs in plan order) and copies
  them; at most one bucket of gathered tensors is alive.

Simplifications, on purpose: one engine replica per process and no engine tensor parallelism.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from meshrl.reshard.layout import SourceLayout, dest_layout, local_tensors, source_layout, source_tensor, to_slices
from meshrl.reshard.plan import plan_transfers
from meshrl.reshard.push import PushStats, ReshardConfig, Resharder, ReshardTarget
from meshrl.reshard.transport import GroupRanks

__all__ = ["LocalHandover"]


class LocalHandover:
    """Copies a trainer rank's parameters into an engine in the same process (module docstring)."""

    def __init__(self, named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: Any,
                 config: ReshardConfig = ReshardConfig()):
        self.named_parameters = named_parameters
        m = engine.model
        if m.tp_size != 1:
            raise ValueError(f"the colocated hand-over needs a whole engine replica per process, got tp_size={m.tp_size}")
        source = source_layout(named_parameters())
        dest = dest_layout(m.layout, 1, 1, engine.dtype)
        self.sharded = source.num_ranks > 1
        if not self.sharded:
            self._resharder = Resharder(source, dest, GroupRanks.colocated(1), 0, None, config, engine.device)
            self.plan = self._resharder.plan
        else:
            # as if the full tensors sat on one source rank in this process: plan the copies once
            whole = SourceLayout(num_ranks=1, tensors=tuple(
                source_tensor(t.name, t.shape, t.dtype, (1,), (None,)) for t in source.tensors))
            self.plan = plan_transfers(whole, dest, config.bucket_bytes, GroupRanks.colocated(1).same_process())
        self.nbytes = self.plan.nbytes
        """Bytes written into the engine per hand-over."""

    def write(self, engine: ReshardTarget, version: int) -> PushStats:
        """Copy the current parameters into ``engine``'s live ones and serve them as ``version``.

        Synchronous; with dp > 1 a collective (every rank calls it for the same version).
        """
        if not self.sharded:
            return self._resharder.write_in_place(engine, local_tensors(self.named_parameters()), version)
        start = time.perf_counter()
        params = dict(self.named_parameters())

        def write(live: dict[str, torch.Tensor]) -> None:
            for bucket in self.plan.buckets:
                names = list(dict.fromkeys(t.hf_name for t in bucket.transfers))  # plan order: same on every rank
                full = {n: params[n].detach().full_tensor() if hasattr(params[n], "full_tensor") else params[n].detach()
                        for n in names}  # fmt: skip
                torch._foreach_copy_([live[t.param][to_slices(t.dst_box)] for t in bucket.transfers],
                                     [full[t.hf_name][to_slices(t.src_box)] for t in bucket.transfers])
                del full

        engine.write_params(write, version)
        return PushStats(version=version, seconds=time.perf_counter() - start, bytes=self.nbytes)
