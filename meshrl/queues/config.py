"""QueueConfig: the knobs of one SampleQueue, with their defaults in one place."""

from __future__ import annotations

import math

from typing import Literal

import msgspec

__all__ = ["QueueConfig"]


class QueueConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Knobs of one SampleQueue; the step shape (samples per step) comes from the trainer."""

    max_staleness: int = 1
    """eta, in policy versions: a sample may train at version V iff V - behavior_version <= eta;
    0 is synchronous on-policy training (DESIGN.md, "Policy versions and staleness")."""
    stale_policy: Literal["drop", "keep"] = "drop"
    """Samples past eta anyway (a slow engine): "drop" them (counted as dropped_stale), or "keep"
    them for the trainer's importance-sampling correction (counted as kept_stale)."""
    capacity_tokens: int = 4_000_000
    """Memory bound: prompt plus response tokens held; ``put`` blocks past it."""
    reserve_timeout_s: float = 900.0
    """Default wait for admission in ``reserve`` (spans a train step plus a weight sync)."""
    put_timeout_s: float = 300.0
    """Default wait for token capacity in ``put``."""
    get_timeout_s: float = 900.0
    """Default wait for a full batch in ``get_batch`` (spans generation of a batch)."""

    def __post_init__(self) -> None:
        # msgspec checks types when decoding YAML, not when a Struct is built in code.
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 policy versions, got {self.max_staleness}")
        if self.stale_policy not in ("drop", "keep"):
            raise ValueError(f"stale_policy must be 'drop' or 'keep', got {self.stale_policy!r}")
        if self.capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {self.capacity_tokens}")
        for name in ("reserve_timeout_s", "put_timeout_s", "get_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")
