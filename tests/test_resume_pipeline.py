"""Checkpoint then resume ≡ the uninterrupted run, at pipeline level (real Ray roles, η = 0).

Run A trains 4 steps with a checkpoint every 2; run B starts from A's step-2 checkpoint in another
output directory and trains steps 3-4. With ``max_staleness=0`` and fixed seeds B's steps must
repeat A's exactly: same samples (prompt position, group ids → sampling seeds), same trainer
state (models, AdamW, schedule, RNG), same queue counters.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import pytest
import ray.cloudpickle

from meshrl.config import load_config
from meshrl.pipeline import Pipeline, PipelineConfig
from meshrl.pipeline.checkpoint import latest_checkpoint, read_run_state
from meshrl.queues.snapshot import QueueSnapshot
from meshrl.tasks import Problem, RewardOutput, TaskConfig, build_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow


class DigitShareTask:
    """1-digit addition prompts, rewarded by the share of digits in the completion, so a random
    model already gets varied rewards (and non-zero advantages) to learn from."""

    name = "digit-share"

    def __init__(self) -> None:
        self._base = build_task(TaskConfig(digits=1, num_test=8))

    def split(self, name: str):
        return self._base.split(name)

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        return RewardOutput(reward=share, info={"correct": float(completion.strip() == problem.answer)})

# Timing-dependent metrics differ between any two runs; everything else must match.
_TIMING = ("time", "_s", "per_s", "throughput", "/age", "wait", "queue/producer", "queue/consumer")


def _config(model_dir: str, out: Path, *extra: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={out}", "run.total_steps=4", "run.checkpoint_every=2",
        "run.keep_checkpoints=0", "run.eval_every=0", "run.progress=false",
        "queue.max_staleness=0", "trainer.samples_per_step=8", "rollout.prompts_per_request=8",
        "rollout.requests_in_flight=1", "rollout.max_new_tokens=4", "trainer.lr=1e-3",
        # critic, proximal log-probs and an in-trainer reference: every piece of state a resume needs
        "algo.policy_loss=decoupled_ppo", "algo.kl_coef=0.05", "trainer.reference_in_trainer=true",
        "reward.num_workers=0",  # the rollout worker scores: its requests re-issued on resume are scored as before
        "trainer.dp=2", *extra,  # FSDP2 over 2 real trainer actors: the controller's dp > 1 path
    ])


def _steps(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "step"}


def _evals(out: Path) -> list[tuple[int, int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["version"], r["accuracy"]) for r in records if r["kind"] == "eval"]


def test_resumed_run_repeats_the_uninterrupted_one(ray_cluster, tmp_path, tiny_model):
    """The trainer runs the train loop in chunks (to each checkpoint and evaluation); the rollout
    side's state comes from the sampler, its queue and its ledger read at once."""
    model_dir = tiny_model
    first = asyncio.run(Pipeline(_config(model_dir, tmp_path / "a", "run.eval_every=2"),
                                 task=DigitShareTask()).run())
    assert first["steps"] == 4
    ckpts = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000002", "step_00000004"]  # every 2 steps and at the end, none partial
    assert latest_checkpoint(tmp_path / "a").name == "step_00000004"
    state = read_run_state(tmp_path / "a" / "checkpoints" / "step_00000002")
    assert (state.step, state.version) == (2, 2)
    queue = msgspec.msgpack.decode(state.queue_snapshot, type=QueueSnapshot)
    # η=0: nothing in flight, nothing queued (the step's last request may be listed as just done)
    assert queue.reservations == [] and queue.groups == [] and state.prompt_position == 16

    resume = tmp_path / "a" / "checkpoints" / "step_00000002"
    second = asyncio.run(Pipeline(_config(model_dir, tmp_path / "b", "run.eval_every=2", f"run.resume={resume}"),
                                  task=DigitShareTask()).run())
    assert second["steps"] == 4 and second["accuracy_before"] == first["accuracy_before"]
    # the step-2 evaluation starts after the step-2 checkpoint is written: the resumed run runs it
    # (it used to be missing from its log), at the same version and with the same result
    assert _evals(tmp_path / "b") == _evals(tmp_path / "a") and [e[0] for e in _evals(tmp_path / "a")] == [0, 2, 4]

    a, b = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4]  # the log continues from the checkpoint's records
    # bitwise: at η = 0 one request of the whole batch is in flight at a time, so the engine's batches
    # and everything computed from them repeat exactly, and the checkpoint restores the trainer exactly
    timing = _TIMING
    compared = 0
    for step in (3, 4):
        for key, value in a[step].items():
            if isinstance(value, float) and not any(t in key for t in timing):
                assert b[step][key] == value, f"step {step} {key}: {b[step][key]} vs {value}"
                compared += 1
    assert compared > 30
    assert {"loss", "kl", "value_error", "reward_mean", "grad_norm"} <= set(a[4])
    # the steps learn something and differ, so the equality above is not vacuous
    assert a[3]["reward_mean"] > 0 and a[4]["loss"] != a[3]["loss"] and a[4]["kl"] > 0


class NaNRewardTask(DigitShareTask):
    """Every reward is finite but overflows float32 (a NaN reward would be marked reward_failed): every
    loss is non-finite, every update must be skipped, and the run must stop."""

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return RewardOutput(reward=1e300)


def test_repeated_nan_steps_stop_the_run_with_a_clear_message(ray_cluster, tmp_path, tiny_model):
    from meshrl.actors.trainer import NonFiniteStepsError

    model_dir = tiny_model
    cfg = _config(model_dir, tmp_path / "nan", "trainer.dp=1", "trainer.max_skipped_steps=2", "algo.kl_coef=0",
                  "trainer.reference_in_trainer=false")
    with pytest.raises(NonFiniteStepsError, match=r"2 train steps in a row .*max_skipped_steps=2"):
        asyncio.run(Pipeline(cfg, task=NaNRewardTask()).run())
    steps = _steps(tmp_path / "nan")
    assert sorted(steps) == [1] and steps[1]["skipped_updates"] == 1  # step 1 logged as skipped; step 2 stopped
