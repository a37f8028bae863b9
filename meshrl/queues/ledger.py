"""The rollout side's data position: prompts and group ids handed out, and the requests in flight.

Kept beside the queue in the ``Sampler`` (``meshrl.queues.sampler``) and saved in every checkpoint
(``meshrl.pipeline.checkpoint``), so a resumed run takes the prompts the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from meshrl.tasks.base import Problem, PromptStream

__all__ = ["InFlight", "PromptLedger"]


class InFlight(msgspec.Struct, frozen=True):
    """A generate request under a queue reservation: enough to issue it again after a resume."""

    reservation_id: int
    first_group: int
    """Group id of its first prompt (the next ones follow)."""
    first_position: int
    """Prompt-stream position of its first prompt."""
    count: int
    """Prompts in the request."""



class PromptLedger:
    """The rollout side's data position: prompts and group ids handed out, requests in flight.

    Fresh requests take the next prompts of the stream; after ``restore``, the requests that were
    in flight at the checkpoint are handed out again first (same reservation, prompts, group ids).
    The caller never ``take``s while a checkpoint captures the queue's snapshot and this ledger.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, *, source: Sequence[Problem] | None = None) -> None:
        self.problems = self._problems = problems
        self.source = problems if source is None else source
        """The problems as written, before chat rendering: what the run's fingerprint hashes."""
        self._seed = seed
        self.stream = PromptStream(problems, seed)
        self.next_group = 0
        self.in_flight: dict[int, InFlight] = {}  # by reservation id
        self._reissue: list[InFlight] = []
        self._done_since_take: list[InFlight] = []
        """Requests done since the last ``take``: a checkpoint records them too (``unfinished``)."""

    def take(self, reservation_id: int, count: int) -> tuple[InFlight, list[Problem]]:
        """The next ``count`` prompts for a new reservation."""
        job = InFlight(reservation_id, self.next_group, self.stream.position, count)
        problems = self.stream.take(count)
        self.next_group += count
        self.in_flight[reservation_id] = job
        # no checkpoint is capturing now (class docstring), so every put answered so far was applied
        # before the next snapshot is asked for: their requests need not be recorded any more
        self._done_since_take.clear()
        return job, problems

    def take_reissued(self) -> tuple[InFlight, list[Problem]] | None:
        """A request restored from a checkpoint (or requeued) to generate again, if any is left."""
        if not self._reissue:
            return None
        job = self._reissue.pop(0)
        self.in_flight[job.reservation_id] = job
        return job, PromptStream(self._problems, self._seed, position=job.first_position).take(job.count)

    def done(self, reservation_id: int) -> None:
        if (job := self.in_flight.pop(reservation_id, None)) is not None:
            self._done_since_take.append(job)

    def requeue(self, reservation_ids: Sequence[int]) -> int:
        """Requests in flight whose producer died: handed out again first, before fresh prompts (the
        same reservation, prompts and group ids). Returns how many were still in flight."""
        jobs = [self.in_flight.pop(r) for r in reservation_ids if r in self.in_flight]
        self._reissue[:0] = jobs
        return len(jobs)

    def restore(self, state: Any, outstanding: Sequence[int]) -> list[int]:
        """Continue from ``state`` (a checkpoint's ``RunState``: its prompt position, next group and
        requests in flight); ``outstanding``: reservation ids the restored queue still
        waits on. Returns those to cancel: granted, but their prompts were not yet taken."""
        self.stream = PromptStream(self._problems, self._seed, position=state.prompt_position)
        self.next_group = state.next_group
        known = {job.reservation_id: job for job in state.in_flight}
        self._reissue = [known[r] for r in outstanding if r in known]
        return [r for r in outstanding if r not in known]

    @property
    def reissue_pending(self) -> int:
        return len(self._reissue)

    def unfinished(self) -> list[InFlight]:
        """What a checkpoint records, read after the queue's snapshot: requests in flight, restored
        ones not yet re-issued, and those done since the last ``take``. ``restore`` re-issues those
        whose reservation the snapshot still holds; one left out would be cancelled there and its
        prompts skipped for good. A request done can be one: Ray does not order replies across
        calls, so a put applied just after the snapshot may answer first (a large snapshot comes
        through the object store, the put's empty reply inline)."""
        return list(self.in_flight.values()) + list(self._reissue) + list(self._done_since_take)
