"""The queue's checkpoint format: what ``SampleQueue.snapshot`` writes and ``restore`` reads.

msgpack via msgspec, versioned by ``format``. Complete groups are listed oldest first and come
back in that order; samples put encoded are stored verbatim and decode as plain ``Sample``s.
Simplifications on purpose: every counter carries over, but the throughput window starts empty
(a restart's first rate should not average in the downtime); the queue's config is not stored,
so a resumed run may change ``max_staleness`` or ``capacity_tokens``.
"""

from __future__ import annotations

import msgspec

from meshrl.queues.reservations import Reservation
from meshrl.queues.sample import Sample
from meshrl.queues.stats import QueueCounters

__all__ = ["FORMAT", "QueueSnapshot", "SnapshotGroup", "SnapshotReservation", "ledger_mark"]


FORMAT = 1


class SnapshotGroup(msgspec.Struct, kw_only=True):
    reservation_id: int
    samples: list[Sample]


class SnapshotReservation(msgspec.Struct, kw_only=True):
    reservation: Reservation
    filled: int


class QueueSnapshot(msgspec.Struct, kw_only=True):
    """Everything a resumed run needs; complete groups are listed oldest first."""

    format: int = FORMAT
    published_version: int
    consumed_position: int
    next_reservation_id: int
    ledger_mark: int = 0
    """The position of the queue's ledger (run.audit) when the snapshot was taken; not restored:
    a queue restored from it starts a ledger of its own."""
    counters: QueueCounters
    reservations: list[SnapshotReservation]
    groups: list[SnapshotGroup]



class _Mark(msgspec.Struct):
    ledger_mark: int = 0


def ledger_mark(blob: bytes) -> int:
    """A snapshot's ``ledger_mark`` (its samples are not read)."""
    return msgspec.msgpack.decode(blob, type=_Mark).ledger_mark
