"""The trainer's wiring of ``meshrl.algos`` and its optimisers on a real (tiny) model: importance
weights see the trainer's recomputed log-probs, group statistics see every sample's own reward, the
LR schedule ends where its doc says, the critic gets the configured weight decay, a mini-batch with
nothing to train takes no optimiser step, the step metrics mean what docs/algorithms.md says, and a
checkpoint before the first update changes nothing.

Complements ``test_trainer_fsdp`` (dp and micro-batch invariance) with checks that a knob really
does what docs/algorithms.md and the config docs say once it goes through ``PolicyTrainer``.
"""

from __future__ import annotations


import pytest
import torch

from meshrl import algos
from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors import train_step
from meshrl.actors.policy_trainer import PolicyTrainer, lr_lambda
from meshrl.actors.train_step import PolicyUpdater, build_step_batch
from meshrl.modeling import ValueModel, load_causal_lm, response_logprobs
from meshrl.queues import Sample

from tiny import make_samples, model_dir as tiny_model_dir

torch.set_num_threads(1)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", ["truncated_token", "masked_seq"])
def test_importance_weights_correct_the_trainer_policy_back_to_the_behaviour_policy(tmp_path, policy_loss, mode, tiny_model):
    """w = π_old/π_behav with π_old the trainer's own log-probs (docs: "Off-policy correction"):
    the engine's log-probs differ from the trainer's, so the weights are not all 1."""
    model_dir = tiny_model
    clip = {"clip_low": 3e-4, "clip_high": 4e-4} if policy_loss == "gspo" else {}
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2, policy_loss=policy_loss, importance_sampling=mode,
                      is_cap=1.5, is_low=0.05, is_high=20.0, **clip)
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


@pytest.mark.parametrize("kl_in_reward", [False, True])
@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_a_sample_with_no_valid_token_keeps_its_own_reward_in_its_group(advantage, kl_in_reward):
    """The trainer read each sample's reward back from its last valid token: an episode that failed
    before the policy played (all-0 loss mask, envs/base.py) or an empty response has none, so it
    counted as reward 0 and shifted its group-mates' advantages."""

    def sample(group: int, response: list[int], reward: float, loss_mask: list[int] | None = None) -> Sample:
        return Sample(prompt_id=group, group_id=group, group_size=4, prompt_ids=[3, 4, 5], response_ids=response,
                      behavior_logprobs=[-1.0] * len(response), ref_logprobs=[-1.5] * len(response),
                      behavior_version=0, reward=reward, loss_mask=loss_mask)

    samples = [sample(0, [7, 8, 9], 1.0), sample(0, [7, 8], 0.0), sample(0, [9, 9, 9, 9], 0.0),
               sample(0, [7, 7], -1.0, loss_mask=[0, 0]),  # a failed episode, penalised
               sample(1, [], 0.5), sample(1, [8], 0.0), sample(1, [8, 9], 1.0)]  # an empty response
    batch = build_step_batch(samples, pad_id=0)
    algo = AlgoConfig(advantage=advantage, samples_per_prompt=4, kl_coef=0.1 if kl_in_reward else 0.0,
                      kl_in_reward=kl_in_reward, kl_estimator="k1")
    # advantages() never runs the models
    updater = PolicyUpdater(torch.nn.Identity(), None, algo, temperature=1.0, max_new_tokens=8,
                            tokens_per_microbatch=64)
    adv, _ = updater.advantages(batch, None)  # [B, R], one value per row

    valid_tokens = torch.tensor([3.0, 2, 4, 0, 0, 1, 2])
    # k1 per valid token: log π_behav − log π_ref = 0.5, folded into the reward as −0.1 · 0.5
    penalty = 0.05 * valid_tokens if kl_in_reward else torch.zeros(7)
    seq_rewards = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.5, 0.0, 1.0]) - penalty
    fn = algos.grpo_advantages if advantage == "grpo" else algos.rloo_advantages
    torch.testing.assert_close(adv[:, 0], fn(seq_rewards, batch.group_ids))
    assert (adv == adv[:, :1]).all()


