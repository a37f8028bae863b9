"""The single controller: builds the role meshes and the sampler, starts the roles' loops, hands
the trainer its chunks of steps and does what comes between them. One step's data flow:

```text
 rollout workers, each running its loops (× requests_in_flight)                 no call from here
  (rollout.run_loops)   sampler.take(k)      waits for: admission within max_staleness
                                             unblocked by: trainer rank 0's set_version after a push
                        generate             (engine: continuous batching, per-token versions)
                        or run_episodes      (environment episodes, loss mask 0 on its text)
                        score                here (reward.num_workers=0) or on a reward worker
                        reference.annotate   (only with a KL term)
                        sampler.put_ref ───► Sampler (queue + prompt ledger, one snapshot)
                                             waits for: room under queue.capacity_tokens
 trainer, every dp rank, a chunk of steps per call (trainer.run_steps; meshrl.actors.train_loop)
                        sampler.step_batch   waits for: samples_per_step samples (whole groups) within
                                             max_staleness of the step's version; each rank fetches
                                             only its share's blobs, by their refs, from their producers
                        train step           (FSDP2 over the dp ranks)
                        every sync_interval steps: version += 1, the weights to every engine over the
                        transport chosen at start (distributed, object store, SGLang's, in place) →
                        sampler.set_version by rank 0 once every engine serves it
 controller, per chunk  the chunk's step records (sampler.report: queue metrics, what the requests
                        did) into metrics.jsonl and the timeline; every checkpoint_every steps and at
                        the end: checkpoint (trainer state, the sampler's state) before the version
                        is published, so at max_staleness = 0 nothing is in flight; every
                        eval_every: held-out prompts, greedy, on the engines, beside the next chunk
 stop():      sampler.hold_batches: the trainer's next batch is STOP (a batch it took is trained) →
              rollout.pause_loops: no new requests, wait for: the requests being generated to put
              their samples (at most run.stop_drain_timeout_s) → checkpoint (the sampler's state
              holds every sample not trained, and the requests still in flight) → HF export → roles
              stopped
 resume:      trainer.load_checkpoint → push its weights as the saved version → sampler.restore
              (the requests that were in flight are taken again first)
```

The rollout side lives in ``rollout_loop`` (the workers' loops: ``meshrl.actors.rollout_loops``),
the train side in ``training`` (the trainer's own loop: ``meshrl.actors.train_loop``), evaluation in
``evaluation``.
With ``max_staleness = 0`` the loops alternate strictly (synchronous, on-policy); with η > 0
rollout runs up to η versions ahead while the trainer trains. Every wait has a timeout; a failure
in any loop closes the sampler, which wakes every waiter, and the run stops with that error
— unless it is a role's death: a reward, reference or rollout worker is restarted in place
(``recovery``, ``revival``), and with ``run.auto_resume`` any other death resumes the run from its
newest checkpoint, in the processes that are still alive (``processes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import msgspec

from meshrl.actors import ReferenceWorker, RewardWorker, RolloutWorker, Trainer
from meshrl.actors.hybrid import HybridWorker
from meshrl.config import ConfigError, to_yaml
from meshrl.embedded import warm_start
from meshrl.envs import EnvFactory
from meshrl.envs.rewards import FunctionReward, as_reward
from meshrl.mesh import ActorFailure, ActorMesh
from meshrl.pipeline import checkpoint as ckpt
from meshrl.pipeline import evaluation
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import Roles, RolloutDriver, bounded
from meshrl.pipeline import output_dir
from meshrl.pipeline.startup import (check_prompts, check_ray_address, ensure_ray, reclaim_sigterm, settle_devices,
                                     start_sglang_servers)
from meshrl.pipeline.recovery import Recovery
from meshrl.pipeline.revival import Revivals, restarts_rollout_in_place
from meshrl.pipeline.storage import check_run_storage
from meshrl.pipeline.training import TrainLoop
from meshrl.pipeline.processes import RoleProcesses
from meshrl.queues import QueueClosed
from meshrl.queues.actor import SamplerActor
from meshrl.reshard import meshes as reshard_meshes
from meshrl.tasks import NamedFunction, Task, build_task, load_reward_function, source_split

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

async def _enumerate(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


def _check_task(task: Any, *, reward: Any, environment: Any) -> None:
    """A ``Pipeline(task=...)`` without what the run calls is refused at construction (a worker would
    fail after it started): ``split(name)``, and ``reward(problem, text)`` unless ``reward=`` or an
    environment scores instead."""
    if task is None:
        return
    needs = ["split"] + (["reward"] if reward is None and environment is None else [])
    missing = [name for name in needs if not callable(getattr(task, name, None))]
    if missing:
        raise TypeError(f"task must have {' and '.join(f'{n}()' for n in needs)} (meshrl.Task: split(name) -> "
                        f"problems, reward(problem, completion) -> float); {type(task).__name__} lacks "
                        f"{' and '.join(missing)}")


def _with_reward_workers(cfg: PipelineConfig, task: Any, reward: Any, environment: Any) -> PipelineConfig:
    """``reward.num_workers=null`` settled: 0 when the reward that scores says it is quick and cannot
    hang (a task's ``quick_reward``, ``FunctionReward(inline=True)``), else 1 (``RewardConfig``)."""
    if cfg.reward.num_workers is not None:
        return cfg
    scorer = reward if reward is not None else None if environment is not None else task
    quick = (scorer.inline if isinstance(scorer, FunctionReward)
             else scorer is task and bool(getattr(task, "quick_reward", False)))
    workers = 0 if quick else 1
    return msgspec.structs.replace(cfg, reward=msgspec.structs.replace(cfg.reward, num_workers=workers))


class Pipeline:
    """An asynchronous RL run: ``summary = await Pipeline(cfg).run()`` (docs/embedding.md).

    ``task`` overrides ``cfg.task`` (any object with ``split(name)`` and ``reward(problem, text)``);
    ``reward`` replaces the task's reward (a function, sync or async, per sample or batched, or a
    ``meshrl.envs`` reward: ``HTTPReward``, ``MeshReward``, ``RewardModel``); ``environment`` makes
    each rollout a multi-turn episode (a factory ``problem -> Environment``, e.g.
    ``ToolEnv.factory({...})``), rewarded by its step rewards plus, when given, ``reward`` of its
    last policy turn (the task's reward is then not used).
    """

    def __init__(self, config: PipelineConfig, *, task: Task | None = None, reward: Any = None,
                 environment: EnvFactory | None = None) -> None:
        self.cfg = config.validate()
        _check_task(task, reward=reward, environment=environment)
        self.task = task if task is not None else build_task(config.task, config.model.path)
        if config.task.reward_function is not None:
            if reward is not None:
                raise ConfigError("`task.reward_function`: Pipeline(reward=...) gives a reward too: use one of them")
            load_reward_function(config.task.reward_function)  # its errors now, naming the key
            reward = NamedFunction(config.task.reward_function)  # each reward worker imports it
        if environment is not None and not callable(environment):
            raise TypeError(f"environment must be a factory problem -> Environment (e.g. a class), got {environment!r:.80}")
        if reward is not None:
            as_reward(reward, timeout_s=config.reward.timeout_s)  # a wrong kind now, not in a worker
        self.reward, self.environment = reward, environment
        self.cfg = _with_reward_workers(self.cfg, self.task, reward, environment)
        self.out_dir = Path(config.run.output_dir).resolve()  # actors may run in another directory
        output_dir.check_fresh(self.out_dir, config.run.resume, config.run.overwrite)  # again under run()'s lock
        check_ray_address(config.run.ray_address)  # before the warm start: a dead address fails in seconds
        self._stopping = asyncio.Event()  # set when the run winds down (the end, a failure, or stop())
        self._stop_requested = asyncio.Event()
        self._started, self._finished = asyncio.Event(), asyncio.Event()
        self._log_ready, self._roles_ready = asyncio.Event(), asyncio.Event()
        self._failure: BaseException | None = None
        self._warm_stop = threading.Event()  # stop() during the warm start ends it at its next step
        self._lock = output_dir.OutputLock(self.out_dir)
        self._processes = RoleProcesses(self.out_dir, self.cfg)
        """Each attempt's role meshes, and those a failed one leaves for the resumed one (run.warm_resume)."""
        self.log: RunLog | None = None
        self._rollout: RolloutDriver | None = None
        self._train: TrainLoop | None = None
        self._summary: dict[str, Any] | None = None
        self._closed = False  # the run closed its log and stops its roles
        self.recovery = Recovery(self._echo)
        """Resumes, in-place restarts and the heartbeat (meshrl.pipeline.recovery)."""
        self.recovery.step = lambda: self.step

    @property
    def policy_version(self) -> int:
        """The newest policy version pushed to the engines (0 before the first push). At
        queue.max_staleness >= 1 the trainer goes on once it has sent, so the engines may still be
        switching to it (within the staleness bound); each completion's ``versions`` say which
        weights produced it, and ``evaluate()`` waits for the switch."""
        return self._train.version if self._train is not None else 0

    @property
    def step(self) -> int:
        """Train steps done."""
        return self._train.step if self._train is not None else 0

    # -- set-up -------------------------------------------------------------------------------

    async def _model_dir(self) -> str:
        if self.cfg.model.path is not None:
            return str(Path(self.cfg.model.path).resolve())  # actors may run in another directory
        try:
            return str(await asyncio.to_thread(warm_start, self.cfg.model.embedded, self.task, self.cfg.warmstart,
                                               log=self._echo, stop=self._warm_stop))
        except asyncio.CancelledError:  # a second Ctrl-C: the thread ends at its next step, not after the whole warm start
            self._warm_stop.set()
            raise

    def _spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Start role ``name`` (``RoleProcesses.spawn``; a reward served by a mesh of its own starts through this)."""
        return self._processes.spawn(self.cfg, name, cls, *args, **kwargs)

    async def _start_roles(self, model_dir: str) -> Roles:
        cfg, env = self.cfg, self.environment
        await self._processes.probe(self._echo)  # run.warm_resume: what the failed attempt left, if it answers
        restarts = ({"max_restarts": cfg.run.max_worker_restarts,
                     "on_restart": functools.partial(self.recovery.restarted, cfg)} if cfg.run.max_worker_restarts else {})
        # the sampler: the queue and the prompt ledger (meshrl.queues.sampler), in the one rollout
        # worker's process or an actor of its own
        sampler = dict(config=cfg.queue, problems=list(self.task.split("train")), seed=cfg.run.seed,
                       samples_per_prompt=cfg.algo.samples_per_prompt, samples_per_step=cfg.trainer.samples_per_step,
                       steps_per_version=cfg.trainer.sync_interval, audit=cfg.run.audit)
        queue = None if cfg.sampler_in_rollout else self._spawn("queue", SamplerActor, **sampler)
        max_new_tokens = cfg.rollout.episode.max_tokens if env else cfg.rollout.max_new_tokens
        sglang = cfg.rollout.engine.backend == "sglang"
        share = 0.5 if cfg.placement == "colocated" and sglang else 1  # colocated SGLang: half a GPU each, for Ray
        if callable(getattr(self.reward, "start", None)):  # a reward served by a mesh of its own
            await self.reward.start(self._spawn)
        # without an environment the task's reward is the default; an environment's rewards stand alone
        reward = self.reward if self.reward is not None else None if env else self.task
        scorer = {} if cfg.reward.num_workers else {"scorer": (reward, cfg.reward.timeout_s)}  # rollouts score
        if cfg.placement == "colocated" and not sglang:
            # one process per trainer rank holds the trainer and an engine replica (meshrl.actors.hybrid);
            # "procs" is the dim the rollout loops slice, and the trainer's dp axis
            rollouts = trainer = self._spawn(
                "hybrid", HybridWorker, model_dir, cfg.trainer, cfg.algo, cfg.rollout.engine, cfg.colocated,
                rollout_threads=cfg.rollout.threads, temperature=cfg.rollout.temperature, max_new_tokens=max_new_tokens,
                total_steps=cfg.run.total_steps, dims={"procs": cfg.trainer.dp}, gpus_per_proc=int(cfg.trainer.device == "cuda"),
                **({"environment": env, "episode": cfg.rollout.episode} if env else {}), **scorer,
            )
        else:
            engine_gpus = int(cfg.rollout.engine.device.startswith("cuda")) * share  # one GPU per engine rank
            tp = cfg.rollout.tp_size
            # an SGLang server does its own TP: one worker per replica, holding all tp_size of its GPUs
            dims = {"procs": cfg.rollout.num_workers, **({"tp": tp} if tp > 1 and not sglang else {})}
            rollouts = self._spawn("rollout", RolloutWorker, model_dir, cfg.rollout.engine, cfg.rollout.threads,
                                   dims=dims, gpus_per_proc=engine_gpus * (tp if sglang else 1), tp_size=tp,
                                   tp_timeout_s=cfg.run.step_timeout_s,
                                   **({"environment": env, "episode": cfg.rollout.episode} if env else {}),
                                   **(restarts if restarts_rollout_in_place(cfg) else {}), **scorer,
                                   **({"sampler": sampler} if queue is None else {}))
            queue = queue or rollouts
        rewards = (self._spawn("reward", RewardWorker, reward, model_dir, cfg.reward.timeout_s, procs=cfg.reward.num_workers,
                               **restarts) if cfg.reward.num_workers else None)
        if cfg.placement != "colocated" or sglang:
            trainer = self._spawn(
                "trainer", Trainer, model_dir, cfg.trainer, cfg.algo, temperature=cfg.rollout.temperature,
                max_new_tokens=max_new_tokens, total_steps=cfg.run.total_steps, dims={"dp": cfg.trainer.dp},
                gpus_per_proc=int(cfg.trainer.device == "cuda") * share,
            )
        reference = None
        if cfg.algo.kl_coef > 0 and not cfg.trainer.reference_in_trainer:
            reference = self._spawn("reference", ReferenceWorker, model_dir, temperature=cfg.rollout.temperature,
                                    tokens_per_microbatch=cfg.trainer.tokens_per_microbatch, **restarts)
        meshes = [m for m in (queue if queue is not rollouts else None, rollouts, rewards,
                              trainer if trainer is not rollouts else None, reference) if m is not None]
        await asyncio.gather(*(m.ready().within(self.cfg.run.step_timeout_s) for m in meshes))
        engines = rollouts  # every engine rank: weight pushes reach them all
        if "tp" in rollouts.sizes:  # generation goes to each replica's rank 0; the others follow its schedule
            started = await rollouts.start_tp.call().within(self.cfg.run.step_timeout_s)
            places = [tuple(p) for p in started.values()]
            want = [(j, cfg.rollout.tp_size) for _ in range(cfg.rollout.num_workers) for j in range(cfg.rollout.tp_size)]
            if places != want:
                raise RuntimeError(f"the engine ranks report (tp rank, tp size) {places}, expected {want}")
            self._echo(f"engines: {cfg.rollout.num_workers} replica(s) x {cfg.rollout.tp_size} tensor-parallel ranks, "
                       "as the engines report")
            rollouts = rollouts.slice(tp=0)
        if sglang:  # each rollout worker runs (or attaches to) a server
            await start_sglang_servers(cfg, rollouts, trainer, model_dir, self.out_dir, self._echo,
                                       kept="rollout" in self._processes.taken)
        elif cfg.reshard.transport == "distributed" and cfg.placement != "colocated":  # colocated: in-place hand-over
            # once: a process group over every trainer and engine rank, and the cached transfer plan
            await reshard_meshes.connect(trainer, engines, cfg.reshard)
        return Roles(queue, rollouts, rewards, trainer, reference, engines=engines)

    def _echo(self, line: str) -> None:
        if self.log is not None:
            self.log.echo(line)
        else:
            print(line, flush=True)

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Warm start (embedded default), train ``run.total_steps`` steps (or until ``stop()``),
        export, plot; return a summary. A Pipeline runs once."""
        if self._started.is_set():
            raise RuntimeError("Pipeline.run() was already called: a Pipeline runs once (build a new one to resume)")
        self._started.set()
        try:
            self._claim_output_dir()
            while True:
                try:
                    self._summary = await self._run()
                    return self._summary
                except Exception as exc:
                    # a process died (or took queued samples with it), maybe mid-push
                    if not self.recovery.resumes(self.cfg, exc, stop_requested=self._stop_requested.is_set()):
                        raise
                    self._prepare_resume(exc)
        finally:
            await self._processes.stop_parked()  # left by a failure that was not resumed
            self._lock.release()
            self._finished.set()

    def _claim_output_dir(self) -> None:
        """Take run.output_dir for this run (its lock), refusing another run's files in it
        (meshrl.pipeline.output_dir); run.overwrite deletes them now."""
        self._lock.acquire()
        run = self.cfg.run
        earlier = output_dir.check_fresh(self.out_dir, run.resume, run.overwrite)
        if run.overwrite:
            output_dir.overwrite(self.out_dir, earlier, self._echo)

    def _prepare_resume(self, exc: BaseException) -> None:
        """Reset the per-attempt state so that ``_run`` resumes from the newest checkpoint."""
        self.recovery.failed(self.cfg, exc, self.step)
        self.cfg = msgspec.structs.replace(self.cfg, run=msgspec.structs.replace(self.cfg.run, resume="latest"))
        self._stopping.clear()
        self._log_ready.clear()
        self._roles_ready.clear()
        self._failure, self._closed = None, False
        self._rollout = self._train = None
        self._processes.new_attempt()

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.perf_counter()
        from transformers import AutoTokenizer

        # checked whole before anything of it is read, and before this run writes into its directory
        resume_from = await asyncio.to_thread(ckpt.resolve_resume, cfg.run.resume, self.out_dir, self._echo)
        resumed_step = 0
        if resume_from is not None:  # before the warm start and the roles, as the prompt check below
            state = ckpt.read_run_state(resume_from)
            ckpt.check_fingerprint(resume_from, state, cfg, source_split(self.task, "train"))
            resumed_step = state.step
        else:
            await self._processes.stop_parked()  # no checkpoint: a fresh start, in fresh processes
        await asyncio.to_thread(check_prompts, cfg, self.task, reward=self.reward, environment=self.environment,
                                echo=self._echo)
        model_dir = await self._model_dir()

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if cfg.run.resume == "latest" and resume_from is None:
            self._echo(f"run.resume=latest: no complete checkpoint under {self.out_dir / 'checkpoints'} yet, starting fresh")
        later = ckpt.later_checkpoints(self.out_dir, resumed_step)
        if later:
            self._echo(f"{len(later)} checkpoint(s) of later steps under {self.out_dir / 'checkpoints'} (up to "
                       f"{later[-1].name}) belong to an earlier run: kept until this run writes those steps again; "
                       "run.resume=latest follows this run")
        reference = cfg.algo.kl_coef > 0 and not cfg.trainer.reference_in_trainer
        tp = f" (x{cfg.rollout.tp_size} tensor-parallel ranks each)" if cfg.rollout.tp_size > 1 else ""
        rollout = "1 rollout (holding the sampler)" if cfg.sampler_in_rollout else f"sampler, {cfg.rollout.num_workers} rollout"
        self._echo(f"starting roles: {rollout}{tp}, {cfg.reward.num_workers or 'no'} reward, trainer (dp={cfg.trainer.dp})"
                   + (", reference" if reference else ""))
        # the run's first file, once it will run: a refused resume leaves the folder describing the run its
        # checkpoints are of, and a run stopped in its warm start leaves nothing a fresh one would refuse
        (self.out_dir / "config.yaml").write_text(to_yaml(cfg))
        self.log = log = RunLog(self.out_dir, cfg.run.total_steps, progress=cfg.run.progress,
                                tensorboard=cfg.run.tensorboard, resumed_step=resumed_step)
        for rec in ckpt.read_records(resume_from) if resume_from is not None else []:
            log.replay(rec)  # the log continues the checkpointed run's
        self._log_ready.set()
        self.recovery.log = log
        stopped = False
        try:
            # seconds: not on the caller's event loop
            self._echo(await asyncio.to_thread(ensure_ray, cfg.run.num_cpus, cfg.run.ray_address))
            reclaim_sigterm()  # a clean stop on SIGTERM, not Ray's abort 3 s into it
            self.cfg = cfg = settle_devices(cfg, self._echo)
            roles = await self._start_roles(model_dir)
            self._echo(await asyncio.to_thread(self._processes.placement_line))
            launched = cfg.rollout.engine.backend == "sglang" and not cfg.rollout.engine.sglang.urls  # logs in output_dir
            await check_run_storage(roles, self.out_dir, model_dir, launched, cfg.run.step_timeout_s, self._echo)
            revivals = Revivals(cfg, len(roles.rollouts), record=self.recovery.revived)
            self._rollout = rollout = RolloutDriver(cfg, roles, tokenizer, source_split(self.task, "train"), log,
                                                    stopping=self._stopping, environment=self.environment is not None,
                                                    revivals=revivals)
            self.recovery.revivals = revivals
            self._train = train = TrainLoop(cfg, roles, rollout, log, self.out_dir, evaluate=self._periodic_evaluation)
            train.restarts = len(self.recovery.restarts)
            await train.connect()
            self._roles_ready.set()
            if resume_from is not None:
                self._echo(await train.restore(resume_from, engines_kept=self._processes.engines_kept))
            else:
                before = await self._evaluate()
                train.accuracy_before = before["accuracy"]
                self._echo(f"held-out accuracy before RL: {before['accuracy']:.1%} ({before['problems']} problems)")
            self.recovery.recovered(log, train.step, kept=self._processes.taken)
            loops = [  # each worker runs its loops
                asyncio.create_task(self._guard(rollout.loop(roles.rollouts.slice(procs=i), i)))
                for i in range(cfg.rollout.num_workers)
            ]
            training = asyncio.create_task(self._guard(train.run(), always_fails=True))
            heartbeat = asyncio.create_task(self._guard(self.recovery.watch(cfg, roles, log), what="the heartbeat"))
            reviver = asyncio.create_task(self._guard(train.revive(), always_fails=True,
                                                      what="the restart of a rollout worker in place"))
            stop = asyncio.create_task(self._stop_requested.wait())
            try:
                # waits for: the last train step, a failure, or stop(); unblocked by: the train loop, stop()
                await asyncio.wait([training, stop], return_when=asyncio.FIRST_COMPLETED)
                stopped = self._stop_requested.is_set() and train.step < cfg.run.total_steps
                if stopped:
                    # the trainer takes no batch from here (one it took is trained): what the drain puts stays queued
                    await bounded(roles.queue.hold_batches.call_one(stopping=True), cfg.run.step_timeout_s,
                                  "the sampler to hold the trainer's batches")
                    left = await rollout.drain(cfg.run.stop_drain_timeout_s)
                    if left:
                        self._echo(f"stop: {left} requests still in flight after {cfg.run.stop_drain_timeout_s:g}s; "
                                   "the checkpoint records them and a resumed run generates them again")
            finally:
                stop.cancel()
                heartbeat.cancel()
                reviver.cancel()
                self._stopping.set()
                with contextlib.suppress(Exception):  # the trainer's next batch is STOP: its last chunk ends
                    await roles.queue.hold_batches.call_one(stopping=True).within(60)
                # waits for: the trainer's last chunk (a batch it took is trained); unblocked by: the hold
                await asyncio.wait([training])
                with contextlib.suppress(Exception):  # a dead queue: its waiters fail by themselves, and
                    # the loops below must still be cancelled and awaited, not left to fail the next attempt
                    await roles.queue.close.call_one().within(60)  # wakes every reserve/put
                await training
                if stopped or self._failure is not None:
                    # stopped: a request still generating stays in the ledger (re-issued on resume);
                    # failed: a loop may be blocked in a role that will not answer (the run ends anyway)
                    for t in loops:
                        t.cancel()
                await asyncio.gather(*loops, heartbeat, reviver, return_exceptions=True)
                if self._failure is not None:
                    for t in train.evals:
                        t.cancel()
                # waits for: the periodic evaluations still running (each bounded by run.step_timeout_s;
                # guarded: a failure becomes self._failure); unblocked by: their engines and reward workers
                await asyncio.gather(*train.evals, return_exceptions=True)
            if self._failure is not None:
                raise self._failure
            if stopped:
                await train.checkpoint()  # after the drain: the snapshot holds every sample put and not trained
                after = None
            else:
                after = (await self._evaluate())["accuracy"]
            audit = await train.audit.verdict(train.step, self._echo) if cfg.run.audit else None
            # every dp rank takes part (the full weights are gathered); rank 0 writes
            final_dir = (await roles.trainer.save_hf.call(str(self.out_dir / "final")).within(cfg.run.step_timeout_s)).values()[0]
            await self.recovery.reported(cfg)  # a restart that happened is in the log before it closes
        finally:
            failure = sys.exc_info()[1]  # the attempt's end: a failure parks the roles a resume may use again
            self._closed = True  # a user's call still running fails from here as "shut down" (_user_call)
            self.recovery.log = self.recovery.revivals = None
            log.close()
            await self._processes.end(self.cfg, failure)  # the rollout workers stop their servers first
        from meshrl.pipeline.plots import plot_run
        from meshrl.pipeline.timeline import run_summary

        plot = await asyncio.to_thread(plot_run, self.out_dir)  # ~1 s: not on the caller's event loop
        summary = {
            "accuracy_before": train.accuracy_before, "accuracy_after": after, "steps": train.step,
            "version": train.version, "seconds": time.perf_counter() - started, "checkpoint": final_dir,
            "plot": str(plot), "timeline": str(self.out_dir / "timeline.png"), "metrics": str(self.out_dir / "metrics.jsonl"),
            "stopped": stopped, "steady_state": run_summary(self.out_dir),  # idle per role, phase times (meshrl.pipeline.timeline)
            "last_checkpoint": str(ckpt.latest_checkpoint(self.out_dir)),
            "restarts": self.recovery.restarts, **({"audit": audit} if audit is not None else {}),
        }
        with (self.out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "summary", **summary}) + "\n")
        return summary

    async def _guard(self, coro, *, always_fails: bool = False, what: str | None = None) -> None:
        """Run a loop (or a periodic evaluation); on an unexpected error remember it and close the
        queue to wake the rest. ``what``: named in a note on the error.

        Once the run winds down (stop(), or another loop failed) a rollout loop's error is only
        logged: its request stays in the ledger and a resumed run issues it again. The train loop's
        and an evaluation's (``always_fails``) are the run's failure even then: a step that broke
        halfway must not be followed by a checkpoint of a trainer that is ahead of the run's state."""
        try:
            await coro
        except (asyncio.CancelledError, QueueClosed):
            if self._failure is not None and not self._stopping.is_set():
                raise
        except BaseException as exc:
            if what is not None and isinstance(exc, Exception):
                exc.add_note(f"raised by {what}")
            if self._stopping.is_set() and not always_fails:
                logger.warning("a rollout loop failed while the run was stopping (its request is re-issued on "
                               "resume): %s: %s", type(exc).__name__, exc)
            if self._failure is None and (always_fails or not self._stopping.is_set()):
                self._failure = exc
                self._stopping.set()
                try:
                    await self._rollout.roles.queue.close.call_one().within(60)
                except Exception:
                    pass

    async def _evaluate(self) -> dict[str, Any]:
        return await evaluation.evaluate(self._rollout, self.task, self.log, step=self.step, version=self.policy_version)

    async def _periodic_evaluation(self) -> None:
        """The evaluation the train loop starts every run.eval_every steps, as a task it does not
        await: guarded like the loops, so a failure stops the run now instead of waiting in the task
        until the run ends. Its record is in the run log; the task's result is not used."""
        what = f"the held-out evaluation after train step {self.step} (run.eval_every={self.cfg.run.eval_every})"
        await self._guard(self._echo_evaluation(), always_fails=True, what=what)

    async def _echo_evaluation(self) -> None:
        record = await self._evaluate()
        self._echo(f"held-out accuracy at step {record['step']} (v{record['version']}): {record['accuracy']:.1%}")

    # -- while it runs ------------------------------------------------------------------------

    async def stop(self, *, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Drain, checkpoint and shut down (module docstring); returns run()'s summary once it
        returned, or None if the run failed, was never started, or was stopped in its warm start
        (run() raises ``WarmStartStopped``: nothing to save yet). Resume with ``run.resume=latest``."""
        self._stop_requested.set()
        self._stopping.set()
        if not self._roles_ready.is_set():
            self._warm_stop.set()  # a warm start under way ends at its next step, caching nothing
        await asyncio.sleep(0)  # a run task created just before gets to start
        if not self._started.is_set():
            # nothing to stop: a run() started later runs (it used to start every role, evaluate,
            # checkpoint step 0 and export, then return "stopped" without a word)
            self._stop_requested.clear()
            self._stopping.clear()
            self._warm_stop.clear()
            return None
        limit = self.cfg.run.stop_drain_timeout_s + 3 * self.cfg.run.step_timeout_s if timeout_s is None else timeout_s
        try:
            # waits for: run() to drain, checkpoint, export and stop the roles; unblocked by: run()
            await asyncio.wait_for(self._finished.wait(), limit)
        except asyncio.TimeoutError:
            raise TimeoutError(f"Pipeline.stop gave up after {limit:.0f}s waiting for run() to drain, checkpoint "
                               "and shut down") from None
        return self._summary

    async def _wait_for(self, event: asyncio.Event, what: str, timeout_s: float) -> bool:
        """Wait for one of run()'s milestones; False if the run ended first. Fails if run() is
        not running or the milestone takes longer than ``timeout_s``."""
        if not self._started.is_set():
            await asyncio.sleep(0)  # a run task created just before gets to start
            if not self._started.is_set():
                raise RuntimeError(f"{what} needs a running pipeline: start asyncio.create_task(pipeline.run()) first")
        ready, done = asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._finished.wait())
        try:
            # waits for: run() to reach the milestone (or to end); unblocked by: run()
            await asyncio.wait([ready, done], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            done.cancel()
        if not event.is_set() and not self._finished.is_set():
            raise TimeoutError(f"{what}: gave up after {timeout_s:.0f}s waiting for the pipeline to start its roles")
        return event.is_set() and not self._finished.is_set()

    def _startup_timeout_s(self) -> float:
        return self.cfg.run.step_timeout_s + 900  # the warm start comes first: minutes on a CPU

    async def metrics(self) -> AsyncIterator[dict[str, Any]]:
        """Every metrics record (steps, evals) of the run, from its first, as the run writes them;
        ends when the run ends. Iterate it beside ``run()``, from the loop turn its task is created in
        (``asyncio.create_task(pipeline.run())`` first) or any time after. After a resume by
        run.auto_resume it goes on with the resumed run's records: a ``restart`` record, then the
        steps from the checkpoint's on (the steps past it are done again)."""
        await self._wait_for(self._log_ready, "Pipeline.metrics", self._startup_timeout_s())
        log, first = self.log, True
        while log is not None:
            skip = 0 if first else log.replayed  # the checkpoint's records were streamed by the earlier log
            async for i, rec in _enumerate(log.stream(replay=True)):
                if i >= skip:
                    yield rec
            first = False
            # the log closed: the run ended, or run.auto_resume starts the next attempt's log (seconds)
            while not self._finished.is_set() and (self.log is log or not self._log_ready.is_set()):
                await asyncio.sleep(0.05)
            log = None if self._finished.is_set() else self.log

    async def processes(self) -> dict[str, int]:
        """``{"role/rank": pid}`` of every role's process (queue, rollout, reward, trainer, reference)
        of the running attempt: what an operator (or a fault-injection test) signals."""
        roles = (await self._running("Pipeline.processes")).roles
        meshes = {"queue": roles.queue if roles.queue is not roles.rollouts else None, "rollout": roles.engines,
                  "reward": roles.rewards, "trainer": roles.trainer,
                  "reference": roles.reference}
        out: dict[str, int] = {}
        for name, mesh in meshes.items():
            if mesh is None or (name == "trainer" and mesh is roles.engines):
                continue  # no such role; colocated: the hybrid workers are listed as rollout
            deadline = time.monotonic() + 60
            while True:
                try:
                    pids = (await mesh._run_all(os.getpid, what="their process ids").within(60)).values()
                    break
                except ActorFailure as exc:  # a supervised worker being restarted answers once it is back
                    if not exc.restarting or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            out.update({f"{name}/{rank}": pid for rank, pid in enumerate(pids)})
        return out

    async def _running(self, what: str) -> RolloutDriver:
        if not await self._wait_for(self._roles_ready, what, self._startup_timeout_s()) or self._closed:
            raise RuntimeError(f"{what}: the pipeline has shut down")
        return self._rollout

    @contextlib.asynccontextmanager
    async def _user_call(self, what: str) -> AsyncIterator[RolloutDriver]:
        """A call of the embedding API: refused once the run shut down, and failing as such when the
        run ends under it (its roles stopped, its log closed), not with what that did to the call."""
        rollout = await self._running(what)
        try:
            yield rollout
        except Exception as exc:
            if self._closed:
                raise RuntimeError(f"{what}: the pipeline shut down while this call ran") from exc
            raise

    async def generate(self, prompts: Sequence[str], *, max_new_tokens: int | None = None,
                       temperature: float = 0.0) -> list[str]:
        """Complete ``prompts`` on the rollout engines, on the weights they serve (``policy_version``, or
        the one before while a push lands; greedy
        by default; ``max_new_tokens`` defaults to rollout.max_new_tokens)."""
        async with self._user_call("Pipeline.generate") as rollout:
            return await evaluation.generate(rollout, prompts, max_new_tokens=max_new_tokens or self.cfg.rollout.max_new_tokens,
                                             temperature=temperature)

    async def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy (and reward metrics) now, at the current policy version (once every
        engine serves it); also logged."""
        async with self._user_call("Pipeline.evaluate"):
            await self._train.settle()  # a detached push lands first: the record's version is the one evaluated
            return await self._evaluate()

    async def export_hf(self, path: str | os.PathLike) -> str:
        """Write the current policy as a Hugging Face checkpoint at ``path`` (between train steps)."""
        async with self._user_call("Pipeline.export_hf") as rollout:
            return (await bounded(rollout.roles.trainer.save_hf.call(str(path)), self.cfg.run.step_timeout_s,
                                  "the trainer's HF export")).values()[0]
