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
              trainer.train_step
              every sync_interval steps: version += 1; reshard.push_weights → engines;
              queue.set_version(version)  (only after every engine applied it)
 eval:        held-out prompts, greedy, on the rollout engines (before, every eval_every, after)
```

With ``max_staleness = 0`` the loops alternate strictly (synchronous, on-policy); with η > 0
rollout runs up to η versions ahead while the trainer trains. Every wait has a timeout; a failure
in any loop closes the queue, which wakes every waiter, and the run stops with that error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray

from meshrl.actors import ReferenceWorker, RewardWorker, RolloutJob, RolloutWorker, Trainer
from meshrl.config import to_yaml
from meshrl.embedded import warm_start
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.mesh import ActorMesh, ProcMesh, spawn_procs
from meshrl.pipeline.config import PipelineConfig
from meshrl.pipeline.metrics import RunLog
from meshrl.queues import QueueClosed, SampleQueue
from meshrl.queues.actor import QueueActor
from meshrl.reshard import push_weights
from meshrl.tasks import Problem, PromptStream, Task, build_task

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
        self._next_group = 0
        self.log: RunLog | None = None

    @property
    def policy_version(self) -> int:
        return self.version

    # -- set-up -------------------------------------------------------------------------------

    async def _model_dir(self) -> str:
        if self.cfg.model.path is not None:
            return self.cfg.model.path
        return str(await asyncio.to_thread(warm_start, self.cfg.model.embedded, self.task, self.cfg.warmstart, log=self._echo))

    def _spawn(self, name: str, cls: type, *args: Any, procs: int = 1, **kwargs: Any) -> ActorMesh:
        mesh = spawn_procs({"procs": procs}, cpus_per_proc=0.01, env=_WORKER_ENV, name=name)
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
        )  # fmt: skip
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference = self._spawn("reference", ReferenceWorker, model_dir, temperature=cfg.rollout.temperature,
                                         tokens_per_microbatch=cfg.trainer.tokens_per_microbatch)  # fmt: skip
        meshes = [self.queue, self.rollouts, self.rewards, self.trainer] + ([self.reference] if self.reference else [])
        await asyncio.gather(*(m.ready().within(self.cfg.run.step_timeout_s) for m in meshes))

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

    async def _rollout_loop(self, worker: ActorMesh, worker_index: int) -> None:
        r, n = self.cfg.rollout, self.cfg.algo.samples_per_prompt
        while not self._stopping.is_set():
            # waits for: admission within max_staleness; unblocked by: train loop set_version
            reservation = await self.queue.reserve.call_one(r.prompts_per_request * n)
            try:
                problems = self._prompts.take(r.prompts_per_request)
                group_ids = list(range(self._next_group, self._next_group + len(problems)))
                self._next_group += len(problems)
                prompt_ids, requests = self._requests(problems, greedy=False, n=n, group_ids=group_ids)
                t0 = self.log.now()
                results = await worker.generate.call_one(requests)
                t1 = self.log.now()
                self.log.span("rollout", "generate", t0, t1, worker=worker_index)
                scored = await self.rewards.score.choose(RolloutJob(problems=problems, prompt_ids=prompt_ids, results=results, group_ids=group_ids))
                encoded = scored.encoded
                if self.reference is not None:
                    encoded = await self.reference.annotate.choose(encoded)
                self.log.span("reward", "score", t1, self.log.now(), worker=worker_index)
                # waits for: room under capacity_tokens; unblocked by: train loop get_batch
                await self.queue.put_encoded.call_one(encoded, reservation.id)
                self._generated_tokens += scored.completion_tokens
            except BaseException:
                if not self._stopping.is_set():
                    await asyncio.shield(self.queue.cancel.call_one(reservation.id))
                raise

    async def _train_loop(self) -> None:
        cfg, timeout = self.cfg, self.cfg.run.step_timeout_s
        last_end, last_tokens = time.perf_counter(), self._generated_tokens
        while self.step < cfg.run.total_steps and not self._stopping.is_set():
            t0 = self.log.now()
            # waits for: samples_per_step samples within max_staleness of `version`;
            # unblocked by: rollout loop put_encoded
            encoded = await self.queue.get_batch_encoded.call_one(cfg.trainer.samples_per_step, self.version, timeout=timeout)
            t1 = self.log.now()
            metrics = await self.trainer.train_step.call_one(encoded, self.version).within(timeout)
            t2 = self.log.now()
            self.log.span("trainer", "train_step", t1, t2)
            self.step += 1
            sync_s = 0.0
            if self.step % cfg.trainer.sync_interval == 0:
                push = await push_weights(self.trainer, self.rollouts, self.version + 1, timeout_s=timeout)
                self.version = push.version
                await self.queue.set_version.call_one(self.version)
                sync_s = self.log.now() - t2
                self.log.span("sync", "push_weights", t2, t2 + sync_s, version=self.version)
            now = time.perf_counter()
            queue_m = await self.queue.metrics.call_one()
            self.log.step({
                "step": self.step, "version": self.version, **metrics,
                "step_time_s": now - last_end, "batch_wait_s": t1 - t0, "sync_time_s": sync_s,
                "tokens_per_s": (self._generated_tokens - last_tokens) / max(now - last_end, 1e-9),
                "generated_tokens": self._generated_tokens,
                **{f"queue/{k}": v for k, v in queue_m.items() if isinstance(v, (int, float))},
            })  # fmt: skip
            last_end, last_tokens = now, self._generated_tokens
            if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.total_steps:
                self._evals.append(asyncio.create_task(self._evaluate()))

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
            results = await pending
            job = RolloutJob(problems=part, prompt_ids=prompt_ids, results=results, group_ids=[-1] * len(part))
            scored.append(await self.rewards.score.choose(job))
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
        self._prompts = PromptStream(self.task.split("train"), seed=cfg.run.seed)
        self._echo(f"starting roles: queue, {cfg.rollout.num_workers} rollout, {cfg.reward.num_workers} reward, trainer"
                   + (", reference" if cfg.algo.kl_coef > 0 else ""))  # fmt: skip
        self.log = RunLog(self.out_dir, cfg.run.total_steps, progress=cfg.run.progress)
        self._evals: list[asyncio.Task] = []
        try:
            await self._start_roles(model_dir)
            before = await self._evaluate()
            self._echo(f"held-out accuracy before RL: {before['accuracy']:.1%} ({before['problems']} problems)")
            loops = [
                asyncio.create_task(self._guard(self._rollout_loop(self.rollouts.slice(procs=i), i)))
                for i in range(cfg.rollout.num_workers) for _ in range(cfg.rollout.requests_in_flight)
            ]  # fmt: skip
            try:
                await self._guard(self._train_loop())
            finally:
                self._stopping.set()
                await self.queue.close.call_one()
                await asyncio.gather(*loops, return_exceptions=True)
            if self._failure is not None:
                raise self._failure
            await asyncio.gather(*self._evals)
            after = await self._evaluate()
            final_dir = await self.trainer.save_hf.call_one(str(self.out_dir / "final"))
        finally:
            self.log.close()
            self._shutdown()
        from meshrl.pipeline.plots import plot_run

        plot = plot_run(self.out_dir)
        summary = {
            "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "steps": self.step,
            "version": self.version, "seconds": time.perf_counter() - started, "checkpoint": final_dir,
            "plot": str(plot), "metrics": str(self.out_dir / "metrics.jsonl"),
        }  # fmt: skip
        with (self.out_dir / "metrics.jsonl").open("a") as f:
            import json

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
                    await self.queue.close.call_one()
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
