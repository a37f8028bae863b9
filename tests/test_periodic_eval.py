"""Periodic held-out evaluations (real Ray roles, a tiny model): a failing one stops the run then,
naming the evaluation, like a rollout or train loop error (not when the run ends); working ones
are all logged before the run returns."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import ray.cloudpickle

from meshrl.config import load_config
from meshrl.pipeline import Pipeline, PipelineConfig
from meshrl.tasks import Problem, RewardOutput, TaskConfig, build_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

TOTAL_STEPS = 6


class AdditionTask:
    """1-digit addition with 4 held-out problems, rewarded by exact match."""

    name = "addition"

    def __init__(self) -> None:
        self._base = build_task(TaskConfig(digits=1, num_test=4))

    def split(self, name: str):
        return self._base.split(name)

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return RewardOutput(reward=float(completion.strip() == problem.answer))


class HeldOutGoneTask(AdditionTask):
    """Its held-out split loads twice, for the start-up prompt check and the evaluation before RL;
    every later read raises (its file was removed mid-run). Only the controller reads the split."""

    name = "held-out-gone"

    def __init__(self) -> None:
        super().__init__()
        self.test_reads = 0

    def split(self, name: str):
        if name == "test":
            self.test_reads += 1
            if self.test_reads > 2:
                raise FileNotFoundError("held-out split: data/test.jsonl is gone")
        return super().split(name)


def _config(model_dir: str, out: Path) -> PipelineConfig:
    return load_config(PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={out}", f"run.total_steps={TOTAL_STEPS}", "run.eval_every=1",
        "run.checkpoint_at_end=false", "run.progress=false", "run.step_timeout_s=120",
        "queue.max_staleness=0", "trainer.samples_per_step=8", "rollout.prompts_per_request=8",
        "rollout.requests_in_flight=1", "rollout.max_new_tokens=4",
        "reward.num_workers=0",  # the rollout worker scores (one process fewer; where scoring runs is not tested here)
    ])


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_periodic_evaluations_are_logged_and_awaited_before_the_run_ends(ray_cluster, tmp_path, tiny_model):
    model_dir = tiny_model
    summary = asyncio.run(Pipeline(_config(model_dir, tmp_path / "run"), task=AdditionTask()).run())
    assert summary["steps"] == TOTAL_STEPS and summary["accuracy_after"] is not None
    evals = sorted(r["step"] for r in _records(tmp_path / "run") if r["kind"] == "eval")
    assert evals == [0, *range(1, TOTAL_STEPS), TOTAL_STEPS]  # before, every step but the last, after


def test_a_failing_periodic_evaluation_stops_the_run_at_once(ray_cluster, tmp_path, tiny_model):
    model_dir = tiny_model
    with pytest.raises(FileNotFoundError, match="data/test.jsonl is gone") as info:
        asyncio.run(Pipeline(_config(model_dir, tmp_path / "run"), task=HeldOutGoneTask()).run())
    steps = [r["step"] for r in _records(tmp_path / "run") if r["kind"] == "step"]
    # the evaluation after step 1 fails at its first line; at most the step already under way finishes
    assert steps and max(steps) <= 2, f"the run trained on to step {max(steps)} after its evaluation failed"
    notes = getattr(info.value, "__notes__", [])
    assert any("held-out evaluation after train step 1" in note for note in notes), f"no note names the evaluation: {notes}"
