"""The single controller: builds the role meshes and the queue, and runs the asynchronous loops.

```text
 prompts ─► rollout loop (× workers × requests_in_flight) ─────────────────────────────┐
              queue.reserve(k·n)   waits for: admission within max_staleness             │
                                   unblocked by: train loop set_version after a push     │
              rollout.generate     (engine: continuous batching, per-token versions)     │
              reward.score         (samples built and encoded on the reward worker)      │
              reference.annotate   (only with a KL term)                                 │
              queue.put_encoded    waits for: room under queue.capacity_tokens            │
                                   unblocked by: train loop get_batch                     ▼
 train loop:  queue.get_batch      waits for: samples_per_step samples (whole groups)    SampleQueue
                                   within max_staleness of the current version
                                   unblocked by: rollout loop put_encoded
              trainer.train_step   (every dp rank, the same batch; each trains its share)
              every sync_interval steps: version += 1; trainer.gather_weights (dp > 1: full
              tensors onto rank 0) → reshard.push_weights → engines
              every checkpoint_every steps and at the end: checkpoint (trainer state, queue
              snapshot, prompt position, requests in flight) — before set_version, so at
              max_staleness = 0 nothing is in flight (meshrl.pipeline.checkpoint)
              queue.set_version(version)  (only after every engine applied it)
 eval:        held-out prompts, greedy, on the rollout engines (before, every eval_every, after)
 resume:      trainer.load_checkpoint → push its weights as the saved version → queue.restore
              → re-issue the requests that were in flight (or cancel unknown reservations)
```

With ``max_staleness = 0`` the loops alternate strictly (synchronous, on-policy); with η > 0
rollout runs up to η versions ahead while the trainer trains. Every wait has a timeout; a failure
in any loop closes the queue, which wakes every waiter, and the run stops with that error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray

from meshrl.actors import ReferenceWorker, RewardWorker, RolloutJob, RolloutWorker, Trainer
from meshrl.config import to_yaml
from meshrl.embedded import warm_start
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.mesh import ActorMesh, ProcMesh, spawn_procs
from meshrl.pipeline import checkpoint as ckpt
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.queues import QueueClosed
from meshrl.queues.actor import QueueActor
from meshrl.reshard import push_weights
from meshrl.reshard import meshes as reshard_meshes
from meshrl.tasks import Problem, Task, build_task

__all__ = ["Pipeline"]

_WORKER_ENV = {
    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def ensure_ray(num_cpus: int | None) -> None:
    """Start a local Ray cluster unless this process is already connected to one."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
        runtime_env={"env_vars": _WORKER_ENV},
        # Batches of small samples stay out of the shared-memory store (about +30% queue speed).
        _system_config={"max_direct_call_object_size": 1 << 20},
    )  # fmt: skip


async def bounded(future, seconds: float, what: str):
    """Await a mesh call at most ``seconds``; the error says what was waited for."""
    try:
        return await future.within(seconds)
    except TimeoutError:
        raise TimeoutError(f"gave up after {seconds:.0f}s waiting for {what}") from None


