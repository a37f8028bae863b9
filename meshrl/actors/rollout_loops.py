"""The rollout loop, run by each rollout worker itself against the run's sampler.

```text
loop (× rollout.requests_in_flight per worker), until paused or the sampler closes:
  sampler.take(k)        a released or restored request, or k·n positions and the next k prompts
                         waits for: admission within max_staleness
                         unblocked by: the train loop's set_version after a push
  generate               on this worker's engine, continuously batched with the other loops'
  (or run_episodes)      with an environment: n episodes per prompt (meshrl.envs.episode)
  score                  here (reward.num_workers=0: the worker holds the reward), or on a reward
                         worker: the generations go to it straight from this process
  reference.annotate     only with a KL term
  sampler.put_*          waits for: room under queue.capacity_tokens
                         unblocked by: the train loop's get_batch_refs
```

The controller starts the loops (``RolloutWorker.run_loops``, one call per worker that lasts as
long as they do) and pauses them (``pause_loops``); it makes no call per request. What a request
did (its spans on the timeline, reward calls sent again) rides along with its put, and the
controller reads it from the sampler with the step's metrics (``Sampler.report``). A reward or reference worker
restarted by Ray mid-call gets the call again (its inputs are this process's, which outlive it).
This worker's own death fails its ``run_loops`` call at the controller, which releases the
requests it had taken back to the sampler (``Sampler.release``): another loop takes them again
with the same reservation, prompts and group ids, so the same seeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import msgspec

from meshrl.mesh import ActorFailure, bounded
from meshrl.queues import QueueClosed

__all__ = ["LoopHost", "LoopSettings", "RolloutLoops", "again"]

logger = logging.getLogger(__name__)


class LoopSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker's rollout loops need of the run's config."""

    worker: int
    """This worker's index (the sampler records which worker took a request)."""
    prompts_per_request: int
    samples_per_prompt: int
    requests_in_flight: int
    step_timeout_s: float
    """Longest wait for a generation, a score or an annotation."""
    reserve_timeout_s: float
    put_timeout_s: float
    inline_bytes: int
    """Samples that encode to fewer bytes travel inline, larger ones by reference (reward.inline_bytes)."""
    max_worker_restarts: int
    """Reward and reference calls are sent again while Ray restarts their worker (run.max_worker_restarts)."""


