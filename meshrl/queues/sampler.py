"""The sampler: the sample queue and the prompt ledger as one object, with one snapshot.

Whoever sends rollout requests takes them here, and the trainer takes its batches here:

```text
take(k)       a request to generate: a released or restored one first (same reservation, prompts,
              group ids), else k·n queue positions (waits for: admission within max_staleness;
              unblocked by: set_version after a push) and the next k prompts of the stream, in one step
put_*(…, id)  its samples (waits for: room under capacity_tokens; unblocked by: a batch taken);
              the request is done
cancel(id)    a request that will not put: its positions go back, it is done
release(w)    the requests rollout worker ``w`` took and did not put (it died): taken again first
get_batch_*   whole groups within max_staleness of the step's version (SampleQueue)
step_batch    the batch of train step s, taken once and answered to every trainer dp rank that asks
              (each fetches its own share); after hold_batches, STOP (None) instead of waiting
state()       what a checkpoint keeps: the queue's snapshot, the prompt position, the next group and
              the requests in flight, read at one instant (no await between the reads)
restore(s)    a fresh sampler continues from a checkpoint's state: its requests in flight are
              taken again first, reservations no request holds are cancelled
```

The queue and the ledger used to live in two processes (the queue actor, the controller), so a
checkpoint had to hold new requests back while it read both, and a put whose reply overtook the
snapshot's had to stay recorded; here one object holds both, so a request is either in the
snapshot's samples or in its ``in_flight``, never neither. It is a plain class with async methods
and no Ray import (``SamplerActor`` runs it as an actor; one rollout worker may hold it in process).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import msgspec

from meshrl.queues.config import QueueConfig
from meshrl.queues.ledger import InFlight, PromptLedger
from meshrl.queues.sample_queue import SampleQueue
from meshrl.queues.wire import SampleMeta
from meshrl.tasks.base import Problem

__all__ = ["Sampler", "SamplerState"]


class SamplerState(msgspec.Struct, frozen=True, kw_only=True):
    """The sampler's part of a checkpoint (``RunState`` keeps these fields under the same names)."""

    generated_tokens: int = 0
    """Policy tokens of the samples put so far (the puts say how many)."""
    queue_snapshot: bytes
    """``SampleQueue.snapshot()``."""
    prompt_position: int
    """Training prompts handed out so far."""
    next_group: int
    """The next group id (sampling seeds are derived from group ids)."""
    in_flight: list[InFlight]
    """Requests taken and not put: a resume takes them again."""


