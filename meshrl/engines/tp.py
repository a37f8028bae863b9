"""Tensor parallelism for TorchEngine: which rank of which group, and the all-reduce the model calls.

The sharding itself is declared in ``layout.py`` (``ParamLayout.shard_dim`` and fused ``parts``):
column-parallel ``qkv`` and ``gate_up`` (each rank owns whole heads and a slice of the MLP width),
row-parallel ``o`` and ``down`` (followed by one all-reduce each), everything else replicated. This
module only carries the runtime half: the process group to reduce over, built from a torch
``DeviceMesh`` axis or given directly. Collective timeouts are those of the process group (set them
when building it: ``init_process_group(timeout=...)``).

Simplifications, on purpose: no sequence or vocab parallelism; every rank runs the same engine
calls in the same order (SPMD), so scheduling decisions agree without extra communication (sampling
is counter-based, and all ranks see bit-identical reduced logits).

The calls must also reach every rank *between the same two decode steps*: each rank's step loop
admits, aborts and pauses at its own step boundary, and ranks whose batches differ call the
all-reduce with different shapes (an error under gloo, a hang until the group's timeout under NCCL).
So drive a TP engine in rounds: one ``generate`` call per round, made on every rank while the engines
are idle, and ``pause``/``abort``/weight updates only while every rank is paused. There is no
leader that broadcasts each step's schedule (SGLang's design) yet; the pipeline's embedded engines
run without TP, and TP serving in production goes through SGLang.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (the default is "no TP")."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None with size 1

    @classmethod
    def from_device_mesh(cls, mesh: Any, axis: str = "tp") -> "TensorParallel":
        """The ``axis`` dimension of a torch ``DeviceMesh`` (e.g. ``init_device_mesh(..., ("tp",))``)."""
        group = mesh.get_group(axis)
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    @property
    def all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        """In-place sum over the group, or None when there is nothing to reduce."""
        if self.size == 1:
            return None
        group = self.group

        def reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=group)

        return reduce
