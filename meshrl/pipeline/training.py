"""The controller's training side: chunks of train steps handed to the trainer, checkpoints, resume.

```text
per chunk, until run.total_steps or the run stops:
  trainer.run_steps(until)   every dp rank runs the train loop itself up to step `until`: the next
                             checkpoint, evaluation or the end, or run.chunk_s seconds (at a push)
                             (meshrl.actors.train_loop: batches from the sampler, train steps, each
                             version pushed by the trainer and published to the sampler by its rank 0)
                             waits for: the chunk's steps; each of its waits is bounded in the trainer
  sampler.report             the queue's metrics and what the requests put since did
  the chunk's step records   into the log and the timeline (the trainer's spans)
  a push that failed with a rollout worker restarted in place: the worker rejoins, the version is
  pushed again (meshrl.pipeline.revival); a worker that died while the chunk ran: its chunk ends at
  the next step that pushed (sampler.hold_batches), the same, then sampler.resume_batches
  every checkpoint_every steps and at the end: checkpoint (trainer state, the sampler's state: queue
  snapshot, prompt position, requests in flight) before the version is published, so at
  max_staleness = 0 nothing is in flight (meshrl.pipeline.checkpoint); then sampler.set_version
  every eval_every steps: the evaluation, beside the next chunk
stop():  sampler.hold_batches(stopping): the trainer's next batch is STOP (one it took is trained)
resume:  trainer.load_checkpoint → trainer.place(step, version) → push its weights as the saved
         version → sampler.restore (the requests that were in flight are taken again first)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from meshrl import manifest
from meshrl.actors.train_loop import LoopPlan
from meshrl.pipeline import checkpoint as ckpt
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import Roles, RolloutDriver, bounded
from meshrl.pipeline.audit import AuditLog
from meshrl.queues import SamplerState
from meshrl.queues.snapshot import ledger_mark
from meshrl.reshard import meshes as reshard_meshes

__all__ = ["TrainLoop", "loop_plan"]


def loop_plan(cfg: PipelineConfig) -> LoopPlan:
    """What the trainer's loop needs of the run: the transport chosen once, at start."""
    if cfg.rollout.engine.backend == "sglang":
        transport = "sglang"
    elif cfg.placement == "colocated":
        transport = "colocated"
    else:
        transport = cfg.reshard.transport
    arms = transport == "distributed" and cfg.reshard.apply == "staged"
    return LoopPlan(samples_per_step=cfg.trainer.samples_per_step, sync_interval=cfg.trainer.sync_interval,
                    dp=cfg.trainer.dp, step_timeout_s=cfg.run.step_timeout_s, transport=transport, arms=arms,
                    detached=arms and cfg.queue.max_staleness >= 1,
                    gathers=cfg.trainer.dp > 1 or cfg.trainer.device == "cuda",
                    reshard_timeout_s=cfg.reshard.timeout_s, chunk_s=cfg.run.chunk_s)