class Sampler:
    """The run's queue and prompt ledger (module docstring)."""

    def __init__(self, config: QueueConfig, problems: Sequence[Problem], seed: int, *, samples_per_prompt: int,
                 samples_per_step: int, steps_per_version: int = 1, audit: bool = False) -> None:
        self.queue = SampleQueue(config, samples_per_step=samples_per_step, steps_per_version=steps_per_version,
                                 ledger=audit)
        self.prompts = PromptLedger(problems, seed)
        self.samples_per_prompt = samples_per_prompt
        self.generated_tokens = 0
        """Policy tokens of the samples put so far (what each put says it carries)."""
        self._owners: dict[int, int] = {}
        """Reservation id -> the rollout worker that took the request (``release``)."""
        self._reports: list[Any] = []
        """What the producers sent with their puts since the last ``report`` (their timeline's spans)."""
        self._steps: dict[int, list[Any]] = {}
        """Train step -> [its batch's task, the dp ranks still to answer] (``step_batch``)."""
        self._held = asyncio.Event()
        """``hold_batches``: the trainer's batches are answered with STOP (None)."""
        self._held_always = asyncio.Event()
        """Held for the run's stop: every step's batch is STOP, not only one after a push."""

    async def take(self, prompts: int, *, timeout: float | None = None,
                   owner: int | None = None) -> tuple[InFlight, list[Problem]]:
        """A request to generate ``prompts`` prompts × samples_per_prompt samples (module docstring);
        ``owner``: the rollout worker taking it (``release``)."""
        taken = self.prompts.take_reissued()
        if taken is None:
            # waits for: admission within max_staleness; unblocked by: set_version after a push
            reservation = await self.queue.reserve(prompts * self.samples_per_prompt, timeout=timeout)
            taken = self.prompts.take(reservation.id, prompts)  # no await since the grant: a snapshot sees both or neither
        if owner is not None:
            self._owners[taken[0].reservation_id] = owner
        return taken

    async def put_encoded(self, blob: bytes, reservation_id: int, *, timeout: float | None = None, tokens: int = 0,
                          report: Any = None) -> None:
        """``SampleQueue.put_encoded``, which ends the request; ``tokens``: the policy tokens in the
        samples, ``report``: the producer's note for the controller (``report``)."""
        # waits for: room under capacity_tokens; unblocked by: a batch taken
        await self.queue.put_encoded(blob, reservation_id, timeout=timeout)
        self._done(reservation_id, tokens, report)

    async def put_ref(self, blobs: list[Any], metas: list[SampleMeta], reservation_id: int, *,
                      timeout: float | None = None, tokens: int = 0, report: Any = None) -> None:
        """``SampleQueue.put_ref``, which ends the request (``put_encoded``)."""
        # waits for: room under capacity_tokens; unblocked by: a batch taken
        await self.queue.put_ref(blobs, metas, reservation_id, timeout=timeout)
        self._done(reservation_id, tokens, report)

    def _done(self, reservation_id: int, tokens: int, report: Any) -> None:
        self.prompts.done(reservation_id)
        self._owners.pop(reservation_id, None)
        self.generated_tokens += tokens
        if report is not None:
            self._reports.append(report)

    async def cancel(self, reservation_id: int) -> int:
        """Give a request's positions back (it will not put); returns how many."""
        self.prompts.done(reservation_id)
        self._owners.pop(reservation_id, None)
        return await self.queue.cancel(reservation_id)

    async def release(self, owner: int) -> int:
        """The requests rollout worker ``owner`` took and did not put (it died): handed out again first,
        to whichever worker takes next (same reservation, prompts and group ids: the same seeds).
        Returns how many."""
        ids = [r for r, o in self._owners.items() if o == owner]
        for r in ids:
            del self._owners[r]
        return self.prompts.requeue(ids)

    async def report(self) -> dict[str, Any]:
        """The queue's metrics, the tokens generated so far, and what the producers sent with their
        puts since the last report (``put_*(report=)``)."""
        reports, self._reports = self._reports, []
        return {"metrics": await self.queue.metrics(), "generated_tokens": self.generated_tokens, "reports": reports}

    @property
    def in_flight(self) -> int:
        """Requests taken and not yet put or cancelled."""
        return len(self.prompts.in_flight)

    async def state(self) -> SamplerState:
        """What a checkpoint keeps (module docstring), read at one instant."""
        position, group, in_flight = self.prompts.stream.position, self.prompts.next_group, self.prompts.unfinished()
        tokens = self.generated_tokens
        # its groups and reservations are read before its first await: the same instant as the ledger's
        snapshot = await self.queue.snapshot()
        return SamplerState(queue_snapshot=snapshot, prompt_position=position, next_group=group, in_flight=in_flight,
                            generated_tokens=tokens)

    async def restore(self, state: Any) -> int:
        """Continue from a checkpoint's state (a ``SamplerState`` or a ``RunState``) in this fresh
        sampler; returns how many requests are taken again first."""
        outstanding = await self.queue.restore(state.queue_snapshot)
        for reservation_id in self.prompts.restore(state, [r.id for r in outstanding]):
            await self.queue.cancel(reservation_id)  # granted, but its prompts were never taken
        self.generated_tokens = state.generated_tokens
        return self.prompts.reissue_pending

    async def step_batch(self, step: int, n: int, version: int, *, shares: int, timeout: float | None = None,
                         pausable: bool = True) -> Any:
        """Train step ``step``'s batch (``get_batch_refs(shares=shares)``), taken once however many of
        the trainer's ``shares`` dp ranks ask; every rank gets the same ``Shares`` and fetches its own.
        None (STOP) once ``hold_batches`` was called: the trainer's chunk ends there and no batch is
        taken. ``pausable``: the step follows a push (the trainer's weights are a served version); a
        hold for a restarted rollout worker waits for such a step, a hold for the run's stop does not."""
        entry = self._steps.get(step)
        if entry is None:
            entry = self._steps[step] = [asyncio.ensure_future(self._take_step(n, version, shares, timeout, pausable)), shares]
        try:
            return await asyncio.shield(entry[0])
        finally:
            entry[1] -= 1
            if entry[1] <= 0 and self._steps.get(step) is entry:
                del self._steps[step]

    async def _take_step(self, n: int, version: int, shares: int, timeout: float | None, pausable: bool) -> Any:
        def stops() -> bool:
            return self._held.is_set() and (pausable or self._held_always.is_set())

        if stops():
            return None
        getting = asyncio.ensure_future(self.queue.get_batch_refs(n, version, timeout=timeout, shares=shares))
        holding = asyncio.ensure_future(self._held.wait())
        try:
            while True:
                # waits for: n samples within max_staleness of `version`, or hold_batches
                await asyncio.wait([getting, holding], return_when=asyncio.FIRST_COMPLETED)
                if getting.done() or stops():
                    break
                holding = asyncio.ensure_future(self._held_always.wait())  # held for a revival: not at this step
        finally:
            holding.cancel()
        if not getting.done():
            getting.cancel()
            # a get already woken by a put takes its batch despite the cancel: then it is the trainer's
            await asyncio.wait([getting])
        return None if getting.cancelled() else getting.result()

    async def hold_batches(self, *, stopping: bool = False) -> None:
        """Answer the trainer's batches with STOP (``step_batch``) from now on, until
        ``resume_batches``: the controller takes the run back between two chunks (to restart a
        rollout worker in place) or, with ``stopping``, for good (``Pipeline.stop``)."""
        if stopping:
            self._held_always.set()
        self._held.set()

    async def resume_batches(self) -> None:
        """The trainer's batches are taken again (``hold_batches``)."""
        self._held.clear()
        self._held_always.clear()
        for step in [s for s, (task, _) in self._steps.items() if task.done() and not task.cancelled()
                     and task.exception() is None and task.result() is None]:
            del self._steps[step]  # a STOP not every rank collected: the step is asked again

    # the queue's own verbs, as they are

    async def get_batch(self, n: int, current_version: int, *, timeout: float | None = None) -> Any:
        return await self.queue.get_batch(n, current_version, timeout=timeout)

    async def get_batch_encoded(self, n: int, current_version: int, *, timeout: float | None = None) -> bytes:
        return await self.queue.get_batch_encoded(n, current_version, timeout=timeout)

    async def get_batch_refs(self, n: int, current_version: int, *, timeout: float | None = None,
                             shares: int | None = None) -> Any:
        return await self.queue.get_batch_refs(n, current_version, timeout=timeout, shares=shares)

    async def set_version(self, version: int) -> None:
        await self.queue.set_version(version)

    async def close(self) -> None:
        await self.queue.close()

    async def metrics(self) -> dict[str, float]:
        return await self.queue.metrics()

    async def held_groups(self) -> dict[int, int]:
        return await self.queue.held_groups()

    async def ledger(self, since: int, upto: int | None = None) -> tuple[list[tuple[int, int, bool]], int]:
        """The queue's audit ledger (run.audit), not the prompt ledger."""
        return await self.queue.ledger(since, upto)
