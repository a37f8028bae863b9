"""The sampler: bounded, staleness-aware sample queues with admission control (see ../../docs/staleness.md),
and the prompt ledger beside them."""

from meshrl.queues.config import QueueConfig
from meshrl.queues.ledger import InFlight, PromptLedger
from meshrl.queues.reservations import Reservation
from meshrl.queues.sample import Sample
from meshrl.queues.sample_queue import QueueClosed, QueueTimeout, SampleQueue
from meshrl.queues.sampler import Sampler, SamplerState
from meshrl.queues.snapshot import QueueSnapshot
from meshrl.queues.wire import decode_samples, encode_samples

__all__ = [
    "InFlight",
    "PromptLedger",
    "QueueClosed",
    "QueueConfig",
    "QueueSnapshot",
    "QueueTimeout",
    "Reservation",
    "Sample",
    "SampleQueue",
    "Sampler",
    "SamplerState",
    "decode_samples",
    "encode_samples",
]