class TrainLoop:
    """Hands the trainer its chunks of steps, and keeps the run's position: step, policy version,
    newest checkpoint (module docstring)."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, rollout: RolloutDriver, log: RunLog, out_dir: Path, *,
                 evaluate: Callable[[], Awaitable[Any]]) -> None:
        self.cfg, self.roles, self.rollout, self.log, self.out_dir = cfg, roles, rollout, log, out_dir
        self._evaluate = evaluate
        self.step = 0
        self.version = 0
        self.last_checkpoint = 0
        """The step of the newest checkpoint."""
        self.accuracy_before: float | None = None
        self.evals: list[asyncio.Task] = []
        """Held-out evaluations started every run.eval_every steps."""
        self.restarts = 0
        """Resumes of this run by run.auto_resume so far (the controller sets it)."""
        self.audit = AuditLog(log, roles.queue, cfg.run.audit, cfg.run.step_timeout_s)
        """The ledger of samples accepted, dropped and trained (run.audit, meshrl.pipeline.audit)."""
        self.revivals = rollout.revivals
        self.plan = loop_plan(cfg)
        """The trainer's loop's settings, the transport among them (chosen once)."""
        self.published = 0
        """The newest version the sampler was told (set_version)."""
        self._clock = time.time() - log.now()
        """``time.time()`` at the log's zero: the trainer's stamps onto the timeline's clock."""
        self._rate_from: tuple[float, int] | None = None
        """(when, tokens generated) at the end of the last chunk written: the next one's tokens_per_s."""

    async def connect(self) -> None:
        """The trainer's loop learns the sampler, the engines and the transport (once, at start)."""
        await self._all(self.roles.trainer.train_connect.call(self.roles.queue, self.roles.engines, self.plan),
                        "the trainer to connect its loop")

    async def _all(self, call: Any, what: str, seconds: float | None = None) -> Any:
        """A call of every trainer rank, bounded; rank 0's answer."""
        return (await bounded(call, seconds or self.cfg.run.step_timeout_s, what)).values()[0]

    async def run(self) -> None:
        """Train until ``run.total_steps`` or until the rollout side's ``stopping`` is set."""
        try:
            await self._run()
        except BaseException:
            # the trainer died (or failed) between arming the engines' receives and its push: withdrawn,
            # so that engines kept for a resume (run.warm_resume) take the next trainer's push
            if self.plan.arms:
                with contextlib.suppress(Exception):
                    await self.roles.engines.reshard_disarm.call().within(10)
            raise

    async def _run(self) -> None:
        cfg = self.cfg
        await self._all(self.roles.trainer.place.call(self.step, self.version), "the trainer to take its position")
        while self.step < cfg.run.total_steps and not self.rollout.stopping.is_set():
            await self._chunk(self._chunk_end(self.step))
        if self.rollout.stopping.is_set() and self.step < cfg.run.total_steps:
            # a batch the trainer asked for before the stop, and took, is trained (its samples are
            # out of the queue's snapshot); one not yet answered is STOP (Pipeline.stop holds them)
            await self._chunk(self.step + 1, stopping=True)
            return
        if self.step == cfg.run.total_steps and self.step % cfg.trainer.sync_interval:
            # off the cadence, after the end checkpoint: the final evaluation is of the weights the run
            # exports (final/), whatever total_steps is; the sampler is not told (no batch follows)
            t0 = self.log.now()
            self.version = await self.push(self.version + 1)
            self.log.span("sync", "push_weights", t0, self.log.now(), version=self.version)

    def _chunk_end(self, step: int) -> int:
        """The step the chunk from ``step`` goes up to: the next checkpoint, evaluation or the end."""
        cfg, ends = self.cfg, [self.cfg.run.total_steps]
        for every in (cfg.run.checkpoint_every, cfg.run.eval_every):
            if every > 0:
                ends.append((step // every + 1) * every)
        return min(ends)

    async def _chunk(self, until: int, *, stopping: bool = False) -> None:
        """One chunk up to step ``until`` and what follows it (module docstring). ``stopping``: the
        run's last, after Pipeline.stop (the checkpoint is the controller's)."""
        cfg = self.cfg
        checkpoint = checkpoints_after(cfg, until) and not stopping
        evaluates = bool(cfg.run.eval_every) and until % cfg.run.eval_every == 0 and until < cfg.run.total_steps
        # no batch asked ahead before a checkpoint: its queue snapshot must hold every sample not trained
        prefetch = until < cfg.run.total_steps and not checkpoint and not stopping
        # the evaluation, the checkpoint and the end see the engines on the last version
        settle = checkpoint or evaluates or stopping or until == cfg.run.total_steps
        steps = until - self.step
        # waits for: `steps` train steps (each of the trainer's waits bounded by run.step_timeout_s)
        chunk = await self._all(self.roles.trainer.run_steps.call(until, prefetch=prefetch, settle=settle,
                                                                  publish_last=not checkpoint),
                                f"the trainer's chunk of steps {self.step + 1}..{until}",
                                steps * (cfg.run.step_timeout_s + 30) + 60)
        await self._write(chunk["records"])
        self.step, self.version = chunk["step"], chunk["version"]
        self.published = max(self.published, chunk["published"])
        if chunk["failure"] is not None:
            failure = chunk["failure"]
            if (rank := self.revivals.restartable(failure)) is None:
                raise failure
            self.revivals.died(rank)  # the push of the chunk's last step failed with it: pushed again
            self.version = await self.push(self.version + 1, publish=not checkpoint or self.step < until)
        if stopping:
            return
        if self.step < until and not self.rollout.stopping.is_set():
            if self.revivals.down and self.step % cfg.trainer.sync_interval == 0:
                await self.push(self.version, publish=self.published < self.version)  # loads the restarted workers
            if chunk["held"]:  # a STOP for the revival (or one that came after it): batches again
                await bounded(self.roles.queue.resume_batches.call_one(), cfg.run.step_timeout_s,
                              "the sampler to resume batches")
            return
        if self.step < until:
            return  # stopping
        if self.revivals.down and self.step % cfg.trainer.sync_interval == 0:
            await self.push(self.version, publish=self.published < self.version and not checkpoint)
        if checkpoint:
            await self.checkpoint()
            if self.published < self.version:
                await self._publish(self.version)
        if evaluates:
            self.evals.append(asyncio.create_task(self._evaluate()))

    async def _write(self, records: list[dict[str, Any]]) -> None:
        """A chunk's step records and spans into the log, with the sampler's report (its metrics,
        the tokens generated, what the requests put since did); the audit of what each step trained."""
        if not records:
            return
        report = await bounded(self.roles.queue.report.call_one(), self.cfg.run.step_timeout_s, "the sampler's report")
        self.rollout.reported(report)
        queue_m = {f"queue/{k}": v for k, v in report["metrics"].items() if isinstance(v, (int, float))}
        generated, c = self.rollout.generated_tokens, self._clock
        since, before = self._rate_from or (records[0]["spans"][0], 0)
        end = records[-1]["spans"][3]
        rate = (generated - before) / max(end - since, 1e-9)
        self._rate_from = (end, generated)
        for rec in records:
            t0, t1, t2, t3 = rec.pop("spans")
            trained = rec.pop("groups")
            self.log.span("trainer", "train_step", t1 - c, t2 - c)
            if "colocated/switch_to_train_s" in rec:  # placement=colocated: the step began by freeing the KV cache
                self.log.span("colocated", "switch_to_train", t1 - c, t1 - c + rec["colocated/switch_to_train_s"])
            if t3 > t2 + 1e-6:
                self.log.span("sync", "push_weights", t2 - c, t3 - c, version=rec["version"])
            self.log.step({**rec, "tokens_per_s": rate, "generated_tokens": generated,
                           "reissued_calls": self.rollout.reissued_calls, "restarts": self.restarts,
                           "reissued_requests": self.revivals.reissued_requests,
                           "revived_workers": self.revivals.revived, **queue_m})
            await self.audit.record(rec["step"], trained)

    async def revive(self) -> None:
        """When a rollout worker is reported dead, end the trainer's chunk at its next step that
        pushed (the chunk loop then loads the restarted worker), until cancelled."""
        while True:
            await self.revivals.wake.wait()
            self.revivals.wake.clear()
            if self.revivals.down:
                await bounded(self.roles.queue.hold_batches.call_one(), self.cfg.run.step_timeout_s,
                              "the sampler to hold the trainer's batches")

    async def settle(self) -> None:
        """Until every engine serves the newest pushed version (the trainer's, between its chunks)."""
        await self._all(self.roles.trainer.settle_push.call(), "the engines to serve the last pushed version",
                        self.cfg.run.step_timeout_s * 3)

    async def push(self, version: int, *, publish: bool = False) -> int:
        """Send the trainer's weights to every engine as ``version`` (between chunks); returns it.
        ``publish``: then tell the sampler, once every engine serves it. A rollout worker restarted in
        place first joins (and is loaded by this push): a push that fails with one is sent again."""
        deadline = time.monotonic() + self.cfg.run.step_timeout_s
        while True:
            ranks = sorted(self.revivals.down)
            loads = self.revivals.loads()
            try:
                if ranks:
                    await self.revivals.back_up(self.roles.engines, ranks)  # Ray re-created them
                    await self._rejoin()
                await self._all(self.roles.trainer.push_version.call(version, publish), f"the push of v{version}",
                                self.cfg.run.step_timeout_s * 2)
                if publish:
                    self.published = max(self.published, version)
                if ranks:
                    self.revivals.back(ranks, version, self.step)
                return version
            except Exception as exc:
                if (rank := self.revivals.restartable(exc)) is None or time.monotonic() > deadline:
                    raise
                self.revivals.died(rank, before=loads[rank])

    async def _rejoin(self) -> None:
        """A rollout worker was re-created: forget the push that failed with it, and (distributed)
        every trainer and engine rank joins a new transfer group."""
        await self._all(self.roles.trainer.forget_push.call(), "the trainer to forget a failed push")
        if self.plan.transport == "distributed":
            await reshard_meshes.connect(self.roles.trainer, self.roles.engines, self.cfg.reshard)

    async def _publish(self, version: int) -> None:
        await bounded(self.roles.queue.set_version.call_one(version), self.cfg.run.step_timeout_s,
                      "the queue to take the new version")
        self.published = max(self.published, version)

    async def checkpoint(self) -> Path:
        """Trainer state, queue snapshot and controller state of this step (module docstring)."""
        return await write_run_checkpoint(self, self._run_state)

    async def _run_state(self) -> ckpt.RunState:
        """The rollout side's part of a checkpoint: the sampler's state, read at one instant there."""
        side = await bounded(self.roles.queue.state.call_one(), self.cfg.run.step_timeout_s, "the sampler's state")
        return await run_state(self, side, side.generated_tokens)

    async def restore(self, path: Path, *, engines_kept: bool = False) -> str:
        """Continue the run saved at ``path`` (roles started, rollout loops not yet); a line saying so.
        ``engines_kept``: the engines are a failed attempt's (run.warm_resume), serving later weights."""
        timeout, sampler = self.cfg.run.step_timeout_s, self.roles.queue
        state = await load_run_checkpoint(self, path)
        self.published = state.version  # announced below
        self.rollout.generated_tokens = state.generated_tokens
        await self._all(self.roles.trainer.place.call(state.step, state.version), "the trainer to take its position")
        if state.step > 0 or engines_kept:
            await self.push(state.version)  # the engines serve the restored policy as its version
        pending = await bounded(sampler.restore.call_one(sampler_state(state)), timeout, "the sampler to restore its state")
        # the checkpoint was taken between the push and set_version: announce that version now
        await bounded(sampler.set_version.call_one(state.version), timeout, "the sampler to take the restored version")
        evaluate_missed(self, state)
        off_cadence = "" if state.step % self.cfg.trainer.sync_interval == 0 else (
            f" (step {state.step} is between two pushes of trainer.sync_interval={self.cfg.trainer.sync_interval}: "
            f"the engines serve the trainer's step-{state.step} weights as version {state.version}, so this run "
            "trains correctly but does not repeat an uninterrupted one exactly)")
        return (f"resumed from {path} at step {state.step}, policy version {state.version}"
                + (f", re-issuing {pending} requests that were in flight" if pending else "") + off_cadence)


async def write_run_checkpoint(loop: Any, run_state: Callable[[], Awaitable[ckpt.RunState]]) -> Path:
    """A checkpoint of ``loop``'s step (a ``TrainLoop``): the trainer's state,
    then ``run_state()`` (the rollout side's part, captured at once), written under the partial
    directory with its manifest and committed."""
    t0, timeout = loop.log.now(), loop.cfg.run.step_timeout_s
    partial = ckpt.partial_dir(loop.out_dir, loop.step)
    if partial.exists():
        shutil.rmtree(partial)
    await loop.roles.trainer.save_checkpoint.call(str(partial / "trainer")).within(timeout)
    ckpt.write_checkpoint_files(partial, await run_state(), loop.out_dir / "metrics.jsonl")
    # last: what a resume checks every file against (a large checkpoint's hashing: off the event loop)
    await asyncio.to_thread(manifest.write_manifest, partial)
    final = ckpt.commit(partial, keep=loop.cfg.run.keep_checkpoints)
    loop.last_checkpoint = loop.step
    loop.log.span("trainer", "checkpoint", t0, loop.log.now(), step=loop.step)
    return final


async def run_state(loop: Any, side: SamplerState, generated_tokens: int) -> ckpt.RunState:
    """The ``RunState`` of ``loop``'s step from the sampler's state ``side``; the audit (run.audit)
    records what the queue took up to its snapshot into this checkpoint's lineage."""
    await loop.audit.record(loop.step, (), upto=ledger_mark(side.queue_snapshot))
    return ckpt.RunState(
        step=loop.step, version=loop.version, prompt_position=side.prompt_position, next_group=side.next_group,
        generated_tokens=generated_tokens, accuracy_before=loop.accuracy_before, in_flight=side.in_flight,
        queue_snapshot=side.queue_snapshot, fingerprint=ckpt.run_fingerprint(loop.cfg, loop.rollout.source),
    )


def sampler_state(state: ckpt.RunState) -> SamplerState:
    """The sampler's part of a checkpoint's ``RunState``."""
    return SamplerState(queue_snapshot=state.queue_snapshot, prompt_position=state.prompt_position,
                        next_group=state.next_group, in_flight=state.in_flight, generated_tokens=state.generated_tokens)


async def load_run_checkpoint(loop: Any, path: Path) -> ckpt.RunState:
    """The checkpoint at ``path`` read, its trainer state loaded on every rank, and ``loop``'s
    position (step, version, held-out accuracy before RL) set from it; its ``RunState``."""
    state = ckpt.read_run_state(path)
    steps = await loop.roles.trainer.load_checkpoint.call(str(path / "trainer")).within(loop.cfg.run.step_timeout_s)
    if set(steps.values()) != {state.step}:
        raise RuntimeError(f"{path}: trainer state is at steps {sorted(set(steps.values()))}, the run at {state.step}")
    loop.step, loop.version, loop.last_checkpoint = state.step, state.version, state.step
    loop.accuracy_before = state.accuracy_before
    return state


def evaluate_missed(loop: Any, state: ckpt.RunState) -> None:
    """A periodic checkpoint is written before its step's evaluation starts: on resume, run it now, as
    the uninterrupted run did at this step and version (the log holds the checkpoint's records)."""
    every = loop.cfg.run.eval_every
    if (every and state.step % every == 0 and 0 < state.step < loop.cfg.run.total_steps
            and not any(r["kind"] == "eval" and r.get("step") == state.step for r in loop.log.records)):
        loop.evals.append(asyncio.create_task(loop._evaluate()))


def checkpoints_after(cfg: PipelineConfig, step: int) -> bool:
    """Whether train step ``step`` is followed by a checkpoint: every run.checkpoint_every steps, and
    after the last with run.checkpoint_at_end."""
    every, total = cfg.run.checkpoint_every, cfg.run.total_steps
    return (every > 0 and step % every == 0) or (step == total and cfg.run.checkpoint_at_end)
