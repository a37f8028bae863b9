"""``reward.num_workers=0``: each rollout worker scores its own generations (no reward process).

Real Ray roles and a tiny model. The reward function says in which process it ran (the Ray actor's
name, ``role/rank``), so the test sees that every training episode and every held-out problem was
scored inside a rollout worker. That the samples
are the same as a reward worker's is the colocated invariant's (``test_colocated.py``: the colocated
run scores in its hybrid workers, the disaggregated one in a reward worker, and both must agree).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import ray
import ray.cloudpickle

import meshrl
from meshrl.actors.reward import RewardConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def scored_where(problem: meshrl.Problem, completion: str) -> meshrl.RewardOutput:
    """Exact match, and 1 in ``in_rollout`` when the calling process is a rollout worker."""
    name = ray.get_runtime_context().get_actor_name() or ""
    return meshrl.RewardOutput(reward=float(completion.strip() == problem.answer),
                               info={"in_rollout": float(name.startswith("rollout/"))})


class OneHintEnv:
    """Two turns: the first answer earns the answer's first digit as a hint."""

    def __init__(self, problem: meshrl.Problem) -> None:
        self.problem, self.turn = problem, 0

    def reset(self) -> str:
        return self.problem.prompt

    def step(self, action: str) -> meshrl.StepResult:
        self.turn += 1
        return meshrl.StepResult(f" hint {self.problem.answer[0]}:" if self.turn == 1 else "", reward=0.0,
                                 done=self.turn > 1)


def test_reward_config_takes_zero_workers_and_refuses_fewer():
    assert RewardConfig(num_workers=0).num_workers == 0
    with pytest.raises(ValueError, match="num_workers >= 0"):
        RewardConfig(num_workers=-1)


@pytest.mark.slow
def test_rollout_workers_score_their_own_episodes_and_the_held_out_split(ray_cluster, tmp_path, tiny_model):
    """Episodes here; single-turn generations are scored in their rollout worker by the attached-server
    test of test_sglang_pipeline.py (a RolloutWorker over an SGLangEngine) and in the hybrid workers
    by the colocated invariant (test_colocated.py), both with reward.num_workers=0."""
    out = tmp_path / "run"
    cfg = meshrl.load_config(meshrl.PipelineConfig, None, [
        f"model.path={tiny_model}", f"run.output_dir={out}", "run.total_steps=3", "run.eval_every=0",
        "run.progress=false", "run.checkpoint_at_end=false", "task.digits=1", "task.num_test=4", "algo=grpo",
        "algo.samples_per_prompt=2", "trainer.samples_per_step=8", "rollout.prompts_per_request=2",
        "rollout.max_new_tokens=3", "rollout.episode.max_turns=2", "reward.num_workers=0",
    ])
    summary = asyncio.run(meshrl.Pipeline(cfg, reward=scored_where, environment=OneHintEnv).run())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert summary["steps"] == 3 and [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["samples"] == 8 and r["reward_info/in_rollout"] == 1.0 for r in steps), steps
    assert [r["step"] for r in evals] == [0, 3] and all(r["problems"] == 4 and r["info/in_rollout"] == 1.0 for r in evals)
    assert all(r["reward_info/turns"] == 2.0 for r in steps), "the episodes did not take their two turns"
