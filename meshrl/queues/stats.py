"""The queue's counters: what went in, what came out, what was dropped, and how long anyone waited.

Counters are a msgspec Struct so a snapshot carries them and a resumed run keeps counting where
it stopped. Throughput is measured over a sliding window of recent ``get_batch`` calls, which is
not snapshotted on purpose: a restart's first window should not average in the downtime.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from meshrl.queues.groups import Group

__all__ = ["QueueCounters", "ThroughputWindow"]


class QueueCounters(msgspec.Struct, kw_only=True):
    """Cumulative since the run started (restored from snapshots)."""

    samples_put: int = 0
    """Samples accepted by ``put``."""
    samples_consumed: int = 0
    """Samples handed to the trainer by ``get_batch`` (kept-stale ones included)."""
    dropped_stale: int = 0
    """Samples dropped because their group's oldest behaviour version was past ``max_staleness``."""
    dropped_incomplete: int = 0
    """Samples dropped with an unfinished group when its reservation was cancelled."""
    kept_stale: int = 0
    """Samples past ``max_staleness`` handed to the trainer anyway (``stale_policy = "keep"``)."""
    reservations_granted: int = 0
    slots_granted: int = 0
    """Samples reserved in all granted reservations."""
    slots_cancelled: int = 0
    """Reserved samples that were never put (``cancel``); their positions are reused."""
    reserve_wait_s: float = 0.0
    """Producer time spent waiting for admission (backpressure from ``max_staleness``)."""
    put_wait_s: float = 0.0
    """Producer time spent waiting for token capacity."""
    get_wait_s: float = 0.0
    """Consumer time spent waiting for enough admissible samples in complete groups."""
    age_s_sum: float = 0.0
    """Sum over consumed samples (with a ``t_generated``) of seconds from generation to training."""
    age_count: int = 0
    staleness_hist: dict[int, int] = {}
    """Consumed samples by staleness (trainer version minus the sample's behaviour version)."""

    def record_consumed(self, groups: list[Group], version: int, max_staleness: int, now: float) -> None:
        """Count groups handed to the trainer at ``version`` (the hot path: plain loops)."""
        hist = self.staleness_hist
        for g in groups:
            if version - g.min_behavior_version > max_staleness:
                self.kept_stale += g.group_size
            for v in g.versions:
                k = version - v if v < version else 0
                hist[k] = hist.get(k, 0) + 1
            for t in g.t_generated:
                if t > 0:  # 0 = the producer did not stamp it
                    self.age_s_sum += now - t
                    self.age_count += 1
        self.samples_consumed += sum(g.group_size for g in groups)


class ThroughputWindow:
    """Consumed samples per second over roughly the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._events.append((now, n))
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        if len(self._events) < 2:
            return 0.0
        span = self._events[-1][0] - self._events[0][0]
        # The first event opens the window; only what came after it counts as flow through it.
        return sum(n for _, n in list(self._events)[1:]) / span if span > 0 else 0.0
