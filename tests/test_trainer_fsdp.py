"""The trainer's FSDP2 math on real gloo process groups: dp=2 ≡ dp=1 (also when mini-batches
have nothing to train), micro-batch invariance, exact resume from a sharded checkpoint (same and
different dp size), HF export, NaN skipping.

Two ``torch.multiprocessing`` workers run a ``PolicyTrainer`` each (FSDP2 over a 2-rank CPU
DeviceMesh); the test process runs the dp = 1 reference (plain modules) and compares.

The invariants are checked in float64 (``PolicyTrainer(dtype=)``) with the bounds that
``bounds.py`` derives from what may legitimately differ.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import msgspec
import pytest
import torch

from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import NonFiniteStepsError, PolicyTrainer
from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state
from meshrl.mesh.distributed import free_port
from processes import run_processes
from bounds import DTYPE, GRAD_ATOL, METRIC_TOL, PARAM_ATOL
from tiny import make_samples, model_dir as tiny_model_dir

torch.set_num_threads(1)
STEPS = 5
CKPT_AFTER = 3
# GAE (critic) + decoupled PPO + 2 mini-batches: every cross-rank path (gathered values and
# proximal log-probs, whitening on the full batch, shuffled mini-batches, padding micro-batches).
ALGO = AlgoConfig(advantage="gae", policy_loss="decoupled_ppo", entropy_coef=0.01)
CFG = TrainerConfig(samples_per_step=14, minibatches_per_step=2, tokens_per_microbatch=48, lr=3e-3, critic_lr=3e-3)


def _trainer(model_dir: str, dp: DataParallel, cfg: TrainerConfig = CFG, algo: AlgoConfig = ALGO, *,
             total_steps: int = STEPS) -> PolicyTrainer:
    return PolicyTrainer(model_dir, cfg, algo, dp=dp, temperature=1.0, max_new_tokens=8, total_steps=total_steps,
                         dtype=DTYPE)


def _params(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.policy_state().items()}


def _run(t: PolicyTrainer, steps: range) -> tuple[list[dict], list[dict]]:
    metrics, params = [], []
    for s in steps:
        metrics.append(t.train_step(make_samples(s, CFG.samples_per_step), s))
        params.append(_params(t))
    return metrics, params


def _rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        dp = DataParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
        t = _trainer(model_dir, dp)
        first, params = _run(t, range(CKPT_AFTER))
        save_trainer_state(t, Path(out) / "ckpt")
        rest, more = _run(t, range(CKPT_AFTER, STEPS))
        t.save_hf(Path(out) / "hf")
        resumed = _trainer(model_dir, dp)
        load_trainer_state(resumed, Path(out) / "ckpt")
        again, again_params = _run(resumed, range(CKPT_AFTER, STEPS))
        if rank == 0:
            torch.save({"metrics": first + rest, "params": params + more, "resumed_metrics": again,
                        "resumed_params": again_params}, Path(out) / "dp2.pt")
    finally:
        dist.destroy_process_group()


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max parameter difference {worst} > {atol}"
    return worst


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """5 steps at dp=2 (checkpoint after 3, resumed copy of steps 4-5, HF export) in 2 processes."""
    import json

    root = tmp_path_factory.mktemp("fsdp")
    model_dir = tiny_model_dir(root / "model")
    generation = Path(model_dir) / "generation_config.json"  # sampling defaults the export must keep
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "do_sample": True, "temperature": 0.7,
                                     "eos_token_id": [1, 2]}))  # transformers 5.0 refuses a temperature without do_sample
    run_processes(_rank_main, (free_port(), model_dir, str(root)), 2, timeout_s=300, what="the dp=2 trainer ranks")
    return model_dir, root, torch.load(root / "dp2.pt")


@pytest.fixture(scope="module")
def dp1_run(dp2_run):
    model_dir = dp2_run[0]
    t = _trainer(model_dir, DataParallel(None))
    metrics, params = _run(t, range(STEPS))
    return t, metrics, params


@pytest.mark.slow  # the dp=2 fixture spawns two processes (10-30 s)
def test_dp2_matches_dp1_loss_and_parameter_trajectory(dp2_run, dp1_run):
    _, _, dp2 = dp2_run
    _, metrics, params = dp1_run
    for step in range(STEPS):
        for key in ("loss", "grad_norm", "critic_grad_norm", "value_error", "ratio_max", "entropy", "num_tokens",
                    "advantage_mean", "value_mean"):
            a, b = dp2["metrics"][step][key], metrics[step][key]
            assert math.isclose(a, b, **METRIC_TOL), f"step {step} {key}: dp2 {a} vs dp1 {b}"
        _close(dp2["params"][step], params[step], atol=PARAM_ATOL)
    # the run really trained: parameters moved far more than the tolerance
    start = _params(_trainer(dp2_run[0], DataParallel(None)))
    assert max((params[-1][k] - start[k]).abs().max().item() for k in start) > 1e-3


@pytest.mark.slow  # the dp=2 fixture spawns two processes (10-30 s)
def test_dp2_resume_from_sharded_checkpoint_is_exact(dp2_run):
    dp2 = dp2_run[2]
    for i, step in enumerate(range(CKPT_AFTER, STEPS)):
        assert dp2["resumed_metrics"][i]["loss"] == dp2["metrics"][step]["loss"]
        _close(dp2["resumed_params"][i], dp2["params"][step], atol=0.0)


@pytest.mark.slow  # the dp=2 fixture spawns two processes (10-30 s)
def test_dp1_resumes_a_dp2_checkpoint(dp2_run, dp1_run):
    model_dir, root, dp2 = dp2_run
    t = _trainer(model_dir, DataParallel(None))
    assert load_trainer_state(t, root / "ckpt") == CKPT_AFTER
    _close(_params(t), dp2["params"][CKPT_AFTER - 1], atol=0.0)  # DCP reshards the FSDP2 shards exactly
    metrics, params = _run(t, range(CKPT_AFTER, STEPS))
    for i, step in enumerate(range(CKPT_AFTER, STEPS)):
        assert math.isclose(metrics[i]["loss"], dp1_run[1][step]["loss"], **METRIC_TOL)
        _close(params[i], dp1_run[2][step], atol=PARAM_ATOL)


@pytest.mark.slow  # the dp=2 fixture spawns two processes (10-30 s)
def test_dp2_hf_export_loads_and_gives_the_same_logits(dp2_run, dp1_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, root, _ = dp2_run
    exported = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=DTYPE).eval()
    assert AutoTokenizer.from_pretrained(root / "hf").pad_token_id == exported.config.pad_token_id
    trained = dp1_run[0].policy.eval()
    ids = torch.tensor([[3, 10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        a, b = exported(input_ids=ids).logits, trained(input_ids=ids).logits
    trained.train()
    # the export holds dp=2's weights, which differ from dp=1's by at most PARAM_ATOL
    assert (a - b).abs().max().item() <= 1e-4, "exported dp=2 checkpoint disagrees with the dp=1 trainer"
    # the model's generation config, not the default one a model built from config.json gets
    assert (exported.generation_config.temperature, exported.generation_config.eos_token_id) == (0.7, [1, 2])


def test_the_trainer_computes_log_probs_and_values_without_dropout(tmp_path):
    """The policy and critic train in train mode: with a config's dropout (attention_dropout here)
    every recomputed log-prob was noisy, so the importance ratio and the KL were not 1 and 0 for an
    unchanged policy (the engine and the reference run without dropout)."""
    import json

    model_dir = tiny_model_dir(tmp_path / "model", layers=1)
    config = Path(model_dir) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "attention_dropout": 0.5}))
    t = _trainer(model_dir, DataParallel(None), algo=AlgoConfig(advantage="gae"))
    assert t.policy.training and t.policy.config.attention_dropout == 0.5  # the config as saved, unchanged
    from meshrl.modeling import pack

    ids = torch.tensor([[3, 10, 11, 12, 13, 14, 15]])
    packed = pack([[3, 10, 11]], [[12, 13, 14, 15]], pad_id=0)
    with torch.no_grad():
        assert torch.equal(t.policy(input_ids=ids).logits, t.policy(input_ids=ids).logits)
        assert torch.equal(t.critic(packed), t.critic(packed))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algo", [ALGO, AlgoConfig(advantage="grpo", samples_per_prompt=2, aggregation="seq_mean_token_mean")])
def test_microbatch_split_and_activation_checkpointing_give_the_same_gradients(tmp_path, algo, tiny_model):
    model_dir = tiny_model
    runs = []
    # one micro-batch; about one row each; about one row each with activations recomputed
    for budget, recompute in ((10_000, False), (12, False), (12, True)):
        cfg = TrainerConfig(samples_per_step=12, tokens_per_microbatch=budget, lr=0.0, critic_lr=0.0,
                            activation_checkpointing=recompute)
        t = _trainer(model_dir, DataParallel(None), cfg, algo)
        m = t.train_step(make_samples(0, 12, group=2), 0)
        runs.append((_grads(t.policy), _grads(t.critic) if t.critic is not None else {}, m["loss"]))
    base = runs[0]
    assert any(g.abs().max() > 0 for g in base[0].values())
    for other in runs[1:]:
        assert math.isclose(base[2], other[2], **METRIC_TOL)
        for a, b in ((base[0], other[0]), (base[1], other[1])):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.allclose(a[k], b[k], rtol=0, atol=GRAD_ATOL), k


def test_nan_loss_skips_the_update_and_repeated_ones_stop(tmp_path, tiny_model):
    model_dir = tiny_model
    cfg = TrainerConfig(samples_per_step=8, max_skipped_steps=2)
    t = _trainer(model_dir, DataParallel(None), cfg, AlgoConfig(advantage="grpo", samples_per_prompt=2))
    before = _params(t)
    good = t.train_step(make_samples(0, 8, group=2), 0)
    assert good["skipped_updates"] == 0 and good["skipped_steps_in_a_row"] == 0
    moved = _params(t)
    bad = t.train_step(make_samples(1, 8, group=2, reward=float("inf")), 1)
    assert bad["skipped_updates"] == 1 and bad["skipped_steps_in_a_row"] == 1
    assert not math.isfinite(bad["loss"])
    _close(_params(t), moved, atol=0.0)  # the NaN step changed nothing
    assert max((moved[k] - before[k]).abs().max().item() for k in before) > 0
    with pytest.raises(NonFiniteStepsError, match="2 train steps in a row.*max_skipped_steps=2"):
        t.train_step(make_samples(2, 8, group=2, reward=float("nan")), 2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_dropping_uniform_groups_equals_training_without_them(tmp_path, aggregation, tiny_model):
    """drop_uniform_groups: a batch with all-right and all-wrong groups trains exactly like the
    batch of its informative groups alone (same loss, same parameters after the step), whatever
    the normaliser: dropped rows count in neither the token nor the sequence count."""
    model_dir = tiny_model
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2, drop_uniform_groups=True, aggregation=aggregation)
    cfg = TrainerConfig(samples_per_step=8, tokens_per_microbatch=64, lr=3e-3)
    samples = make_samples(0, 8, group=2)
    for s, r in zip(samples, [1, 1, 0, 1, 0, 0, 1, 0]):  # groups: uniform, mixed, uniform, mixed
        s.reward = float(r)
    mixed = [s for s in samples if s.group_id in (1, 3)]
    full = _trainer(model_dir, DataParallel(None), cfg, algo, total_steps=2)
    part = _trainer(model_dir, DataParallel(None), msgspec.structs.replace(cfg, samples_per_step=4), algo, total_steps=2)
    m_full, m_part = full.train_step(samples, 0), part.train_step(mixed, 0)
    assert m_full["uniform_group_frac"] == 0.5 and m_part["uniform_group_frac"] == 0.0
    assert math.isclose(m_full["loss"], m_part["loss"], **METRIC_TOL) and m_full["loss"] != 0.0
    _close(_params(full), _params(part), atol=PARAM_ATOL)
    with pytest.raises(ValueError, match="drop_uniform_groups"):
        AlgoConfig(advantage="gae", drop_uniform_groups=True)


# GRPO dropping uniform groups, 4 mini-batches of 2 rows: a mini-batch can be empty on one rank
# (its row dropped) but not on the other, or empty everywhere (its update skipped on every rank).
UNIFORM_ALGO = AlgoConfig(advantage="grpo", samples_per_prompt=2, drop_uniform_groups=True)
UNIFORM_CFG = TrainerConfig(samples_per_step=8, minibatches_per_step=4, tokens_per_microbatch=48, lr=1e-2,
                            weight_decay=0.1)


def _mostly_uniform_batches() -> list[list]:
    """One step with a single informative group (2 trainable rows of 8), one with none."""
    mostly = make_samples(0, 8, group=2)
    for s, r in zip(mostly, [1, 1, 0, 0, 1, 1, 0, 1]):
        s.reward = float(r)
    return [mostly, make_samples(1, 8, group=2, reward=1.0)]


def _mostly_uniform_rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        t = _trainer(model_dir, DataParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))), UNIFORM_CFG, UNIFORM_ALGO)
        metrics = [t.train_step(batch, step) for step, batch in enumerate(_mostly_uniform_batches())]
        params = _params(t)
        if rank == 0:
            torch.save({"metrics": metrics, "params": params}, Path(out) / "dp2_uniform.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two processes (10-30 s)
def test_dp2_skips_the_updates_of_empty_minibatches_like_dp1(tmp_path, tiny_model_2l):
    """A mini-batch with no trainable token skips its optimiser step; the decision reads the global
    token count, so every rank takes it alike (a rank-local one would desynchronise the collectives
    or the weights) and dp=2 trains exactly like dp=1."""
    model_dir = tiny_model_2l
    run_processes(_mostly_uniform_rank_main, (free_port(), model_dir, str(tmp_path)), 2, timeout_s=300,
                  what="the dp=2 trainer ranks")
    dp2 = torch.load(tmp_path / "dp2_uniform.pt")
    t = _trainer(model_dir, DataParallel(None), UNIFORM_CFG, UNIFORM_ALGO)
    start = _params(t)
    metrics = [t.train_step(batch, step) for step, batch in enumerate(_mostly_uniform_batches())]
    assert 2 <= metrics[0]["empty_minibatches"] < 4 and metrics[1]["empty_minibatches"] == 4
    for a, b in zip(dp2["metrics"], metrics):
        for key in ("empty_minibatches", "skipped_updates", "loss", "grad_norm"):
            assert math.isclose(a[key], b[key], **METRIC_TOL), f"{key}: dp2 {a[key]} vs dp1 {b[key]}"
    _close(dp2["params"], _params(t), atol=PARAM_ATOL)
    assert max((_params(t)[k] - start[k]).abs().max().item() for k in start) > 1e-3  # the first step trained
