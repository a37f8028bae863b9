"""A resumed trainer keeps the checkpoint's weights, moments and schedule position, and takes this
run's optimiser settings: the README says a resume may change the learning rate."""

from __future__ import annotations

import math

import pytest

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer, TrainerConfig
from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state
from tiny import make_samples


def _trainer(model: str, algo: AlgoConfig, **cfg) -> PolicyTrainer:
    return PolicyTrainer(model, TrainerConfig(samples_per_step=8, **cfg), algo, dp=DataParallel(None),
                         temperature=1.0, max_new_tokens=8, total_steps=10)


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_a_resume_trains_at_this_runs_learning_rate_from_the_checkpoints_schedule_step(tmp_path, advantage, tiny_model):
    """The loaded param groups used to carry the old run's lr (and the scheduler its base_lrs): a
    run resumed with trainer.lr=1e-5 trained on at 1e-3 and logged lr=0.001."""
    model = tiny_model
    algo = AlgoConfig(advantage=advantage, samples_per_prompt=2 if advantage == "grpo" else 1)
    group = algo.samples_per_prompt
    old = _trainer(model, algo, lr=1e-3, critic_lr=1e-3, weight_decay=0.0, schedule="cosine", warmup_steps=1)
    for step in range(3):
        old.train_step(make_samples(step, 8, group=group), step)
    save_trainer_state(old, tmp_path / "ckpt")

    new = _trainer(model, algo, lr=1e-5, critic_lr=2e-4, weight_decay=0.05, schedule="cosine", warmup_steps=1)
    assert load_trainer_state(new, tmp_path / "ckpt") == 3
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 8))  # lr_lambda at step 3 of 10, one warm-up step
    assert new.scheduler.get_last_lr()[0] == pytest.approx(1e-5 * cosine)
    assert new.optimizer.param_groups[0]["weight_decay"] == 0.05
    assert new.optimizer.state  # the moments are the checkpoint's
    if new.critic_optimizer is not None:
        assert new.critic_optimizer.param_groups[0]["lr"] == 2e-4
    metrics = new.train_step(make_samples(3, 8, group=group), 3)
    assert metrics["lr"] == pytest.approx(1e-5 * cosine)
