"""Admission control: how many samples may be reserved now and still train within ``max_staleness``.

Every sample occupies one *position* in the trainer's consumption order. The trainer consumes
``samples_per_step`` samples per train step and publishes a new policy version every
``steps_per_version`` steps, so the sample at position ``p`` is trained at version
``p // (samples_per_step * steps_per_version)``. A sample generated now has
``behavior_version >= published_version`` (the controller publishes only after every engine
applied the weights), hence it trains within ``max_staleness = eta`` iff its position is below
``(published_version + eta + 1) * samples_per_step * steps_per_version``. A reservation of ``n``
is granted iff ``consumed_position + live + n`` stays within that bound, where ``live`` counts
samples queued plus reserved-but-unfilled.

Why positions and not a monotonic slot counter: a cancelled reservation or a dropped sample never
reaches the trainer, so its slot would never be consumed; with a monotonic counter those holes
eat the bound for good, and at ``eta = 0`` a single cancellation deadlocks the pipeline (the
trainer waits for samples, producers wait for a version bump that needs a train step). Here a
cancelled or dropped sample simply stops being live, and its position is reused.

Simplifications on purpose: the trainer is assumed to consume in oldest-first order and to
publish on a fixed cadence; if it reports a higher version than its consumption implies (a run
resumed from a checkpoint with a fresh queue), the consumed position jumps to match that version.
"""

from __future__ import annotations

__all__ = ["Admission"]


class Admission:
    """Pure slot arithmetic; the queue owns the counters' meaning (what is live, what is consumed)."""

    def __init__(self, *, max_staleness: int, samples_per_step: int, steps_per_version: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (in policy versions), got {max_staleness}")
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
        if steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got {steps_per_version}")
        self.max_staleness = max_staleness
        self.samples_per_step = samples_per_step
        self.steps_per_version = steps_per_version
        self.samples_per_version = samples_per_step * steps_per_version
        self.published_version = 0
        """The newest version every engine has applied (``set_version``)."""
        self.consumed_position = 0
        """Positions the trainer has used up: samples trained, or more if its version says so."""

    @property
    def bound(self) -> int:
        """First position that a sample generated now could no longer train within the bound."""
        return (self.published_version + self.max_staleness + 1) * self.samples_per_version

    def free(self, live: int) -> int:
        """How many more samples may be reserved while ``live`` are queued or reserved."""
        return max(0, self.bound - self.consumed_position - live)

    def publish(self, version: int) -> None:
        if version < self.published_version:
            raise ValueError(
                f"set_version({version}) goes backwards: version {self.published_version} is "
                f"already published (versions only grow, +1 per weight publish)"
            )
        self.published_version = version
        self.observe_trainer_version(version)

    def observe_trainer_version(self, version: int) -> None:
        """The trainer at ``version`` has used at least every position of earlier versions."""
        self.consumed_position = max(self.consumed_position, version * self.samples_per_version)

    def consume(self, n: int) -> None:
        self.consumed_position += n

    def train_version_of(self, position: int) -> int:
        """The trainer version that consumes ``position`` when nothing ahead of it is dropped."""
        return position // self.samples_per_version