class Pipeline:
    """An asynchronous RL run: ``summary = await Pipeline(cfg).run()``."""

    def __init__(self, config: PipelineConfig, *, task: Task | None = None) -> None:
        self.cfg = config.validate()
        self.task = task if task is not None else build_task(config.task)
        self.out_dir = Path(config.run.output_dir)
        self.version = 0
        self.step = 0
        self._stopping = asyncio.Event()
        self._failure: BaseException | None = None
        self._procs: list[ProcMesh] = []
        self._generated_tokens = 0
        self.log: RunLog | None = None
        self._taking = asyncio.Event()  # cleared while a checkpoint captures the controller state
        self._taking.set()
        self._last_checkpoint = 0  # the step of the newest checkpoint
        self._accuracy_before: float | None = None

    @property
    def policy_version(self) -> int:
        return self.version

    # -- set-up -------------------------------------------------------------------------------

    async def _model_dir(self) -> str:
        if self.cfg.model.path is not None:
            return self.cfg.model.path
        return str(await asyncio.to_thread(warm_start, self.cfg.model.embedded, self.task, self.cfg.warmstart, log=self._echo))

    def _spawn(self, name: str, cls: type, *args: Any, procs: int = 1, dims: dict[str, int] | None = None,
               gpus_per_proc: int = 0, **kwargs: Any) -> ActorMesh:
        mesh = spawn_procs(dims or {"procs": procs}, cpus_per_proc=0.01, gpus_per_proc=gpus_per_proc,
                           env=_WORKER_ENV, name=name)  # fmt: skip
        self._procs.append(mesh)
        return mesh.spawn(name, cls, *args, **kwargs)

    async def _start_roles(self, model_dir: str) -> None:
        cfg = self.cfg
        ensure_ray(cfg.run.num_cpus)
        self.queue = self._spawn("queue", QueueActor, cfg.queue, samples_per_step=cfg.trainer.samples_per_step,
                                 steps_per_version=cfg.trainer.sync_interval)  # fmt: skip
        self.rollouts = self._spawn("rollout", RolloutWorker, model_dir, cfg.rollout.engine, cfg.rollout.threads,
                                    procs=cfg.rollout.num_workers)  # fmt: skip
        self.rewards = self._spawn("reward", RewardWorker, self.task, model_dir, procs=cfg.reward.num_workers)
        self.trainer = self._spawn(
            "trainer", Trainer, model_dir, cfg.trainer, cfg.algo, temperature=cfg.rollout.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens, total_steps=cfg.run.total_steps,
            dims={"dp": cfg.trainer.dp}, gpus_per_proc=int(cfg.trainer.device == "cuda"),
        )  # fmt: skip
        self.reference = None
        if cfg.algo.kl_coef > 0 and not cfg.trainer.reference_in_trainer:
            self.reference = self._spawn("reference", ReferenceWorker, model_dir, temperature=cfg.rollout.temperature,
                                         tokens_per_microbatch=cfg.trainer.tokens_per_microbatch)  # fmt: skip
        meshes = [self.queue, self.rollouts, self.rewards, self.trainer] + ([self.reference] if self.reference else [])
        await asyncio.gather(*(m.ready().within(self.cfg.run.step_timeout_s) for m in meshes))
        if cfg.reshard.transport == "distributed":
            # once: a process group over every trainer and engine rank, and the cached transfer plan
            await reshard_meshes.connect(self.trainer, self.rollouts, cfg.reshard)

    def _echo(self, line: str) -> None:
        if self.log is not None:
            self.log.echo(line)
        else:
            print(line, flush=True)

    # -- the loops ----------------------------------------------------------------------------

    def _requests(
        self, problems: list[Problem], *, greedy: bool, n: int, group_ids: list[int] | None = None
    ) -> tuple[list[list[int]], list[GenerateRequest]]:
        """Tokenised prompts and their requests; a sampled request is seeded by its group id, so
        a run's samples do not depend on how requests interleave in the engine."""
        r = self.cfg.rollout
        prompt_ids = [self.tokenizer.encode(p.prompt) for p in problems]
        requests = []
        for i, ids in enumerate(prompt_ids):
            sampling = SamplingParams(
                max_new_tokens=(self.cfg.run.eval_max_new_tokens or r.max_new_tokens) if greedy else r.max_new_tokens,
                temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
                top_k=-1 if greedy else r.top_k, n=n,
                seed=None if group_ids is None else (self.cfg.run.seed * 1_000_003 + group_ids[i]) % (1 << 62),
            )  # fmt: skip
            requests.append(GenerateRequest(input_ids=ids, sampling=sampling))
        return prompt_ids, requests

    async def _next_job(self) -> tuple[ckpt.InFlight, list[Problem]]:
        """A restored request to generate again, or a new reservation with the next prompts."""
        if (reissued := self._ledger.take_reissued()) is not None:
            return reissued
        r, n = self.cfg.rollout, self.cfg.algo.samples_per_prompt
        # waits for: admission within max_staleness; unblocked by: train loop set_version
        reservation = await bounded(self.queue.reserve.call_one(r.prompts_per_request * n),
                                     self.cfg.queue.reserve_timeout_s + 30, "the queue to admit a rollout request")
        try:
            # waits for: a checkpoint to finish capturing the controller state (milliseconds)
            await self._taking.wait()
        except BaseException:
            await asyncio.shield(self.queue.cancel.call_one(reservation.id).within(60))
            raise
        return self._ledger.take(reservation.id, r.prompts_per_request)

    async def _rollout_loop(self, worker: ActorMesh, worker_index: int) -> None:
        n = self.cfg.algo.samples_per_prompt
        while not self._stopping.is_set():
            job, problems = await self._next_job()
            try:
                group_ids = list(range(job.first_group, job.first_group + job.count))
                prompt_ids, requests = self._requests(problems, greedy=False, n=n, group_ids=group_ids)
                t0 = self.log.now()
                results = await bounded(worker.generate.call_one(requests), self.cfg.run.step_timeout_s,
                                        f"rollout worker {worker_index} to generate")
                t1 = self.log.now()
                self.log.span("rollout", "generate", t0, t1, worker=worker_index)
                job_in = RolloutJob(problems=problems, prompt_ids=prompt_ids, results=results, group_ids=group_ids)
                scored = await bounded(self.rewards.score.choose(job_in), self.cfg.run.step_timeout_s, "a reward worker")
                encoded = scored.encoded
                if self.reference is not None:
                    encoded = await bounded(self.reference.annotate.choose(encoded), self.cfg.run.step_timeout_s, "the reference worker")
                self.log.span("reward", "score", t1, self.log.now(), worker=worker_index)
                # waits for: room under capacity_tokens; unblocked by: train loop get_batch
                await bounded(self.queue.put_encoded.call_one(encoded, job.reservation_id), self.cfg.queue.put_timeout_s + 30,
                              "the queue to accept samples")
                self._generated_tokens += scored.completion_tokens
            except BaseException:
                if not self._stopping.is_set():
                    await asyncio.shield(self.queue.cancel.call_one(job.reservation_id).within(60))
                raise
            finally:
                self._ledger.done(job.reservation_id)

    async def _train_loop(self) -> None:
        cfg, timeout = self.cfg, self.cfg.run.step_timeout_s
        last_end, last_tokens = time.perf_counter(), self._generated_tokens
        while self.step < cfg.run.total_steps and not self._stopping.is_set():
            t0 = self.log.now()
            # waits for: samples_per_step samples within max_staleness of `version`;
            # unblocked by: rollout loop put_encoded
            encoded = await bounded(self.queue.get_batch_encoded.call_one(cfg.trainer.samples_per_step, self.version, timeout=timeout),
                                    timeout + 30, "a batch from the queue")
            t1 = self.log.now()
            # every dp rank trains its share of the same batch; the metrics are global (rank 0's)
            metrics = (await self.trainer.train_step.call(encoded, self.version).within(timeout)).values()[0]
            t2 = self.log.now()
            self.log.span("trainer", "train_step", t1, t2)
            self.step += 1
            sync_s, pushed = 0.0, self.step % cfg.trainer.sync_interval == 0
            every = cfg.run.checkpoint_every
            checkpoint = (every > 0 and self.step % every == 0) or self.step == cfg.run.total_steps
            if pushed:
                self.version = await self._push(self.version + 1)
                if not checkpoint:
                    await bounded(self.queue.set_version.call_one(self.version), timeout, "the queue to take the new version")
                sync_s = self.log.now() - t2
                self.log.span("sync", "push_weights", t2, t2 + sync_s, version=self.version)
            now = time.perf_counter()
            queue_m = await bounded(self.queue.metrics.call_one(), timeout, "the queue's metrics")
            self.log.step({
                "step": self.step, "version": self.version, **metrics,
                "step_time_s": now - last_end, "batch_wait_s": t1 - t0, "sync_time_s": sync_s,
                "tokens_per_s": (self._generated_tokens - last_tokens) / max(now - last_end, 1e-9),
                "generated_tokens": self._generated_tokens,
                **{f"queue/{k}": v for k, v in queue_m.items() if isinstance(v, (int, float))},
            })  # fmt: skip
            last_end, last_tokens = now, self._generated_tokens
            if checkpoint:
                # before set_version: at max_staleness=0 no rollout is in flight now
                await self._checkpoint()
                if pushed:
                    await bounded(self.queue.set_version.call_one(self.version), timeout, "the queue to take the new version")
            if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.total_steps:
                self._evals.append(asyncio.create_task(self._evaluate()))
        if self.step > self._last_checkpoint and self._failure is None:
            await self._checkpoint()  # stopped early (Pipeline.stop)

    async def _push(self, version: int) -> int:
        """Publish the trainer's weights to every engine as ``version``; returns it."""
        timeout = self.cfg.run.step_timeout_s
        if self.cfg.reshard.transport == "distributed":
            # every trainer rank sends its own shards, every engine receives and flips atomically
            stats = await reshard_meshes.push(self.trainer, self.rollouts, version, timeout_s=timeout)
            return stats.version
        if self.cfg.trainer.dp > 1 or self.cfg.trainer.device == "cuda":
            # a collective over the dp ranks: rank 0 then holds the full tensors push_weights exports
            await self.trainer.gather_weights.call().within(timeout)
        push = await push_weights(self.trainer, self.rollouts, version, timeout_s=timeout)
        return push.version

    async def _checkpoint(self) -> Path:
        """Trainer state, queue snapshot and controller state of this step (module docstring)."""
        t0, timeout = self.log.now(), self.cfg.run.step_timeout_s
        partial = ckpt.partial_dir(self.out_dir, self.step)
        if partial.exists():
            shutil.rmtree(partial)
        await self.trainer.save_checkpoint.call(str(partial / "trainer")).within(timeout)
        self._taking.clear()  # no new prompts are taken until the state below is captured
        try:
            snapshot = await self.queue.snapshot.call_one().within(timeout)
            state = ckpt.RunState(
                step=self.step, version=self.version, prompt_position=self._ledger.stream.position,
                next_group=self._ledger.next_group, generated_tokens=self._generated_tokens,
                accuracy_before=self._accuracy_before, in_flight=list(self._ledger.in_flight.values()),
                queue_snapshot=snapshot,
            )  # fmt: skip
        finally:
            self._taking.set()
        ckpt.write_checkpoint_files(partial, state, self.out_dir / "metrics.jsonl")
        final = ckpt.commit(partial, keep=self.cfg.run.keep_checkpoints)
        self._last_checkpoint = self.step
        self.log.span("trainer", "checkpoint", t0, self.log.now(), step=self.step)
        return final

    async def _restore(self, path: Path) -> None:
        """Continue the run saved at ``path`` (roles started, rollout loops not yet)."""
        timeout = self.cfg.run.step_timeout_s
        state = ckpt.read_run_state(path)
        steps = await self.trainer.load_checkpoint.call(str(path / "trainer")).within(timeout)
        if set(steps.values()) != {state.step}:
            raise RuntimeError(f"{path}: trainer state is at steps {sorted(set(steps.values()))}, the run at {state.step}")
        self.step, self.version, self._last_checkpoint = state.step, state.version, state.step
        self._generated_tokens, self._accuracy_before = state.generated_tokens, state.accuracy_before
        if state.step > 0:
            await self._push(state.version)  # the engines serve the restored policy as its version
        outstanding = await bounded(self.queue.restore.call_one(state.queue_snapshot), timeout, "the queue to restore its snapshot")
        # the checkpoint was taken between the push and set_version: announce that version now
        await bounded(self.queue.set_version.call_one(state.version), timeout, "the queue to take the restored version")
        for reservation_id in self._ledger.restore(state, [r.id for r in outstanding]):
            await bounded(self.queue.cancel.call_one(reservation_id), timeout, "the queue to cancel a reservation")
        pending = self._ledger.reissue_pending
        self._echo(f"resumed from {path} at step {state.step}, policy version {state.version}"
                   + (f", re-issuing {pending} requests that were in flight" if pending else ""))  # fmt: skip

    async def _evaluate(self) -> dict[str, Any]:
        """Greedy accuracy on the held-out split, on the engines' current version."""
        step, version, t0 = self.step, self.version, self.log.now()
        problems = list(self.task.split("test"))
        chunk = max(1, -(-len(problems) // max(1, len(self.rollouts))))
        jobs = []
        for i in range(0, len(problems), chunk):
            part = problems[i : i + chunk]
            prompt_ids, requests = self._requests(part, greedy=True, n=1)
            jobs.append((part, prompt_ids, self.rollouts.generate.choose(requests)))
        scored = []
        for part, prompt_ids, pending in jobs:
            results = await bounded(pending, self.cfg.run.step_timeout_s, "held-out generation")
            job = RolloutJob(problems=part, prompt_ids=prompt_ids, results=results, group_ids=[-1] * len(part))
            scored.append(await bounded(self.rewards.score.choose(job), self.cfg.run.step_timeout_s, "held-out scoring"))
        rewards = [x for s in scored for x in s.rewards]
        correct = sum(s.info.get("correct", 0.0) * len(s.rewards) for s in scored) / max(1, len(rewards))
        accuracy = correct if any("correct" in s.info for s in scored) else sum(x >= 1.0 for x in rewards) / max(1, len(rewards))
        self.log.span("eval", "held-out", t0, self.log.now(), version=version)
        return self.log.record("eval", step=step, version=version, accuracy=accuracy, reward_mean=sum(rewards) / max(1, len(rewards)), problems=len(rewards))

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Warm start (embedded default), train ``run.total_steps`` steps, export, plot; return a summary."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(to_yaml(cfg))
        started = time.perf_counter()
        model_dir = await self._model_dir()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._ledger = ckpt.PromptLedger(self.task.split("train"), cfg.run.seed)
        resume_from = ckpt.resolve_resume(cfg.run.resume, self.out_dir)
        reference = cfg.algo.kl_coef > 0 and not cfg.trainer.reference_in_trainer
        self._echo(f"starting roles: queue, {cfg.rollout.num_workers} rollout, {cfg.reward.num_workers} reward, "
                   f"trainer (dp={cfg.trainer.dp})" + (", reference" if reference else ""))  # fmt: skip
        self.log = RunLog(self.out_dir, cfg.run.total_steps, progress=cfg.run.progress)
        for rec in ckpt.read_records(resume_from) if resume_from is not None else []:
            self.log.record(rec.pop("kind"), **rec)  # the log continues the checkpointed run's
        self._evals: list[asyncio.Task] = []
        try:
            await self._start_roles(model_dir)
            if resume_from is not None:
                await self._restore(resume_from)
            else:
                before = await self._evaluate()
                self._accuracy_before = before["accuracy"]
                self._echo(f"held-out accuracy before RL: {before['accuracy']:.1%} ({before['problems']} problems)")
            loops = [
                asyncio.create_task(self._guard(self._rollout_loop(self.rollouts.slice(procs=i), i)))
                for i in range(cfg.rollout.num_workers) for _ in range(cfg.rollout.requests_in_flight)
            ]  # fmt: skip
            try:
                await self._guard(self._train_loop())
            finally:
                self._stopping.set()
                await self.queue.close.call_one().within(60)
                await asyncio.gather(*loops, return_exceptions=True)
            if self._failure is not None:
                raise self._failure
            await asyncio.gather(*self._evals)
            after = await self._evaluate()
            # every dp rank takes part (the full weights are gathered); rank 0 writes
            final_dir = (await self.trainer.save_hf.call(str(self.out_dir / "final")).within(cfg.run.step_timeout_s)).values()[0]
        finally:
            self.log.close()
            self._shutdown()
        from meshrl.pipeline.plots import plot_run

        plot = plot_run(self.out_dir)
        summary = {
            "accuracy_before": self._accuracy_before, "accuracy_after": after["accuracy"], "steps": self.step,
            "version": self.version, "seconds": time.perf_counter() - started, "checkpoint": final_dir,
            "plot": str(plot), "metrics": str(self.out_dir / "metrics.jsonl"),
        }  # fmt: skip
        with (self.out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "summary", **summary}) + "\n")
        return summary

    async def _guard(self, coro) -> None:
        """Run a loop; on an unexpected error remember it and close the queue to wake the rest."""
        try:
            await coro
        except (asyncio.CancelledError, QueueClosed):
            if self._failure is not None and not self._stopping.is_set():
                raise
        except BaseException as exc:
            if self._failure is None and not self._stopping.is_set():
                self._failure = exc
                self._stopping.set()
                try:
                    await self.queue.close.call_one().within(60)
                except Exception:
                    pass

    async def stop(self) -> None:
        """Finish the current train step, then wind down like a normal end of run."""
        self._stopping.set()

    async def metrics(self) -> AsyncIterator[dict[str, Any]]:
        """Every metrics record (steps, evals) as the run writes it."""
        while self.log is None:
            await asyncio.sleep(0.05)
        async for rec in self.log.stream():
            yield rec

    def _shutdown(self) -> None:
        for mesh in self._procs:
            try:
                mesh.stop()
            except Exception:
                pass
        self._procs.clear()