class RolloutLoops:
    """A worker's rollout loops (module docstring). ``play`` / ``play_scored``: its engine's (a colocated
    worker's wait for rollout mode); ``maker``: its ``RequestMaker``; ``sampler``, ``rewards``,
    ``reference``: the run's meshes (None: no such role)."""

    def __init__(self, play: Callable[..., Awaitable[Any]], play_scored: Callable[..., Awaitable[Any]], maker: Any,
                 sampler: Any, rewards: Any, reference: Any, settings: LoopSettings) -> None:
        self.play, self.play_scored, self.maker = play, play_scored, maker
        self.sampler, self.rewards, self.reference, self.s = sampler, rewards, reference, settings
        self.taking = asyncio.Event()
        self.taking.set()
        self.active = 0
        """Requests being generated (taken and not parked by a pause, not yet put)."""
        self._tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        """Until the sampler closes (returns) or a loop fails (raises its failure, the others cancelled)."""
        self._tasks = [asyncio.ensure_future(self._loop()) for _ in range(self.s.requests_in_flight)]
        try:
            for done in asyncio.as_completed(self._tasks):
                await done
        finally:
            self.cancel()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def pause(self, timeout_s: float) -> int:
        """Take no new request and wait (at most ``timeout_s``) for those being generated to put their
        samples; returns how many still were (the sampler records them for a checkpoint)."""
        self.taking.clear()
        deadline = time.monotonic() + timeout_s
        # waits for: the requests being generated to put their samples; unblocked by: these loops
        while self.active and time.monotonic() < deadline and not all(t.done() for t in self._tasks):
            await asyncio.sleep(0.02)
        return self.active

    async def _loop(self) -> None:
        s = self.s
        try:
            while True:
                await self.taking.wait()
                # waits for: admission within max_staleness; unblocked by: a push's set_version
                job, problems = await bounded(
                    self.sampler.take.call_one(s.prompts_per_request, timeout=s.reserve_timeout_s, owner=s.worker),
                    s.reserve_timeout_s + 30, "the sampler to admit a rollout request")
                if not self.taking.is_set():  # paused meanwhile: the request stays recorded (re-issued on resume)
                    await self.taking.wait()
                self.active += 1
                try:
                    await self._request(job, problems)
                finally:
                    self.active -= 1
        except QueueClosed:
            return  # the run winds down

    async def _request(self, job: Any, problems: list) -> None:
        """One request: generated, scored (and annotated), put into the sampler with its report."""
        s = self.s
        group_ids = list(range(job.first_group, job.first_group + job.count))
        rjob, requests = self.maker.job(problems, greedy=False, n=s.samples_per_prompt, group_ids=group_ids)
        inline, t0, resent = max(1, s.inline_bytes), time.time(), [0]
        if self.rewards is None:  # generated and scored here
            scored = await bounded(self.play_scored(rjob, requests, within_s=s.step_timeout_s, by_ref=inline),
                                   2 * s.step_timeout_s, "this worker to generate and score")
        else:  # the generations go to a reward worker straight from here
            played = await bounded(self.play(requests), s.step_timeout_s, "this worker's engine to generate")
            scored = await self.again(lambda: self.rewards.score.choose(rjob, within_s=s.step_timeout_s, by_ref=inline,
                                                                        **played),
                                      s.step_timeout_s, "a reward worker to score", resent)
        samples = scored.ref or scored.encoded  # refs, or a small request's bytes
        if self.reference is not None:
            samples = await self.again(lambda: self.reference.annotate.choose(samples), s.step_timeout_s,
                                       "the reference worker", resent)
        report = {"worker": s.worker, "reissued_calls": resent[0],
                  "spans": [("rollout", "generate", t0, scored.received), ("reward", "score", scored.received, time.time())]}
        # waits for: room under capacity_tokens; unblocked by: the train loop's get_batch_refs
        put = (self.sampler.put_ref.call_one(samples, scored.metas, job.reservation_id, timeout=s.put_timeout_s,
                                             tokens=scored.completion_tokens, report=report) if scored.ref else
               self.sampler.put_encoded.call_one(samples, job.reservation_id, timeout=s.put_timeout_s,
                                                 tokens=scored.completion_tokens, report=report))
        await bounded(put, s.put_timeout_s + 30, "the sampler to accept samples")

    async def again(self, call: Callable[[], Any], seconds: float, what: str, resent: list[int]) -> Any:
        return await again(call, seconds, what, restarts=bool(self.s.max_worker_restarts), resent=resent)


async def again(call: Callable[[], Any], seconds: float, what: str, *, restarts: bool,
                resent: list[int] | None = None) -> Any:
    """``bounded(call(), ...)``, sent again while the reward or reference worker that took it is being
    restarted by Ray (``restarts``: run.max_worker_restarts > 0): the call's inputs are the caller's,
    and a call in flight is never run twice by Ray (max_task_retries=0). A worker past its restarts
    is dead for good: that failure is raised. ``resent[0]`` counts the calls sent again."""
    deadline, pause = time.monotonic() + seconds, 0.1
    while True:
        try:
            return await bounded(call(), max(1.0, deadline - time.monotonic()), what)
        except ActorFailure as exc:
            if (exc.mesh not in ("reward", "reference") or not exc.restarting or not restarts
                    or time.monotonic() + pause > deadline):
                raise
            if resent is not None:
                resent[0] += 1
            logger.warning("%s; sending its call again in %.1fs", exc.cause.splitlines()[0][:200], pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 2.0)


class LoopHost:
    """The rollout loops a worker process runs, one set at a time (a worker a resumed run kept,
    run.warm_resume, ends the failed attempt's loops before it starts the new ones)."""

    def __init__(self) -> None:
        self.loops: RolloutLoops | None = None

    async def run(self, loops: RolloutLoops) -> None:
        if self.loops is not None:
            self.loops.cancel()
        self.loops = loops
        await loops.run()

    async def pause(self, timeout_s: float) -> int:
        return 0 if self.loops is None else await self.loops.pause(timeout_s)
