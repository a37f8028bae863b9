"""The pipeline embedded in a user's asyncio program: custom reward, custom environment, stop, resume.

A user-style script runs ``pipeline.run()`` as a task beside its own heartbeat task, reads
``pipeline.metrics()``, asks the current policy for completions and stops the run mid-way. The
stop must drain, checkpoint and shut down without losing samples: the checkpoint's queue snapshot
holds every sample put and not yet trained, and a resumed run continues from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import sys

import msgspec
import pytest
import ray.cloudpickle

import meshrl
from meshrl.pipeline.checkpoint import read_run_state
from meshrl.queues import QueueSnapshot

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow


class HintEnv:
    """Two turns: the first answer earns a hint (the answer's first digit), the second is final."""

    def __init__(self, problem: meshrl.Problem) -> None:
        self.problem, self.turn = problem, 0

    def reset(self) -> str:
        return self.problem.prompt

    async def step(self, action: str) -> meshrl.StepResult:
        self.turn += 1
        if self.turn == 1:
            return meshrl.StepResult(f" hint {self.problem.answer[0]}:", reward=0.0, done=False, info={"hinted": 1.0})
        return meshrl.StepResult("", reward=0.0, done=True, info={"hinted": 1.0})


async def digit_reward(problem: meshrl.Problem, completion: str) -> meshrl.RewardOutput:
    """Share of digits (a random policy already gets varied rewards); every 4th problem raises."""
    await asyncio.sleep(0)
    if problem.id % 4 == 0:
        raise ValueError(f"this scorer cannot score problem {problem.id}")
    share = sum(c.isdigit() for c in completion) / max(1, len(completion))
    return meshrl.RewardOutput(reward=share, info={"correct": float(completion.strip() == problem.answer)})


def make_config(model_dir: str, out, *extra: str) -> meshrl.PipelineConfig:
    return meshrl.load_config(meshrl.PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={out}", "run.total_steps=40", "run.eval_every=0",
        "run.progress=false", "task.digits=1", "task.num_test=8", "algo=grpo", "algo.samples_per_prompt=2",
        "queue.max_staleness=2", "trainer.samples_per_step=8", "rollout.prompts_per_request=2",
        "rollout.requests_in_flight=2", "rollout.max_new_tokens=3", "rollout.episode.max_turns=2",
        "trainer.lr=1e-3",
        "run.chunk_s=0.1",  # the trainer's records come every step or two: the script stops the run mid-way
        *extra,
    ])


async def user_script(cfg: meshrl.PipelineConfig, stop_after_steps: int, environment=HintEnv,
                      evaluate: bool = False, ahead: int = 0) -> dict:
    """What a user writes: the pipeline as one task among others, stopped on their own signal
    (``evaluate``: it also asks for a held-out evaluation before the stop; ``ahead``: the signal
    waits, after ``stop_after_steps`` steps, for a step record whose queue holds or has reserved at
    least that many samples)."""
    pipeline = meshrl.Pipeline(cfg, reward=digit_reward, environment=environment)
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0.02)

    beat = asyncio.create_task(heartbeat())
    run = asyncio.create_task(pipeline.run())
    steps, seen, summary = [], {}, None
    async with contextlib.aclosing(pipeline.metrics()) as records:
        async for m in records:
            if m["kind"] != "step":
                continue
            steps.append(m)
            if len(steps) >= stop_after_steps and m["queue/depth_samples"] + m["queue/reserved_unfilled_samples"] >= ahead:
                beats_at_stop = beats
                seen["version"] = pipeline.policy_version
                seen["texts"] = await pipeline.generate(["1+1=", "2+3="], max_new_tokens=4)
                if evaluate:
                    seen["eval"] = await pipeline.evaluate()
                summary = await asyncio.wait_for(pipeline.stop(), 300)
                break
    assert summary is not None, f"the run ended before its queue was {ahead} samples ahead: {steps[-1]}"
    assert await asyncio.wait_for(run, 60) == summary  # run() returned the same summary
    beat.cancel()
    return {"summary": summary, "steps": steps, "beats_at_stop": beats_at_stop, **seen}


