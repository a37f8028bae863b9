"""The controller's side of ``run.loops=roles``: the roles run the loops (``meshrl.actors.lanes``), the
controller hands out chunks of steps and does the rest between them.

```text
start:   rollout.lane_open → trainer.lane_connect (the channel, the weights' layout)
         resume: trainer.load_checkpoint → trainer.lane_push(version) → rollout.lane_restore
         rollout.lane_start (its loops run until the queue closes)
train:   trainer.lane_steps(step, version, k)   k steps: to the next checkpoint or evaluation, at most
                                                run.lane_chunk_steps; the batches, the pushes and
                                                the set_versions go over the lane, not through here;
                                                asked two ahead: the next runs while one is written
         rollout.lane_report                    queue metrics, tokens, spans: into each step record
         every checkpoint_every steps and at the end: trainer.save_checkpoint, rollout.lane_state
         (the queue's snapshot with the ledger, read at once) → run_state.msgpack
         every eval_every steps: the evaluation, on the rollout worker beside its loops
stop():  rollout.lane_pause (the trainer's next batch is answered with STOP: its chunk ends there; the
         requests in flight put their samples) → queue.close → checkpoint
```

``LaneLoop`` stands where ``TrainLoop`` stands in ``meshrl.pipeline.controller`` (the same
attributes and methods the controller uses), so stopping, resuming, evaluating and exporting are the
controller's own code for both.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from meshrl.mesh import ActorFailure
from meshrl.pipeline import checkpoint as ckpt
from meshrl.pipeline.audit import AuditLog
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import Roles, RolloutDriver, bounded
from meshrl.pipeline.training import (checkpoints_after, evaluate_missed, load_run_checkpoint, run_state, sampler_state,
                                      write_run_checkpoint)

__all__ = ["LaneLoop"]


class LaneLoop:
    """Chunks of train steps run by the roles themselves, and the run's position (module docstring)."""

    def __init__(self, cfg: PipelineConfig, roles: Roles, rollout: RolloutDriver, log: RunLog, out_dir: Path, *,
                 evaluate: Callable[[], Awaitable[Any]]) -> None:
        self.cfg, self.roles, self.rollout, self.log, self.out_dir = cfg, roles, rollout, log, out_dir
        self._evaluate = evaluate
        self.step = self.version = self.last_checkpoint = self.restarts = 0
        self.accuracy_before: float | None = None
        self.evals: list[asyncio.Task] = []
        self.audit = AuditLog(log, roles.queue, cfg.run.audit, cfg.run.step_timeout_s)
        self._clock = time.time() - log.now()
        """``time.time()`` at the log's zero: the roles' stamps onto the timeline's clock."""
        self._prefetched = False
        """The last chunk asked for took the batch of the step after it."""
        self._rate_from: tuple[float, int] | None = None
        """(when, tokens generated) at the end of the last chunk written: the next one's tokens_per_s."""

    async def connect(self) -> None:
        """The lane between the trainer and the rollout worker: its channel and the weights' layout."""
        timeout = self.cfg.run.step_timeout_s
        host, port, dtype = await bounded(self.roles.rollouts.lane_open.call_one(), timeout, "the rollout worker's lane")
        shared = (await self.roles.trainer.lane_connect.call(host, port, dtype, timeout, self.cfg.run.lane_shared_memory
                                                             ).within(timeout)).values()[0]
        self.log.echo(f"lane: the trainer takes its batches from the rollout worker at {host}:{port}; the weights go "
                      + ("through shared memory" if shared else "in the messages") + f" ({dtype})")

    async def start(self) -> None:
        """The rollout worker's loops begin (after the evaluation before RL, or a restore)."""
        await bounded(self.roles.rollouts.lane_start.call_one(), self.cfg.run.step_timeout_s, "the rollout loops to start")

    async def run(self) -> None:
        """Train until ``run.total_steps`` or until the run is stopping. The trainer always holds the
        next chunk before it ends the one it runs (unless a checkpoint or the end comes between), so
        it never waits for the controller: a chunk's records are written while the next one trains."""
        cfg = self.cfg
        await self.start()
        chunks: collections.deque[tuple[int, int, Any]] = collections.deque()
        """(last step, version after it, the trainer's call) of the chunks asked for, in order."""
        end = (self.step, self.version)  # where the chunks asked for end
        while True:
            end = self._ask_ahead(chunks, end)
            if not chunks:
                break  # the end, or stopping
            last, after, calling = chunks.popleft()
            try:
                records, version = (await calling).values()[0]
            except ActorFailure:
                raise
            except Exception as exc:  # the lane broke: a dead rollout worker is the cause to report
                await self._blame_rollout(exc)
                raise
            got = records[-1]["step"] if records else None
            if (got, version) != (last, after) and not self.rollout.stopping.is_set():
                raise RuntimeError(f"the trainer's chunk ended at step {got}, version {version}; expected step {last}, "
                                   f"version {after}")
            if not records:
                continue  # stopping: the rollout worker answered its first batch with STOP
            end = self._ask_ahead(chunks, end)  # before the writing below
            report = await bounded(self.roles.rollouts.lane_report.call_one(), cfg.run.step_timeout_s,
                                   "the rollout worker's report")
            for done, trained in self._write(records, report):
                await self.audit.record(done, trained)  # run.audit: the groups each step trained
            self.step, self.version = got, version  # short of `last` when the run stopped during the chunk
            if checkpoints_after(self.cfg, self.step):
                await self.checkpoint()
            if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.total_steps:
                self.evals.append(asyncio.create_task(self._evaluate()))
        if self.step == cfg.run.total_steps and cfg.run.total_steps % cfg.trainer.sync_interval:
            # off the cadence: the final evaluation is of the weights the run exports (as TrainLoop does)
            self.version += 1
            await self.roles.trainer.lane_push.call(self.version).within(cfg.run.step_timeout_s)

    def _ask_ahead(self, chunks: collections.deque, end: tuple[int, int]) -> tuple[int, int]:
        """Give the trainer chunks until it holds two (its calls run one at a time, in order), from
        ``end`` (step, version): not past the end and not from a step whose checkpoint is not written
        yet. While stopping only the step whose batch a chunk took early (``prefetch``) is asked for.
        Returns where the chunks asked for end."""
        cfg, sync = self.cfg, self.cfg.trainer.sync_interval
        while len(chunks) < 2:
            step, version = end
            if step >= cfg.run.total_steps or (checkpoints_after(self.cfg, step) and self.last_checkpoint != step):
                break
            count = self._chunk(step)
            if self.rollout.stopping.is_set():
                if not self._prefetched:
                    break
                count = 1  # its batch is out of the queue: trained, as a step under way finishes
            last = step + count
            evaluates = cfg.run.eval_every and last % cfg.run.eval_every == 0
            self._prefetched = last < cfg.run.total_steps and not checkpoints_after(self.cfg, last) and not self.rollout.stopping.is_set()
            # waits for: the chunks before it and `count` train steps (each step's waits bounded by the trainer)
            calling = self.roles.trainer.lane_steps.call(
                step, version, count, sync, prefetch=self._prefetched,
                settle=not self._prefetched or bool(evaluates),
            ).within((len(chunks) + 1) * count * cfg.run.step_timeout_s)
            end = (last, version + last // sync - step // sync)
            chunks.append((*end, calling))
        return end

    async def _blame_rollout(self, exc: BaseException) -> None:
        """The trainer's chunk failed over the lane: if the rollout worker (and its queue) died,
        raise that death (run.auto_resume resumes from it), not the closed channel it left."""
        try:
            await self.roles.rollouts.lane_report.call_one().within(30)
        except ActorFailure as dead:
            raise dead from exc
        except Exception:
            pass  # alive (its own failure is in the trainer's error), or not answering: the trainer's error stands

    def _chunk(self, step: int) -> int:
        """Steps from ``step`` up to the next checkpoint, evaluation or the end, at most run.lane_chunk_steps."""
        cfg = self.cfg
        ends = [cfg.run.total_steps]
        for every in (cfg.run.checkpoint_every, cfg.run.eval_every):
            if every > 0:
                ends.append((step // every + 1) * every)
        return max(1, min(min(ends) - step, cfg.run.lane_chunk_steps))

    def _write(self, records: list[dict[str, Any]], report: dict[str, Any]) -> list[tuple[int, Any]]:
        """The chunk's step records and spans into the log; (step, groups trained) of each step."""
        queue_m = {f"queue/{k}": v for k, v in report["queue"].items() if isinstance(v, (int, float))}
        generated = report["generated_tokens"]
        since, before = self._rate_from or (records[0]["spans"][0], 0)
        end = records[-1]["spans"][3]
        rate = (generated - before) / max(end - since, 1e-9)
        self._rate_from = (end, generated)
        c, steps = self._clock, []
        for role, what, began, ended in report["spans"]:
            self.log.span(role, what, began - c, ended - c)
        for rec in records:
            t0, t1, t2, t3 = rec.pop("spans")
            trained = rec.pop("groups")
            self.log.span("trainer", "train_step", t1 - c, t2 - c)
            if t3 > t2 + 1e-6:
                self.log.span("sync", "push_weights", t2 - c, t3 - c, version=rec["version"])
            steps.append((rec["step"], trained))
            self.log.step({**rec, "tokens_per_s": rate, "generated_tokens": generated, "reissued_calls": 0,
                           "restarts": self.restarts, "reissued_requests": 0, "revived_workers": 0, **queue_m})
        return steps

    async def revive(self) -> None:
        """Rollout workers are not restarted in place with run.loops=roles (the run resumes instead)."""
        await asyncio.Event().wait()

    async def settle(self) -> None:
        """Every chunk ends with the engine serving its last version: nothing to wait for."""

    async def recorded(self) -> None:
        """Every step record is written when its chunk returns."""

    async def drain(self, timeout_s: float) -> int:
        """``Pipeline.stop``: the requests in flight put their samples (at most ``timeout_s``)."""
        return await bounded(self.roles.rollouts.lane_pause.call_one(timeout_s), timeout_s + 30,
                             "the rollout worker to finish its requests in flight")

    async def checkpoint(self) -> Path:
        """Trainer state, and the rollout side's state read at once (``LaneRollout.lane_state``)."""
        return await write_run_checkpoint(self, self._run_state)

    async def _run_state(self) -> ckpt.RunState:
        side, generated = await bounded(self.roles.rollouts.lane_state.call_one(), self.cfg.run.step_timeout_s,
                                        "the rollout side's state")
        return await run_state(self, side, generated)

    async def restore(self, path: Path, *, engines_kept: bool = False) -> str:
        """Continue the run saved at ``path`` (before ``run``); a line saying so."""
        timeout = self.cfg.run.step_timeout_s
        state = await load_run_checkpoint(self, path)
        if state.step > 0:
            await self.roles.trainer.lane_push.call(state.version).within(timeout)  # the engine serves it
        pending = await bounded(self.roles.rollouts.lane_restore.call_one(sampler_state(state), state.generated_tokens,
                                                                         state.version), timeout,
                                "the rollout worker to restore the sampler")
        evaluate_missed(self, state)
        return (f"resumed from {path} at step {state.step}, policy version {state.version}"
                + (f", re-issuing {pending} requests that were in flight" if pending else ""))
