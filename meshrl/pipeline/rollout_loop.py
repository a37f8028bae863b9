"""The controller's rollout side: the roles it drives, the rollout workers' loops it starts and
supervises, and the evaluation requests it builds.

```text
per rollout worker, until the run stops:
  rollout.run_loops    the worker runs rollout.requests_in_flight rollout loops itself
                       (meshrl.actors.rollout_loops: sampler.take → generate → score → annotate →
                       sampler.put): one call that lasts as long as they do, none per request
                       ends when: the sampler closes (the run winds down); fails when: a loop fails,
                       or the worker dies
  a restarted worker   its requests go back to the sampler (sampler.release), taken again first by
  (revival)            any worker (same reservation, prompts, group ids: the same seeds); its loops
                       start again once it serves the current weights (meshrl.pipeline.revival)
stop():                rollout.pause_loops: no new requests; those being generated put their samples
```

The sampler (``meshrl.queues.sampler``: the queue and the prompt ledger in the queue role's
process) records every request until its samples are in, so a checkpoint knows what was in flight;
a request interrupted by ``Pipeline.stop`` stays recorded (its reservation outstanding in the queue
snapshot) and is re-issued on resume. What each request did (its spans, reward calls sent again)
comes with its put and reaches the controller with the step's metrics (``Sampler.report``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from meshrl.actors import RolloutJob
from meshrl.actors.requests import RequestMaker
from meshrl.actors.rollout_loops import LoopSettings
from meshrl.mesh import ActorMesh, bounded
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.revival import Revivals
from meshrl.tasks import Problem

__all__ = ["Roles", "RolloutDriver", "bounded"]

logger = logging.getLogger("meshrl.pipeline")


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
    """Starts and supervises the rollout workers' loops of one pipeline run, and plays evaluation
    requests on them (module docstring)."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, tokenizer: Any, source: Sequence[Problem], log: RunLog, *,
                 stopping: asyncio.Event, environment: bool, revivals: Revivals | None = None) -> None:
        self.cfg, self.roles, self.tokenizer, self.log = cfg, roles, tokenizer, log
        self.source = source
        """The training problems as written (what a checkpoint's fingerprint hashes)."""
        self.stopping = stopping
        """Set when the run winds down: no new request starts."""
        self.environment = environment
        self.maker = RequestMaker(cfg.rollout, cfg.run.seed, cfg.run.eval_max_new_tokens, tokenizer, environment=environment)
        """Sampling settings, seeds and tokenised prompts of evaluation requests (the workers make the
        training ones with the same settings)."""
        self.generated_tokens = 0
        """Policy tokens generated for training so far (the sampler's count, as last reported)."""
        self.reissued_calls = 0
        """Reward and reference calls sent again because their worker died (the workers' reports)."""
        self._turn = 0
        self.revivals = revivals or Revivals(cfg, len(roles.rollouts) if roles.rollouts is not None else 0)
        """The rollout workers serving the current weights, and those restarted (meshrl.pipeline.revival)."""
        self._clock = time.time() - log.now()
        """``time.time()`` at the log's zero: the workers' stamps onto the timeline's clock."""

    def settings(self, worker: int) -> LoopSettings:
        cfg = self.cfg
        return LoopSettings(worker=worker, prompts_per_request=cfg.rollout.prompts_per_request,
                            samples_per_prompt=cfg.algo.samples_per_prompt,
                            requests_in_flight=cfg.rollout.requests_in_flight, step_timeout_s=cfg.run.step_timeout_s,
                            reserve_timeout_s=cfg.queue.reserve_timeout_s, put_timeout_s=cfg.queue.put_timeout_s,
                            inline_bytes=cfg.reward.inline_bytes, max_worker_restarts=cfg.run.max_worker_restarts)

    async def loop(self, worker: ActorMesh, worker_index: int) -> None:
        """Worker ``worker_index``'s rollout loops, until the run winds down; restarted with the
        worker when it is restarted in place (module docstring)."""
        cfg, roles = self.cfg, self.roles
        while not self.stopping.is_set():
            # a restarted worker runs its loops once it serves the current weights
            await self.revivals.until_serving(worker_index, "a rollout worker's loops")
            loads = self.revivals.loads()[worker_index]
            try:
                # waits for: the sampler to close (the run winds down); unblocked by: the controller's close
                sampler = None if roles.queue is roles.rollouts else roles.queue  # None: the worker's own
                await worker.run_loops.call_one(sampler, roles.rewards, roles.reference, self.settings(worker_index),
                                                cfg.rollout, cfg.run.seed)
                return
            except Exception as exc:
                if self.stopping.is_set() or self.revivals.restartable(exc) != worker_index:
                    raise
                self.revivals.died(worker_index, before=loads)
                released = await bounded(roles.queue.release.call_one(worker_index), cfg.run.step_timeout_s,
                                         "the sampler to release a dead rollout worker's requests")
                self.revivals.reissued_requests += released
                logger.warning("rollout/%d died with %d request(s) in flight; they are generated again, and its loops "
                               "start again once it is back: %s", worker_index, released, str(exc).splitlines()[0][:200])

    def reported(self, report: dict[str, Any]) -> None:
        """The sampler's report (``Sampler.report``): the tokens generated, and what each request
        put since did (its spans onto the timeline, its reward calls sent again)."""
        self.generated_tokens = report["generated_tokens"]
        c = self._clock
        for note in report["reports"]:
            self.reissued_calls += note["reissued_calls"]
            for role, what, began, ended in note["spans"]:
                self.log.span(role, what, began - c, ended - c, worker=note["worker"])

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

    async def drain(self, timeout_s: float) -> int:
        """Pause every worker's loops (call with ``stopping`` set): no new requests, and those being
        generated put their samples; returns how many still were after ``timeout_s``."""
        workers = [self.roles.rollouts.slice(procs=i) for i in self.revivals.serving()]
        # waits for: the requests being generated to put their samples; unblocked by: the workers' loops
        left = await asyncio.gather(*(bounded(w.pause_loops.call_one(timeout_s), timeout_s + 30,
                                              "a rollout worker to pause its loops") for w in workers))
        return sum(left)
