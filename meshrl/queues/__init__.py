"""Bounded, staleness-aware sample queues (see ../../docs/staleness.md)."""

from meshrl.queues.sample import Sample

__all__ = ["Sample"]
