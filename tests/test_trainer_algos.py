"""The trainer's wiring of ``meshrl.algos`` and its optimisers on a real (tiny) model: importance
weights see the trainer's recomputed log-probs, the LR schedule ends where its doc says, the critic
gets the configured weight decay, and a checkpoint before the first update changes nothing.

Complements ``test_trainer_fsdp`` (dp and micro-batch invariance) with checks that a knob really
does what docs/algorithms.md and the config docs say once it goes through ``PolicyTrainer``.
"""

from __future__ import annotations


import pytest
import torch

from meshrl import algos
from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer, lr_lambda
from meshrl.actors.train_step import build_step_batch
from meshrl.modeling import load_causal_lm, response_logprobs

from test_trainer_fsdp import make_samples, tiny_model_dir

torch.set_num_threads(1)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", ["truncated_token", "masked_seq"])
def test_importance_weights_correct_the_trainer_policy_back_to_the_behaviour_policy(tmp_path, policy_loss, mode):
    """w = π_old/π_behav with π_old the trainer's own log-probs (docs: "Off-policy correction"):
    the engine's log-probs differ from the trainer's, so the weights are not all 1."""
    model_dir = tiny_model_dir(tmp_path / "model", layers=1)
    clip = {"clip_low": 3e-4, "clip_high": 4e-4} if policy_loss == "gspo" else {}
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2, policy_loss=policy_loss, importance_sampling=mode,
                      is_cap=1.5, is_low=0.05, is_high=20.0, **clip)  # fmt: skip
    cfg = TrainerConfig(samples_per_step=8, lr=0.0)
    samples = sorted(make_samples(0, 8, group=2), key=lambda s: s.group_id)
    t = PolicyTrainer(model_dir, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8, total_steps=1)
    m = t.train_step(samples, 0)

    batch = build_step_batch(samples, pad_id=t.pad_id)
    model = load_causal_lm(model_dir).train()
    with torch.no_grad():
        p = batch.packed
        logits = model(input_ids=p.input_ids, attention_mask=p.attention_mask, use_cache=False).logits
        old = response_logprobs(logits, p)  # [B, R] the trainer's π_old
    weights = algos.make_importance_sampling(mode, is_cap=1.5, is_low=0.05, is_high=20.0)
    expected = weights(old, batch.behavior_logprobs, batch.mask).metrics
    assert 0.0 < float(expected["is_weight_mean"]) < 0.95  # not vacuous: weights differ from 1, not all 0
    for key, value in expected.items():
        assert m[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


def test_cosine_schedule_reaches_min_lr_at_the_last_step():
    """``schedule`` doc: "cosine decay to min_lr_ratio × lr at the last step" (steps 0..total-1)."""
    cfg = TrainerConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    fn = lr_lambda(cfg, total_steps=10)
    lrs = [fn(step) for step in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up, then the cosine starts at the peak
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_critic_gets_the_configured_weight_decay(tmp_path):
    """``trainer.weight_decay = 0`` holds for the critic too: its backbone, whose gradient is exactly
    zero on the first step (the value head starts at 0), must not move at all."""
    model_dir = tiny_model_dir(tmp_path / "model", layers=1)
    cfg = TrainerConfig(samples_per_step=8, critic_lr=0.1, weight_decay=0.0)
    t = PolicyTrainer(model_dir, cfg, AlgoConfig(advantage="gae"), dp=DataParallel(None), temperature=1.0,
                      max_new_tokens=8, total_steps=1)  # fmt: skip
    before = {k: v.detach().clone() for k, v in t.critic.backbone.named_parameters()}
    t.train_step(make_samples(0, 8), 0)
    assert t.critic.head.weight.abs().max() > 0  # the critic did train
    for k, v in t.critic.backbone.named_parameters():
        assert torch.equal(v.detach(), before[k]), k


def test_saving_before_the_first_update_does_not_change_training(tmp_path):
    """A checkpoint written before any optimiser step (step 0, or after only skipped updates) must
    neither touch the live optimiser nor resume into a different one: DCP's ``get_state_dict``
    would otherwise run a dummy AdamW step, and Adam's bias correction would count one step too
    many from then on."""
    from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state

    model_dir = tiny_model_dir(tmp_path / "model", layers=1)
    cfg = TrainerConfig(samples_per_step=8, lr=3e-3, critic_lr=3e-3)
    algo = AlgoConfig(advantage="gae")

    def make() -> PolicyTrainer:
        return PolicyTrainer(model_dir, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8,
                             total_steps=2)  # fmt: skip

    def params(t: PolicyTrainer) -> dict[str, torch.Tensor]:
        named = [*t.policy.named_parameters(), *(("critic." + k, v) for k, v in t.critic.named_parameters())]
        return {k: v.detach().clone() for k, v in named}

    plain, saved = make(), make()
    save_trainer_state(saved, tmp_path / "ckpt")
    resumed = make()
    load_trainer_state(resumed, tmp_path / "ckpt")
    for t in (plain, saved, resumed):
        t.train_step(make_samples(0, 8), 0)
    want = params(plain)
    for t in (saved, resumed):
        got = params(t)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_a_checkpoint_of_other_models_is_refused_naming_what_differs(tmp_path):
    """DCP fills the template's keys and ignores the rest: a deeper model's checkpoint, or one with a
    critic, loaded into this trainer silently; a different width failed with only DCP's
    'CheckpointException ranks:dict_keys([0])'."""
    from torch.distributed.checkpoint.api import CheckpointException

    from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state

    def make(layers: int, hidden: int, advantage: str) -> PolicyTrainer:
        model_dir = tiny_model_dir(tmp_path / f"m{layers}-{hidden}", layers=layers, hidden=hidden)
        algo = AlgoConfig(advantage=advantage, samples_per_prompt=1 if advantage == "gae" else 2)
        return PolicyTrainer(model_dir, TrainerConfig(samples_per_step=8), algo, dp=DataParallel(None), temperature=1.0,
                             max_new_tokens=8, total_steps=2)  # fmt: skip

    save_trainer_state(make(2, 32, "gae"), tmp_path / "gae2")
    with pytest.raises(ValueError, match=r"other models .*policy: 0 parameters missing .*not in this trainer"):
        load_trainer_state(make(1, 32, "gae"), tmp_path / "gae2")  # a deeper model's
    with pytest.raises(ValueError, match=r"other models .*critic: 0 parameters missing .* not in this trainer"):
        load_trainer_state(make(2, 32, "grpo"), tmp_path / "gae2")  # a critic this trainer has not
    with pytest.raises(CheckpointException) as info:
        load_trainer_state(make(2, 64, "gae"), tmp_path / "gae2")  # same names, other shapes
    assert any("Size mismatch" in note and "dp rank 0/1" in note for note in info.value.__notes__)
    assert load_trainer_state(make(2, 32, "gae"), tmp_path / "gae2") == 0  # its own kind loads
