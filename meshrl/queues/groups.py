"""The queue's storage: samples held as whole GRPO groups, complete groups ordered oldest first.

A group is the unit of admission, training and dropping: it becomes consumable only once all
``group_size`` samples arrived, and it is ordered by the *oldest* behaviour version among its
members (the member that decides whether the group is still within the staleness bound).

Simplifications on purpose: every group is produced under a single reservation (one rollout
worker generates all samples of a prompt), which lets a cancelled reservation drop its unfinished
groups without guessing who else might complete them; ties in version are broken by the order in
which groups completed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from meshrl.queues.wire import SampleMeta

__all__ = ["Group", "GroupStore"]


@dataclass(slots=True)
class Group:
    group_id: int
    group_size: int
    reservation_id: int
    items: list[Any] = field(default_factory=list)
    """Members in arrival order: ``Sample``s from ``put``, raw msgpack slices from ``put_encoded``,
    ``Parcel``s (a ref into a producer's blob) from ``put_ref``."""
    versions: list[int] = field(default_factory=list)
    """Each member's behaviour version."""
    t_generated: list[float] = field(default_factory=list)
    """Each member's generation time (``time.time()``; 0 when the producer did not set it)."""
    tokens: int = 0
    min_behavior_version: int = 0
    order: int = -1
    """Completion order (tie-break among equal versions); -1 while incomplete."""

    @property
    def complete(self) -> bool:
        return len(self.items) == self.group_size


class GroupStore:
    """Queued samples by group; a heap of complete groups keyed by (oldest version, completion)."""

    def __init__(self) -> None:
        self.groups: dict[int, Group] = {}
        self._ready: list[tuple[int, int, int]] = []  # (min_behavior_version, order, group_id)
        self._next_order = 0
        self.num_samples = 0
        self.num_tokens = 0
        self.ready_samples = 0

    def add(self, reservation_id: int, items: list[Any], metas: list[SampleMeta]) -> None:
        """Append samples (already validated by the queue) to their groups."""
        g: Group | None = None
        for item, m in zip(items, metas):
            if g is None or m.group_id != g.group_id:  # batches mostly hold groups contiguously
                g = self.groups.get(m.group_id)
                if g is None:
                    g = Group(m.group_id, m.group_size, reservation_id,
                              min_behavior_version=m.behavior_version)
                    self.groups[m.group_id] = g
            g.items.append(item)
            g.versions.append(m.behavior_version)
            g.t_generated.append(m.t_generated)
            g.tokens += m.num_tokens
            if m.behavior_version < g.min_behavior_version:
                g.min_behavior_version = m.behavior_version
            if len(g.items) == g.group_size:
                self._mark_ready(g)
        self.num_samples += len(items)
        self.num_tokens += sum(m.num_tokens for m in metas)

    def _mark_ready(self, g: Group) -> None:
        g.order = self._next_order
        self._next_order += 1
        heapq.heappush(self._ready, (g.min_behavior_version, g.order, g.group_id))
        self.ready_samples += g.group_size

    def oldest_ready(self) -> Group | None:
        return self.groups[self._ready[0][2]] if self._ready else None

    def pop_oldest_ready(self) -> Group:
        _, _, gid = heapq.heappop(self._ready)
        g = self.groups.pop(gid)
        self._forget(g)
        self.ready_samples -= g.group_size
        return g

    def put_back(self, taken: list[Group]) -> None:
        """Return groups taken by ``pop_oldest_ready`` but not used, keeping their place in line."""
        for g in taken:
            self.groups[g.group_id] = g
            self.num_samples += len(g.items)
            self.num_tokens += g.tokens
            self.ready_samples += g.group_size
            heapq.heappush(self._ready, (g.min_behavior_version, g.order, g.group_id))

    def remove_incomplete(self, group_id: int) -> Group:
        g = self.groups.pop(group_id)
        assert not g.complete, "complete groups leave through pop_oldest_ready"
        self._forget(g)
        return g

    def _forget(self, g: Group) -> None:
        self.num_samples -= len(g.items)
        self.num_tokens -= g.tokens

    def ready_in_order(self) -> list[Group]:
        """Complete groups oldest first (snapshots and inspection; not on the hot path)."""
        return [self.groups[gid] for _, _, gid in sorted(self._ready)]