def test_cosine_schedule_reaches_min_lr_at_the_last_step():
    """``schedule`` doc: "cosine decay to min_lr_ratio × lr at the last step" (steps 0..total-1)."""
    cfg = TrainerConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    fn = lr_lambda(cfg, total_steps=10)
    lrs = [fn(step) for step in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up, then the cosine starts at the peak
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_critic_gets_the_configured_weight_decay(tmp_path, tiny_model):
    """``trainer.weight_decay = 0`` holds for the critic too: its backbone, whose gradient is exactly
    zero on the first step (the value head starts at 0), must not move at all."""
    model_dir = tiny_model
    cfg = TrainerConfig(samples_per_step=8, critic_lr=0.1, weight_decay=0.0)
    t = PolicyTrainer(model_dir, cfg, AlgoConfig(advantage="gae"), dp=DataParallel(None), temperature=1.0,
                      max_new_tokens=8, total_steps=1)
    before = {k: v.detach().clone() for k, v in t.critic.backbone.named_parameters()}
    t.train_step(make_samples(0, 8), 0)
    assert t.critic.head.weight.abs().max() > 0  # the critic did train
    for k, v in t.critic.backbone.named_parameters():
        assert torch.equal(v.detach(), before[k]), k


def test_saving_before_the_first_update_does_not_change_training(tmp_path, tiny_model):
    """A checkpoint written before any optimiser step (step 0, or after only skipped updates) must
    neither touch the live optimiser nor resume into a different one: DCP's ``get_state_dict``
    would otherwise run a dummy AdamW step, and Adam's bias correction would count one step too
    many from then on."""
    from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state

    model_dir = tiny_model
    cfg = TrainerConfig(samples_per_step=8, lr=3e-3, critic_lr=3e-3)
    algo = AlgoConfig(advantage="gae")

    def make() -> PolicyTrainer:
        return PolicyTrainer(model_dir, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8,
                             total_steps=2)

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
                             max_new_tokens=8, total_steps=2)

    save_trainer_state(make(2, 32, "gae"), tmp_path / "gae2")
    with pytest.raises(ValueError, match=r"other models .*policy: 0 parameters missing .*not in this trainer"):
        load_trainer_state(make(1, 32, "gae"), tmp_path / "gae2")  # a deeper model's
    with pytest.raises(ValueError, match=r"other models .*critic: 0 parameters missing .* not in this trainer"):
        load_trainer_state(make(2, 32, "grpo"), tmp_path / "gae2")  # a critic this trainer has not
    with pytest.raises(CheckpointException) as info:
        load_trainer_state(make(2, 64, "gae"), tmp_path / "gae2")  # same names, other shapes
    assert any("Size mismatch" in note and "dp rank 0/1" in note for note in info.value.__notes__)
    assert load_trainer_state(make(2, 32, "gae"), tmp_path / "gae2") == 0  # its own kind loads


def test_a_minibatch_with_nothing_to_train_takes_no_optimiser_step(tmp_path, tiny_model):
    """Every group uniform and dropped: the gradient is zero, but an AdamW step would still move
    the policy by its weight decay and count a step in its bias correction. docs/algorithms.md:
    the step trains on fewer rows, here on none."""
    model_dir = tiny_model
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2, drop_uniform_groups=True)
    cfg = TrainerConfig(samples_per_step=8, minibatches_per_step=2, lr=1e-2, weight_decay=0.1)
    t = PolicyTrainer(model_dir, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8, total_steps=2)
    before = {k: v.detach().clone() for k, v in t.policy.named_parameters()}
    m = t.train_step(make_samples(0, 8, group=2, reward=1.0), 0)
    assert m["uniform_group_frac"] == 1.0 and m["empty_minibatches"] == 2
    assert m["skipped_updates"] == 0 and m["skipped_steps_in_a_row"] == 0  # not a NaN skip
    assert m["grad_norm"] == 0.0 and m["loss"] == 0.0
    for k, v in t.policy.named_parameters():
        assert torch.equal(v.detach(), before[k]), k
    assert not t.optimizer.state  # AdamW never stepped: no moments, no step count