def test_user_script_with_custom_reward_and_environment_stops_without_losing_samples(ray_cluster, tmp_path, tiny_model):
    model_dir = tiny_model
    # 3 requests of 4 samples in flight against 8 per step: after the stop the trainer may still
    # take one batch of what was in flight and queued, so at least 4 samples stay for the snapshot
    # (with 2 in flight, exactly one batch, an empty snapshot was a matter of timing)
    in_flight = "rollout.requests_in_flight=3"
    # stopped once a step record shows two batches queued or under way (a fresh-clone CI run under
    # load once stopped on an emptied queue): one more batch taken after the stop leaves samples
    out = asyncio.run(user_script(make_config(model_dir, tmp_path / "run", in_flight), stop_after_steps=3, ahead=16))
    summary, steps = out["summary"], out["steps"]
    assert summary["stopped"] is True and 3 <= summary["steps"] < 40 and summary["accuracy_after"] is None
    assert out["beats_at_stop"] > 20  # the user's task kept running beside the pipeline
    assert out["version"] >= 3 and len(out["texts"]) == 2 and all(isinstance(t, str) for t in out["texts"])
    # the custom environment and reward reached the trainer; a raising reward never stopped the run
    assert all(s["reward_info/hinted"] == 1.0 and s["reward_info/turns"] >= 1 for s in steps)
    failed = [s["reward_failed_frac"] for s in steps]
    assert all(0 <= f < 1 for f in failed) and sum(failed) > 0

    # the stop checkpoint: the queue snapshot holds every sample put and not trained
    state = read_run_state(summary["last_checkpoint"])
    assert state.step == summary["steps"]
    snap = msgspec.msgpack.decode(state.queue_snapshot, type=QueueSnapshot)
    queued = [s for g in snap.groups for s in g.samples]
    c = snap.counters
    assert len(queued) == c.samples_put - c.samples_consumed - c.dropped_stale - c.dropped_incomplete
    assert len(queued) > 0, "the rollout side ran ahead: samples were queued at the stop"
    assert c.samples_consumed == 8 * summary["steps"]
    assert all(s.loss_mask is not None and 0 in s.loss_mask and 1 in s.loss_mask for s in queued)  # env text masked
    assert all(s.reward == 0.0 for s in queued if s.reward_failed)

    # a resumed run continues from that snapshot: one more step, nothing dropped, the log goes on
    records_before = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    cfg = make_config(model_dir, tmp_path / "run", in_flight, "run.resume=latest", f"run.total_steps={summary['steps'] + 1}")
    resumed = asyncio.run(meshrl.Pipeline(cfg, reward=digit_reward, environment=HintEnv).run())
    assert resumed["steps"] == summary["steps"] + 1 and resumed["stopped"] is False
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "step"][-1]
    assert last["step"] == summary["steps"] + 1 and len(records) > len(records_before) // 2
    assert last["queue/samples_consumed"] == c.samples_consumed + 8
    assert last["queue/dropped_stale"] == c.dropped_stale and last["queue/dropped_incomplete"] == c.dropped_incomplete
    if importlib.util.find_spec("tensorboard"):  # the dev extra installs it: both runs wrote scalars, one per step
        from test_run_log import scalars

        tb = scalars(tmp_path / "run")
        assert [s for s, _ in tb["reward_mean"]] == list(range(1, summary["steps"] + 2))
        assert tb["reward_mean"][-1][1] == pytest.approx(last["reward_mean"]) and "eval/accuracy" in tb


def _small(model: str, tmp_path, steps: int) -> meshrl.PipelineConfig:
    """A pipeline of small steps (η = 1: detached weight pushes)."""
    return meshrl.load_config(meshrl.PipelineConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}",
        f"run.total_steps={steps}", "run.eval_every=0", "run.progress=false", "task.digits=1", "task.num_test=4",
        "algo=grpo", "algo.samples_per_prompt=2", "queue.max_staleness=1", "trainer.samples_per_step=4",
        "rollout.prompts_per_request=2", "rollout.requests_in_flight=1", "rollout.max_new_tokens=3",
        "reward.num_workers=0",  # the rollout worker scores: one process fewer (these tests are about the run's control)
    ])


def test_stop_before_run_leaves_a_later_run_alone(ray_cluster, tmp_path, tiny_model):
    """stop() before run() returned None but left the run stopping: a later run() started every role,
    evaluated, checkpointed step 0, exported, and returned "stopped" after 0 steps."""

    async def main() -> dict:
        pipeline = meshrl.Pipeline(_small(tiny_model, tmp_path, 2))
        assert await pipeline.stop() is None
        return await pipeline.run()

    summary = asyncio.run(main())
    assert summary["steps"] == 2 and not summary["stopped"]


def test_a_users_cancelled_evaluate_does_not_end_the_run(ray_cluster, tmp_path, tiny_model):
    """evaluate() waits for the engines to serve the newest version (the trainer's detached pushes:
    distributed, staged, η >= 1) before it evaluates. A caller that gave up (wait_for) used to cancel
    that push itself, and the train loop took its CancelledError for the end of the run: run()
    returned normally after a fraction of run.total_steps. Now the push is the trainer's own; a
    cancelled evaluate() cancels only itself."""
    cfg = _small(tiny_model, tmp_path, 14)

    async def main() -> tuple[dict, int]:
        pipeline = meshrl.Pipeline(cfg)
        run = asyncio.create_task(pipeline.run())
        async for record in pipeline.metrics():
            if record["kind"] == "step":
                break
        cancelled = 0
        while not run.done():
            try:
                await asyncio.wait_for(pipeline.evaluate(), random.uniform(0.001, 0.03))
            except (TimeoutError, asyncio.TimeoutError):
                cancelled += 1
            except RuntimeError as exc:  # the run ended, before or under this call: it says so
                assert "the pipeline shut down" in str(exc) or "has shut down" in str(exc), exc
                break
        return await run, cancelled

    summary, cancelled = asyncio.run(main())
    assert cancelled > 0 and summary["steps"] == 14 and not summary["stopped"], (summary["steps"], cancelled)


def test_two_pipelines_run_at_once_in_one_program(ray_cluster, tmp_path, tiny_model):
    """A program may train two policies side by side (a sweep, two agents): each run's actors live in
    a Ray namespace of its own. They shared the driver's, and the second run failed at once with
    "an actor named 'queue/0' already exists"."""

    async def main() -> list[dict]:
        a, b = meshrl.Pipeline(_small(tiny_model, tmp_path / "a", 3)), meshrl.Pipeline(_small(tiny_model, tmp_path / "b", 3))
        return await asyncio.gather(a.run(), b.run())

    summaries = asyncio.run(main())
    assert [s["steps"] for s in summaries] == [3, 3] and not any(s["stopped"] for s in summaries)
    assert summaries[0]["checkpoint"] != summaries[1]["checkpoint"]
    for run in ("a", "b"):
        steps = [json.loads(line) for line in (tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps if r["kind"] == "step"] == [1, 2, 3]
