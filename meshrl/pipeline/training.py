"""The controller's training side: the train loop, weight pushes, checkpoints and resume.

```text
train loop, until run.total_steps or the run stops:
  queue.get_batch      waits for: samples_per_step samples (whole groups) within max_staleness
                                  of the version the step trains at
                       unblocked by: rollout loop put_ref (or queue.close when stopping)
                       asked for while the step before trains (not after a checkpoint's step):
                       the trainer starts the next step as soon as its weights are sent
  trainer.train_step   (every dp rank fetches only its share, whole groups, by their refs)
  every sync_interval steps: version += 1 and a push to every engine (meshrl.pipeline.weight_sync). distributed:
  the engines' receives are armed while the step computes the version (reshard.meshes.arm), the
  trainer sends after it; at max_staleness ≥ 1 (staged apply, separate engines) the train loop
  goes on once the trainer has sent, and the engines flip on their own time (awaited before the
  next push, a checkpoint or an evaluation). object_store: trainer.gather_weights (dp > 1: full
  tensors onto rank 0) → reshard.push_weights → engines
  every checkpoint_every steps and at the end: checkpoint (trainer state, the sampler's state: queue
  snapshot, prompt position, requests in flight) — before set_version, so at max_staleness = 0
  nothing is in flight (meshrl.pipeline.checkpoint)
  queue.set_version(version)  only once every engine serves it (a detached push: when its flip
                              lands), so admission never grants a batch that starts on v - 1
  the step record (with queue.metrics) is written beside the next step, in step order
resume: trainer.load_checkpoint → push its weights as the saved version → sampler.restore (the
        requests that were in flight are taken again first; unknown reservations cancelled)
a rollout worker restarted in place (meshrl.pipeline.revival): loaded when the trainer's weights are
  the served version's — by ``revive`` between a push and the next train step (the train loop holds
  ``_weights`` from that step to its push), or by the push that failed with it, sent again
```
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from meshrl import manifest
from meshrl.pipeline import checkpoint as ckpt
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import Roles, RolloutDriver, bounded
from meshrl.pipeline.weight_sync import weight_sync
from meshrl.pipeline.audit import AuditLog
from meshrl.queues import QueueClosed, SamplerState
from meshrl.queues.snapshot import ledger_mark

__all__ = ["TrainLoop"]

TOKENS_WINDOW_STEPS = 8
"""The tokens_per_s of a step record is the generation rate over the last this many steps."""


class TrainLoop:
    """The train loop and the run's position: step, policy version, newest checkpoint."""

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
        self.sync = weight_sync(cfg, roles, self._publish)
        """How the weights reach the engines: arm, push, settle (meshrl.pipeline.weight_sync)."""
        self.revivals = rollout.revivals
        self._weights = asyncio.Lock()
        """Held by the train loop while the trainer's weights are ahead of ``version`` (from a train
        step to its push) and by ``revive``, which loads a restarted rollout worker with them."""
        self.published = 0
        """The newest version the queue was told (set_version)."""

    async def run(self) -> None:
        """Train until ``run.total_steps`` or until the rollout side's ``stopping`` is set."""
        try:
            await self._run()
        finally:
            self._release_weights()
            await self.sync.close()  # a step failed between arming and its push

    _holding = False
    """The train loop holds ``_weights`` (not ``revive``)."""

    async def _hold_weights(self) -> None:
        if not self._holding:
            # waits for: a restarted rollout worker's load (seconds); unblocked by: revive
            await self._weights.acquire()
            self._holding = True

    def _release_weights(self) -> None:
        if self._holding:
            self._holding = False
            self._weights.release()

    async def revive(self) -> None:
        """Load the rollout workers restarted in place with the current weights, whenever one is
        reported dead, until cancelled (a task of the controller's; module docstring)."""
        while True:
            await self.revivals.wake.wait()
            self.revivals.wake.clear()
            if not self.revivals.down:
                continue
            async with self._weights:  # the trainer's weights are `version`'s from here to the release
                if self.revivals.down:
                    try:
                        await self.sync.settle()  # a detached push still landing, or failed with the worker
                    except Exception as exc:
                        if (rank := self.revivals.restartable(exc)) is None:
                            raise
                        self.revivals.died(rank)
                    await self.push(self.version, publish=self.published < self.version)

    async def _run(self) -> None:
        cfg, timeout = self.cfg, self.cfg.run.step_timeout_s
        last_end = time.perf_counter()
        # generated tokens arrive a whole request at a time: rate them over the last few steps, not one
        self._window = collections.deque([(last_end, self.rollout.generated_tokens)], maxlen=TOKENS_WINDOW_STEPS + 1)
        upcoming: asyncio.Future | None = None
        """The next step's batch, asked for while this step trains (``_prefetches``)."""
        try:
            while self.step < cfg.run.total_steps and (upcoming is not None or not self.rollout.stopping.is_set()):
                t0 = self.log.now()
                if upcoming is None:
                    batch = await self._batch(self.version)
                else:  # asked for during the last step; taken (or not yet) whether or not the run is stopping
                    taking, upcoming = upcoming, None
                    try:
                        batch = await taking
                    except QueueClosed:
                        if self.rollout.stopping.is_set():  # stopped before it was complete: nothing was taken
                            break
                        raise
                t1 = self.log.now()
                await self._hold_weights()  # from here the trainer's weights are ahead of `version`
                if self._pushes_after(self.step + 1) and not self.revivals.down:
                    self.sync.arm(self.version + 1)  # the engines post their receives while the step computes
                # every dp rank trains its own share; the metrics are global (rank 0's)
                training = self.roles.trainer.train_step.call(batch, self.version).within(timeout)
                if self._prefetches(self.step + 1):
                    after = self.version + self._pushes_after(self.step + 1)  # the version the next step trains at
                    upcoming = asyncio.ensure_future(self._batch(after))
                metrics = (await training).values()[0]
                t2 = self.log.now()
                self.log.span("trainer", "train_step", t1, t2)
                if "colocated/switch_to_train_s" in metrics:  # placement=colocated: the step began by freeing the KV cache
                    self.log.span("colocated", "switch_to_train", t1, t1 + metrics["colocated/switch_to_train_s"])
                self.step += 1
                await self.audit.record(self.step, batch.groups)
                sync_s, pushed, checkpoint = 0.0, self._pushes_after(self.step), checkpoints_after(self.cfg, self.step)
                if pushed:
                    self.version = await self.push(self.version + 1, publish=not checkpoint)
                    sync_s = self.log.now() - t2
                    self.log.span("sync", "push_weights", t2, t2 + sync_s, version=self.version)
                now = time.perf_counter()
                self._record(now, {
                    "step": self.step, "version": self.version, **metrics,
                    "step_time_s": now - last_end, "batch_wait_s": t1 - t0, "sync_time_s": sync_s,
                    **self.sync.phases(), "restarts": self.restarts,
                    "reissued_requests": self.revivals.reissued_requests, "revived_workers": self.revivals.revived,
                })
                last_end = now
                if checkpoint:
                    # before set_version: at max_staleness=0 no rollout is in flight now
                    await self.settle()
                    await self.checkpoint()
                    if pushed:
                        await self._publish(self.version)
                if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.total_steps:
                    await self.settle()  # evaluated at the version the step record names
                    await self.recorded()  # its record after this step's
                    self.evals.append(asyncio.create_task(self._evaluate()))
                if pushed:
                    self._release_weights()
        except BaseException:
            if upcoming is not None:  # a step failed: the run ends (or resumes from its newest checkpoint)
                upcoming.cancel()
                await asyncio.gather(upcoming, return_exceptions=True)
            with contextlib.suppress(Exception):  # the records written so far stay; the step's own error is raised
                await self.recorded()
            raise
        await self.recorded()
        await self._hold_weights()
        await self.settle()
        if self.step == cfg.run.total_steps and not self._pushes_after(self.step):
            # off the cadence, after the end checkpoint: the final evaluation is of the weights the run
            # exports (final/), whatever total_steps is; the queue is not told (no batch follows)
            t0 = self.log.now()
            self.version = await self.push(self.version + 1)
            await self.settle()
            self.log.span("sync", "push_weights", t0, self.log.now(), version=self.version)

    async def _batch(self, version: int) -> Any:
        """The next batch for a step at ``version``, by reference: the blobs' refs, split into whole
        groups per trainer dp rank; each rank fetches its own share from the producers' nodes."""
        timeout = self.cfg.run.step_timeout_s
        # waits for: samples_per_step samples within max_staleness of `version`;
        # unblocked by: rollout loop put_ref (or queue.close when the run stops)
        return await bounded(self.roles.queue.get_batch_refs.call_one(self.cfg.trainer.samples_per_step, version,
                                                                      timeout=timeout, shares=self.cfg.trainer.dp),
                             timeout + 30, "a batch from the queue")

    def _prefetches(self, step: int) -> bool:
        """Whether the batch of the step after ``step`` is asked for while ``step`` trains: not when
        ``step`` is the last, checkpoints (its queue snapshot must hold every sample not trained), or
        the run is stopping. A batch taken early is trained even if the run stops meanwhile (a step
        in flight finishes); the queue's admission is the same either way (``meshrl.queues.admission``:
        taking a batch only moves the consumed position it would move a step later)."""
        return step < self.cfg.run.total_steps and not checkpoints_after(self.cfg, step) and not self.rollout.stopping.is_set()

    def _record(self, ended: float, fields: dict[str, Any]) -> None:
        """The step record, with the sampler's report after the step (the queue's metrics, the tokens
        generated, what the requests put since did: ``RolloutDriver.reported``), written beside the
        next step: the answer and the writing (TensorBoard, the progress line) are off the train
        loop's path. Records are written in step order (``recorded`` waits for them). ``ended``:
        when the step ended (``time.perf_counter``)."""
        before = self._recording

        async def write() -> None:
            if before is not None:
                await before
            report = await bounded(self.roles.queue.report.call_one(), self.cfg.run.step_timeout_s, "the sampler's report")
            self.rollout.reported(report)
            generated, (since, then) = self.rollout.generated_tokens, self._window[0]
            self._window.append((ended, generated))
            self.log.step({**fields, "tokens_per_s": (generated - then) / max(ended - since, 1e-9),
                           "generated_tokens": generated, "reissued_calls": self.rollout.reissued_calls,
                           **{f"queue/{k}": v for k, v in report["metrics"].items() if isinstance(v, (int, float))}})

        self._recording = asyncio.ensure_future(write())

    _recording: asyncio.Future | None = None

    async def recorded(self) -> None:
        """Until every step record so far is written (a failed queue call raises here)."""
        if self._recording is not None:
            recording, self._recording = self._recording, None
            await recording

    def _pushes_after(self, step: int) -> bool:
        """Every trainer.sync_interval steps: the queue's admission counts on that cadence (a push
        off it, checkpointed, would put a resumed run's admission a version out of step)."""
        return step % self.cfg.trainer.sync_interval == 0

    async def settle(self) -> None:
        """Until every engine serves the newest pushed version and the queue has it; a failed
        push raises here (one that failed with a rollout worker restarted in place: pushed again)."""
        try:
            await self.sync.settle()
        except Exception as exc:
            if (rank := self.revivals.restartable(exc)) is None:
                raise
            self.revivals.died(rank)
            if not self._holding:  # a user's call: the train loop or `revive` pushes it again
                await self.revivals.any_serving("a push that failed with a restarted rollout worker", every=True)
                return
            await self.push(self.version, publish=self.published < self.version)

    async def push(self, version: int, *, publish: bool = False) -> int:
        """Send the trainer's weights to every engine as ``version``; returns it. ``publish``: then
        tell the queue (``set_version``), once every engine serves it. A rollout worker restarted in
        place first joins (and is loaded by this push): a push that fails with one is sent again."""
        deadline = time.monotonic() + self.cfg.run.step_timeout_s
        while True:
            ranks = sorted(self.revivals.down)
            loads = self.revivals.loads()
            try:
                if ranks:
                    await self.revivals.back_up(self.roles.engines, ranks)  # Ray re-created them
                    await self.sync.rejoin()
                pushed = await self.sync.push(version, publish=publish)
                if ranks:
                    await self.sync.settle()  # they take requests once they serve it
                    self.revivals.back(ranks, version, self.step)
                return pushed
            except Exception as exc:
                if (rank := self.revivals.restartable(exc)) is None or time.monotonic() > deadline:
                    raise
                self.revivals.died(rank, before=loads[rank])

    async def _publish(self, version: int) -> None:
        await bounded(self.roles.queue.set_version.call_one(version), self.cfg.run.step_timeout_s,
                      "the queue to take the new version")
        self.published = max(self.published, version)

    async def checkpoint(self) -> Path:
        """Trainer state, queue snapshot and controller state of this step (module docstring)."""
        await self.recorded()  # the checkpoint keeps the log up to its step
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
        if state.step > 0 or engines_kept:
            await self.push(state.version)  # the engines serve the restored policy as its version
            await self.settle()
        pending = await bounded(sampler.restore.call_one(sampler_state(state)), timeout, "the sampler to restore its state")
        # the checkpoint was taken between the push and set_version: announce that version now
        await bounded(sampler.set_version.call_one(state.version), timeout, "the sampler to take the restored version")
        evaluate_missed(self, state)
        off_cadence = "" if self._pushes_after(state.step) else (
            f" (step {state.step} is between two pushes of trainer.sync_interval={self.cfg.trainer.sync_interval}: "
            f"the engines serve the trainer's step-{state.step} weights as version {state.version}, so this run "
            "trains correctly but does not repeat an uninterrupted one exactly)")
        return (f"resumed from {path} at step {state.step}, policy version {state.version}"
                + (f", re-issuing {pending} requests that were in flight" if pending else "") + off_cadence)


async def write_run_checkpoint(loop: Any, run_state: Callable[[], Awaitable[ckpt.RunState]]) -> Path:
    """A checkpoint of ``loop``'s step (a ``TrainLoop`` or ``lanes.LaneLoop``): the trainer's state,
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