def test_grad_norm_is_the_mean_over_the_steps_updates(tmp_path, monkeypatch, tiny_model):
    """docs/algorithms.md (step metrics): ``grad_norm`` is the mean over the mini-batches × epochs;
    it used to be the last mini-batch's alone."""
    norms: list[float] = []

    def recording(params, max_norm):
        norms.append(clip(params, max_norm))
        return norms[-1]

    clip = train_step.clip_grad_norm
    monkeypatch.setattr(train_step, "clip_grad_norm", recording)
    model_dir = tiny_model
    cfg = TrainerConfig(samples_per_step=8, minibatches_per_step=2, ppo_epochs=2, lr=1e-2)
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2)
    t = PolicyTrainer(model_dir, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8, total_steps=1)
    m = t.train_step(make_samples(0, 8, group=2), 0)
    assert len(norms) == 4 and len(set(norms)) == 4  # not vacuous: the updates' norms differ
    assert m["grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-12)


def test_value_mean_is_the_critics_current_prediction(tmp_path, tiny_model):
    """docs/algorithms.md: ``value_mean`` is the critic's prediction while it trains (value_loss's
    metric); the step overwrote it with the old values (the critic before the step), which differ
    from it once the critic has taken an update."""
    model_dir = tiny_model
    torch.manual_seed(0)
    policy, critic = load_causal_lm(model_dir).train(), ValueModel.from_pretrained(model_dir).train()
    seen: list[tuple[float, int]] = []  # (sum over the valid tokens, their count) per training forward

    def record(module, args, values):
        if torch.is_grad_enabled():  # the old values come from a no-grad pass
            mask = args[0].response_mask > 0
            seen.append((float(values.detach()[mask].sum()), int(mask.sum())))

    critic.register_forward_hook(record)
    updater = PolicyUpdater(policy, critic, AlgoConfig(advantage="gae"), temperature=1.0, max_new_tokens=8,
                            tokens_per_microbatch=10_000, ppo_epochs=2)
    m = updater.step(build_step_batch(make_samples(0, 8), pad_id=0), max_grad_norm=1e9,
                     policy_optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                     critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=0.05))
    expected = sum(total for total, _ in seen) / sum(count for _, count in seen)
    # the value head starts at 0, so the old values are 0: only the second epoch's predictions are not
    assert len(seen) == 2 and seen[0][0] == 0.0 and abs(expected) > 1e-3
    assert m["value_mean"] == pytest.approx(expected, rel=1e-5)


def test_truncated_importance_sampling_without_a_cap_is_refused_by_the_config():
    """``is_cap=None`` passed validation with a truncated_* mode and failed only at trainer start."""
    for mode in ("truncated_token", "truncated_seq"):
        with pytest.raises(ValueError, match=rf"importance_sampling={mode}.*set algo.is_cap > 0"):
            AlgoConfig(importance_sampling=mode, is_cap=None)
    AlgoConfig(policy_loss="decoupled_ppo", is_cap=None)  # decoupled PPO without its drop cap: fine
    AlgoConfig(importance_sampling="masked_token", is_cap=None)  # masked modes do not read it


def test_a_step_with_shared_prompts_trains_as_whole_rows_do(tiny_model):
    """trainer.share_prompts changes how the forward runs, not what the step does: the same metrics
    and the same weights after it as every row run whole (GRPO groups of 4, rows of mixed lengths)."""
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=4)
    samples = sorted(make_samples(0, 16, group=4), key=lambda s: s.group_id)
    for s in samples:  # a group's completions share its prompt, as the engine makes them
        s.prompt_ids = next(x.prompt_ids for x in samples if x.group_id == s.group_id)
    runs = []
    for share in (True, False):
        t = PolicyTrainer(tiny_model, TrainerConfig(samples_per_step=16, share_prompts=share, optimizer="sgd", lr=0.1), algo,
                          dp=DataParallel(None), temperature=1.0, max_new_tokens=8, total_steps=1, dtype=torch.float64)
        assert t.updater.share_prompts is share
        runs.append((t.train_step(samples, 0), {n: p.detach().clone() for n, p in t.policy.named_parameters()}))
    (shared, w_shared), (whole, w_whole) = runs
    assert shared["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy", "ratio_mean", "clip_frac_low", "clip_frac_high"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-9), key
    for name, w in w_shared.items():
        torch.testing.assert_close(w, w_whole[name], rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_shared_prompts_by_default_on_the_cpu_only():
    """None: on for CPU trainers (compiled or not), off on CUDA (measured slower there), and off under
    activation checkpointing (no cache); true or false decides, but checkpointing still rules it out."""
    cpu, cuda = DataParallel(None), DataParallel(None, "cpu")
    cuda.device = torch.device("cuda")  # (only the device type is read)
    resolve = PolicyTrainer._shares_prompts
    assert resolve(TrainerConfig(), cpu) and resolve(TrainerConfig(compile=True), cpu)
    assert not resolve(TrainerConfig(), cuda) and not resolve(TrainerConfig(compile=True), cuda)
    assert resolve(TrainerConfig(share_prompts=True), cuda) and resolve(TrainerConfig(compile=True, share_prompts=True), cuda)
    assert not resolve(TrainerConfig(share_prompts=False), cpu)
    assert not resolve(TrainerConfig(activation_checkpointing=True, share_prompts=True), cpu)
