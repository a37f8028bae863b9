"""Weight flow from the trainer to the engines, one whole policy version at a time.

Modules, bottom up:

* ``layout``: who holds which box of which tensor — the trainer's side read from its DTensors
  (FSDP2 ``Shard(0)`` over dp, uneven chunks included), the engines' from their declared TP plan
  (``meshrl.engines.layout``, the one HF <-> engine name mapping);
* ``plan``: source boxes intersected with destination boxes into transfers, bucketed by
  ``bucket_bytes``, cached per layout pair; every destination element moves exactly once;
* ``transport``: one process's share of a plan — same-process copies, broadcast, point-to-point,
  buckets pipelined (NCCL on GPU, gloo on CPU);
* ``push``: ``Resharder``, the per-process participant: versioned, atomic apply on the engine;
* ``meshes``: the same between actor meshes — ``SourceSide`` / ``DestSide`` held by the trainer
  and rollout actors, ``connect`` and ``push`` called by the controller;
* ``sglang``: the trainer's side of SGLang's ``update_weights_from_distributed`` protocol;
* ``object_store``: the minimal push through Ray's object store (full tensors, no sharding).
"""

from __future__ import annotations

import importlib
from typing import Any

from meshrl.reshard.layout import (
    DestLayout,
    SourceLayout,
    dest_layout,
    local_tensors,
    source_layout,
)
from meshrl.reshard.plan import Bucket, Plan, Transfer, plan_transfers
from meshrl.reshard.push import PushStats, ReshardConfig, ReshardError, Resharder, ReshardTarget
from meshrl.reshard.transport import GroupRanks, run_plan

# Ray-backed names load on first use, so engines and servers that only push over a group stay light.
_LAZY = {"push_weights": "meshrl.reshard.object_store", "connect": "meshrl.reshard.meshes",
         "push": "meshrl.reshard.meshes"}

__all__ = [
    "Bucket",
    "DestLayout",
    "GroupRanks",
    "Plan",
    "PushStats",
    "ReshardConfig",
    "ReshardError",
    "ReshardTarget",
    "Resharder",
    "SourceLayout",
    "Transfer",
    "connect",
    "dest_layout",
    "local_tensors",
    "plan_transfers",
    "push",
    "push_weights",
    "run_plan",
    "source_layout",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrl.reshard' has no attribute {name!r}")
