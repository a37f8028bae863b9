"""The controller's rollout side: the roles it drives, the requests it builds, and the rollout loop.

```text
rollout loop (× workers × requests_in_flight), until the run stops:
  sampler.take(k)           a restored request, or k·n positions and the next k prompts
                            waits for: admission within max_staleness
                            unblocked by: train loop set_version after a push
  rollout.generate          single-turn: one request per prompt, n samples each
  or rollout.run_episodes   with an environment: n episodes per prompt (meshrl.envs.episode)
  reward.score              samples built and encoded on the reward worker
  (or rollout.play_scored   reward.num_workers=0: generated, scored and encoded in one call)
  reference.annotate        (only with a KL term)
  sampler.put_ref           waits for: room under queue.capacity_tokens
                            unblocked by: train loop get_batch_refs
```

The sampler (``meshrl.queues.sampler``: the queue and the prompt ledger in the queue role's
process) records every request until its samples are in, so a checkpoint knows what was in flight.
A rollout worker that dies and is restarted in place
(``meshrl.pipeline.revival``) has its requests re-issued once it serves the current weights: the
same reservation, prompts and group ids (so the same seeds); the other workers keep generating. A request interrupted by ``Pipeline.stop`` stays recorded
(its reservation stays outstanding in the queue snapshot) and is re-issued on resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from meshrl.actors import RolloutJob
from meshrl.actors.requests import RequestMaker
from meshrl.mesh import ActorFailure, ActorMesh
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.revival import Revivals
from meshrl.queues import InFlight
from meshrl.tasks import Problem

__all__ = ["Roles", "RolloutDriver", "bounded"]

logger = logging.getLogger("meshrl.pipeline")


async def bounded(future, seconds: float, what: str):
    """Await a mesh call at most ``seconds``; the error says what was waited for."""
    try:
        return await future.within(seconds)
    except TimeoutError:
        raise TimeoutError(f"gave up after {seconds:.0f}s waiting for {what}") from None


@dataclass
class Roles:
    """The meshes of a running pipeline."""

    queue: ActorMesh
    rollouts: ActorMesh
    """The engines that take generation calls (with tensor parallelism: each replica's rank 0)."""
    rewards: ActorMesh | None
    """None (reward.num_workers=0): the rollout workers score their own generations."""
    trainer: ActorMesh
    reference: ActorMesh | None
    engines: ActorMesh | None = None
    """Every engine rank, for weight pushes; None: ``rollouts``."""

    def __post_init__(self) -> None:
        if self.engines is None:
            self.engines = self.rollouts


class RolloutDriver:
    """Builds requests and runs the rollout loops of one pipeline run (module docstring)."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, tokenizer: Any, source: Sequence[Problem], log: RunLog, *,
                 stopping: asyncio.Event, environment: bool, revivals: Revivals | None = None) -> None:
        self.cfg, self.roles, self.tokenizer, self.log = cfg, roles, tokenizer, log
        self.source = source
        """The training problems as written (what a checkpoint's fingerprint hashes)."""
        self.stopping = stopping
        """Set when the run winds down: no new request starts."""
        self.environment = environment
        self.maker = RequestMaker(cfg.rollout, cfg.run.seed, cfg.run.eval_max_new_tokens, tokenizer, environment=environment)
        """Sampling settings, seeds and tokenised prompts of the requests (shared with ``run.loops=roles``)."""
        self.active = 0
        """Requests taken from the sampler and not yet put or given back."""
        self.generated_tokens = 0
        """Policy tokens generated for training so far."""
        self.reissued_calls = 0
        """Reward and reference calls sent again because their worker died (``_again``)."""
        self._turn = 0
        self.revivals = revivals or Revivals(cfg, len(roles.rollouts) if roles.rollouts is not None else 0)
        """The rollout workers serving the current weights, and those restarted (meshrl.pipeline.revival)."""

    def start_play(self, worker: ActorMesh, problems: list[Problem], *, greedy: bool, n: int,
                   group_ids: list[int] | None) -> tuple[Any, RolloutJob, str]:
        """Start generating (or playing episodes) on ``worker`` (a one-actor mesh, or a mesh to
        ``choose`` from) without waiting: the call's future, the job its generations belong to, and
        the job's field (and ``RewardWorker.score``'s keyword) they go to."""
        call = worker.run_episodes if self.environment else worker.generate
        adverb = call.call_one if len(worker) == 1 else call.choose
        job, requests = self.maker.job(problems, greedy=greedy, n=n, group_ids=group_ids)
        return adverb(requests), job, "episodes" if self.environment else "results"

    def start_play_scored(self, worker: ActorMesh, problems: list[Problem], *, greedy: bool, n: int,
                          group_ids: list[int] | None, by_ref: bool | int = False) -> Any:
        """``start_play`` with reward.num_workers=0: ``worker`` generates and scores them in one call
        (``RolloutWorker.play_scored``, within run.step_timeout_s of generating); the call's future."""
        job, requests = self.maker.job(problems, greedy=greedy, n=n, group_ids=group_ids)
        call = worker.play_scored.call_one if len(worker) == 1 else worker.play_scored.choose
        return call(job, requests, within_s=self.cfg.run.step_timeout_s, by_ref=by_ref)

    async def play(self, problems: list[Problem], *, greedy: bool, n: int, group_ids: list[int] | None,
                   what: str, scored: bool = False) -> Any:
        """Generate (or play episodes) on a serving rollout worker and wait for them here (held-out
        evaluation): the ``RolloutJob``, or with ``scored`` (reward.num_workers=0) the worker's
        ``Scored`` of it; sent again to another while the one that took it is restarted."""
        timeout = self.cfg.run.step_timeout_s
        while True:
            worker = await self.serving_rollouts(what)
            loads = self.revivals.loads()
            if scored:
                calling = self.start_play_scored(worker, problems, greedy=greedy, n=n, group_ids=group_ids)
                kind, limit = "scored", 2 * timeout
            else:
                calling, job, kind = self.start_play(worker, problems, greedy=greedy, n=n, group_ids=group_ids)
                limit = timeout
            try:
                out = await bounded(calling, limit, what)
                break
            except Exception as exc:
                if (rank := self.revivals.restartable(exc)) is None:
                    raise
                self.revivals.died(rank, before=loads[rank])
        if kind == "scored":
            return out
        if kind == "episodes":
            job.episodes, job.prompt_ids = out, [g[0].prompt_ids for g in out]
        else:
            job.results = out
        return job

    async def serving_rollouts(self, what: str) -> ActorMesh:
        """The rollout workers to send a call to: all of them, or while one is being restarted, one
        that serves the current weights."""
        if not self.revivals.down:
            return self.roles.rollouts
        ranks = await self.revivals.any_serving(what)
        self._turn += 1
        return self.roles.rollouts.slice(procs=ranks[self._turn % len(ranks)])

    async def next_job(self) -> tuple[InFlight, list[Problem]] | None:
        """A restored request to generate again, or a new reservation with the next prompts (the
        sampler's ``take``); None once the run is stopping."""
        r, sampler = self.cfg.rollout, self.roles.queue
        # waits for: admission within max_staleness; unblocked by: train loop set_version
        job, problems = await bounded(sampler.take.call_one(r.prompts_per_request, timeout=self.cfg.queue.reserve_timeout_s),
                                      self.cfg.queue.reserve_timeout_s + 30, "the sampler to admit a rollout request")
        if self.stopping.is_set():  # granted while the run winds down: it stays recorded (re-issued on resume)
            return None
        return job, problems

    async def loop(self, worker: ActorMesh, worker_index: int) -> None:
        """One rollout loop on one worker, until the run stops (module docstring)."""
        queue = self.roles.queue
        while not self.stopping.is_set():
            if (taken := await self.next_job()) is None:
                return
            job, problems = taken
            self.active += 1
            try:
                while True:
                    # a restarted worker takes requests once it serves the current weights
                    await self.revivals.until_serving(worker_index, "a rollout loop's next request")
                    loads = self.revivals.loads()[worker_index]
                    try:
                        await self._request(worker, worker_index, job, problems)
                        break
                    except Exception as exc:
                        if self.stopping.is_set() or self.revivals.restartable(exc) != worker_index:
                            raise
                        self.revivals.died(worker_index, before=loads)
                        self.revivals.reissued_requests += 1
                        logger.warning("rollout/%d died with a request in flight (groups %d-%d); re-issuing it once the "
                                       "worker is back: %s", worker_index, job.first_group, job.first_group + job.count - 1,
                                       str(exc).splitlines()[0][:200])
            except BaseException:
                if not self.stopping.is_set():
                    await asyncio.shield(queue.cancel.call_one(job.reservation_id).within(60))
                # stopping: the request stays in the sampler's ledger, so the checkpoint re-issues it on resume
                raise
            finally:
                self.active -= 1

    async def _request(self, worker: ActorMesh, worker_index: int, job: InFlight, problems: list[Problem]) -> None:
        """One request on ``worker``: generated, scored (and annotated), put into the queue."""
        n, timeout, queue = self.cfg.algo.samples_per_prompt, self.cfg.run.step_timeout_s, self.roles.queue
        group_ids = list(range(job.first_group, job.first_group + job.count))
        t0, wall0 = self.log.now(), time.time()
        # data plane: the generations go from the rollout worker to the reward worker by ref,
        # the samples stay in the reward (or reference) worker's object store, and each
        # trainer rank fetches them itself: this process moves ids, metas and refs only. The
        # reward worker answers within `timeout` of getting them, marking what a slow reward
        # has not scored by then.
        inline = max(1, self.cfg.reward.inline_bytes)  # by reference from this size on (reward.inline_bytes)
        if self.roles.rewards is None:  # reward.num_workers=0: one call, generated and scored in the worker
            scored = await bounded(self.start_play_scored(worker, problems, greedy=False, n=n, group_ids=group_ids,
                                                          by_ref=inline),
                                   2 * timeout, f"rollout worker {worker_index} to generate and score")
        else:
            generating, job_in, kind = self.start_play(worker, problems, greedy=False, n=n, group_ids=group_ids)
            scored = await self.again(
                lambda: self.roles.rewards.score.choose(job_in, within_s=timeout, by_ref=inline, **{kind: generating.ref()}),
                2 * timeout, f"rollout worker {worker_index} to generate and a reward worker to score", generating)
        t1 = t0 + max(0.0, scored.received - wall0)  # when the generations reached the reward worker
        self.log.span("rollout", "generate", t0, t1, worker=worker_index)
        samples = scored.ref or scored.encoded  # refs, or a small request's bytes
        if self.roles.reference is not None:
            samples = await self.again(lambda: self.roles.reference.annotate.choose(scored.ref or scored.encoded),
                                       timeout, "the reference worker")
        self.log.span("reward", "score", t1, self.log.now(), worker=worker_index)
        # waits for: room under capacity_tokens; unblocked by: train loop get_batch_refs
        put = (queue.put_ref.call_one(samples, scored.metas, job.reservation_id) if scored.ref
               else queue.put_encoded.call_one(samples, job.reservation_id))
        await bounded(put, self.cfg.queue.put_timeout_s + 30, "the queue to accept samples")
        self.generated_tokens += scored.completion_tokens

    async def again(self, call, seconds: float, what: str, inputs: Any = None) -> Any:
        """``bounded(call(), ...)``, sent again while the reward or reference worker that took it
        is being restarted by Ray (run.max_worker_restarts): its inputs are refs that outlive it,
        and a call in flight is never run twice by Ray (max_task_retries=0). A worker past its
        restarts is dead for good: that failure is raised. ``inputs``: the future the call's inputs
        come from; when that one failed (a dead rollout worker) its failure is raised."""
        deadline, pause = time.monotonic() + seconds, 0.1
        while True:
            try:
                return await bounded(call(), max(1.0, deadline - time.monotonic()), what)
            except ActorFailure as exc:
                if inputs is not None:
                    await bounded(inputs, seconds, what)  # raises the rollout worker's own failure, if it is one
                if (exc.mesh not in ("reward", "reference") or not exc.restarting or not self.cfg.run.max_worker_restarts
                        or time.monotonic() + pause > deadline):
                    raise
                self.reissued_calls += 1
                logger.warning("%s; sending its call again in %.1fs", exc.cause.splitlines()[0][:200], pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 2.0)

    async def drain(self, timeout_s: float) -> int:
        """Wait until every request in flight has put its samples (call with ``stopping`` set);
        returns how many were still in flight after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        # waits for: the in-flight requests' puts; unblocked by: rollout loops (or the deadline)
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.active
