"""Reservations: what a producer was granted, and which ``put``s it may make under it.

A reservation is filled by one or more ``put``s; every group it starts must be complete by the
time it is filled (otherwise the group could never be trained), and no group spans two
reservations. A bad ``put`` is rejected whole, before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from meshrl.queues.groups import Group
from meshrl.queues.wire import SampleMeta

__all__ = ["Reservation", "ReservationState", "check_put"]


class Reservation(msgspec.Struct, kw_only=True, frozen=True):
    """Positions granted to a producer: it generates ``n`` samples and ``put``s them under ``id``."""

    id: int
    n: int
    slots: tuple[int, int]
    """[start, end) positions in the trainer's consumption order at grant time."""
    min_version: int
    """The policy version the generating engine must have applied (at least)."""
    train_version: int
    """The latest trainer version expected to consume these samples (<= min_version + eta)."""


@dataclass(slots=True)
class ReservationState:
    info: Reservation
    filled: int = 0
    open_groups: set[int] = field(default_factory=set)
    """Groups started under this reservation and not yet complete."""

    @property
    def unfilled(self) -> int:
        return self.info.n - self.filled


def check_put(metas: list[SampleMeta], rid: int, res: ReservationState | None,
              groups: dict[int, Group]) -> None:
    """Raise ``ValueError`` naming the problem if samples with these ``metas`` may not be put."""
    if res is None:
        raise ValueError(f"put: reservation {rid} is not outstanding (it was filled, cancelled, or "
                         "never granted)")
    if len(metas) > res.unfilled:
        raise ValueError(f"put: {len(metas)} samples overfill reservation {rid} "
                         f"({res.filled} of {res.info.n} already put)")
    counts: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for s in metas:
        gid = s.group_id
        if s.group_size < 1 or sizes.setdefault(gid, s.group_size) != s.group_size:
            raise ValueError(f"put: group {gid} has inconsistent or non-positive group_size "
                             f"({s.group_size})")
        if s.behavior_version < 0:
            raise ValueError(f"put: a sample of group {gid} has behavior_version "
                             f"{s.behavior_version} < 0")
        counts[gid] = counts.get(gid, 0) + 1
    have: dict[int, int] = {}
    for gid, k in counts.items():
        g = groups.get(gid)
        if g is not None:
            if g.reservation_id != rid or g.complete or g.group_size != sizes[gid]:
                raise ValueError(f"put: group {gid} is already queued (reservation "
                                 f"{g.reservation_id}, {len(g.items)} of {g.group_size} samples); "
                                 "a group is put under one reservation, once")
            have[gid] = len(g.items)
        if have.get(gid, 0) + k > sizes[gid]:
            raise ValueError(f"put: group {gid} would have {have.get(gid, 0) + k} samples, more "
                             f"than its group_size {sizes[gid]}")
    if len(metas) == res.unfilled:
        unfinished = [gid for gid in res.open_groups if gid not in counts]
        unfinished += [gid for gid, k in counts.items() if have.get(gid, 0) + k < sizes[gid]]
        if unfinished:
            raise ValueError(f"put: this put fills reservation {rid} but leaves groups "
                             f"{sorted(unfinished)[:8]} unfinished; they could never be trained")
