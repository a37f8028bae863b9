"""Bounded, staleness-aware sample queues with admission control (see ../../docs/staleness.md)."""

from meshrl.queues.config import QueueConfig
from meshrl.queues.reservations import Reservation
from meshrl.queues.sample import Sample
from meshrl.queues.sample_queue import QueueClosed, QueueTimeout, SampleQueue
from meshrl.queues.snapshot import QueueSnapshot
from meshrl.queues.wire import decode_samples, encode_samples

__all__ = [
    "QueueClosed",
    "QueueConfig",
    "QueueSnapshot",
    "QueueTimeout",
    "Reservation",
    "Sample",
    "SampleQueue",
    "decode_samples",
    "encode_samples",
]
