"""Tensor parallelism for TorchEngine: which rank of which group, the all-reduce the model calls, and
the channel over which rank 0 drives the others' schedule.

The sharding itself is declared in ``layout.py`` (``ParamLayout.shard_dim`` and fused ``parts``):
column-parallel ``qkv`` and ``gate_up`` (each rank owns whole heads and a slice of the MLP width),
row-parallel ``o`` and ``down`` (followed by one all-reduce each), everything else replicated. This
module only carries the runtime half: the process group to reduce over, built from a torch
``DeviceMesh`` axis or given directly. Collective timeouts are those of the process group (set them
when building it: ``init_process_group(timeout=...)``).

Ranks must run the same steps on the same batches: a request admitted a step apart makes the
all-reduce shapes differ (an error under gloo, a hang until the group's timeout under NCCL). Two
ways to drive them:

- **Leader-driven** (``leader_driven=True``, SGLang's design): callers talk to rank 0 only. Before
  each step rank 0 broadcasts what changed since the last one (requests added, aborts, pause and
  resume, version flips, shutdown: ``schedule.py``), and the other ranks, inside ``await
  engine.follow()``, apply the same changes and run the same step. Their schedule is thus rank 0's
  by construction, whatever the timing of the calls. Weights are each rank's own: every rank stages
  its shard (``begin_weight_update`` / ``load_weights`` / ``end_weight_update``), and a follower's
  staged version goes live when rank 0's flip to that version reaches it, at the same step boundary.
  While idle, rank 0 sends a heartbeat every ``heartbeat_s`` so that waiting followers never reach
  the group's timeout; it starts doing so at its first call (or ``await engine.start()``).
- **SPMD in rounds** (the default): every rank gets the same calls, *between the same two decode
  steps*. One ``generate`` call per round, made on every rank while the engines are idle, and
  ``pause``/``abort``/weight updates only while every rank is paused. Cheaper (no broadcast per
  step), and enough for offline batches.

Sampling is counter-based and every rank sees bit-identical reduced logits, so no tokens are ever
sent between ranks. Simplifications, on purpose: no sequence or vocab parallelism; in-place weight
writes (``write_params``/``live_params``) are refused under a leader, as they would need every rank
paused at the same step.
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
    leader_driven: bool = False
    """Rank 0 takes every call and broadcasts each step's schedule; the others run ``follow()``."""
    control_group: Any = None
    """Group for the schedule broadcasts (e.g. a gloo group beside an NCCL ``group``); None: ``group``."""
    heartbeat_s: float = 1.0
    """Leader-driven: an idle leader's message interval; keep it well under the group's timeout."""
    flip_timeout_s: float = 30.0
    """Leader-driven: how long a follower waits, at rank 0's flip to a version, for its own staged
    weights of that version to be ended (``end_weight_update``), and a follower's next
    ``begin_weight_update`` for that flip. Keep it under the group's timeout: rank 0's next broadcast
    waits for the follower meanwhile (end every rank's update before rank 0's, and nothing waits)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel: rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("TensorParallel with size > 1 needs its process group")
        if not (self.heartbeat_s > 0 and self.flip_timeout_s > 0):
            raise ValueError(f"heartbeat_s and flip_timeout_s must be > 0, got {self.heartbeat_s} and "
                             f"{self.flip_timeout_s}")

    @classmethod
    def from_device_mesh(cls, mesh: Any, axis: str = "tp", **kw: Any) -> "TensorParallel":
        """The ``axis`` dimension of a torch ``DeviceMesh`` (e.g. ``init_device_mesh(..., ("tp",))``);
        ``kw``: the other fields (``leader_driven=True``, ...)."""
        group = mesh.get_group(axis)
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group, **kw)

    @property
    def is_follower(self) -> bool:
        """A leader-driven rank other than 0: it runs ``follow()`` and takes no generation calls."""
        return self.leader_driven and self.size > 1 and self.rank != 0

    @property
    def is_leader(self) -> bool:
        return self.leader_driven and self.size > 1 and self.rank == 0

    @property
    def all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        """In-place sum over the group, or None when there is nothing to reduce."""
        if self.size == 1:
            return None
        group = self.group

        def reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=group)

        return reduce
