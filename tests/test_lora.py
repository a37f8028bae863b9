"""LoRA on the policy (``trainer.lora``): adapters train alone, every export carries merged weights.

In one process (dp = 1): training starts from the base model exactly, moves only the adapters,
and the merged export (state dict, HF checkpoint, colocated hand-over into a TorchEngine) computes
what the adapted policy computes; the in-trainer reference is the base model. On two gloo ranks
(FSDP2): dp = 2 trains like dp = 1, and the shard-by-shard merge that the distributed push sends
equals the gathered merge. Through the pipeline (Ray, distributed transport) at η = 0: the
engine's behaviour log-probs match the trainer's adapted policy at every step.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.lora import LoRAConfig, LoRALinear, apply_lora
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.mesh.distributed import free_port
from processes import run_processes
from bounds import METRIC_TOL, param_atol
from tiny import make_samples

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the reward function travels to Ray workers
torch.set_num_threads(1)
LORA = LoRAConfig(rank=4, alpha=8.0)
CFG = TrainerConfig(samples_per_step=14, minibatches_per_step=2, tokens_per_microbatch=48, lr=3e-2, lora=LORA)
ALGO = AlgoConfig(advantage="grpo", samples_per_prompt=2, policy_loss="ppo")
STEPS = 3


def _trainer(model_dir: str, dp: DataParallel, cfg: TrainerConfig = CFG, algo: AlgoConfig = ALGO,
             dtype: torch.dtype = torch.float32) -> PolicyTrainer:
    """float64 where dp = 2 is compared with dp = 1 (bounds.py: why, and the bounds)."""
    return PolicyTrainer(model_dir, cfg, algo, dp=dp, temperature=1.0, max_new_tokens=8, total_steps=STEPS, dtype=dtype)


def _train(t: PolicyTrainer, steps: int = STEPS) -> list[dict]:
    return [t.train_step(make_samples(s, CFG.samples_per_step, group=2), s) for s in range(steps)]


IDS = torch.tensor([[3, 10, 11, 12, 13, 14, 15, 40, 41]])


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def model_dir(tiny_model_2l) -> str:
    return tiny_model_2l


def test_training_starts_at_the_base_model_and_moves_only_the_adapters(model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    t = _trainer(model_dir, DataParallel(None))
    adapted = [m for m in t.policy.modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    trained = [p for group in t.optimizer.param_groups for p in group["params"]]
    assert len(trained) == 2 * len(adapted) and all(p.requires_grad for p in trained)
    # B = 0: the merged export is the base model bit for bit, under the base model's names only
    start = t.policy_state()
    assert start.keys() == base.keys()
    assert all(torch.equal(start[k], base[k]) for k in base)

    metrics = _train(t)
    assert all(math.isfinite(m["loss"]) and m["skipped_updates"] == 0 for m in metrics)
    live = dict(t.policy.named_parameters())
    for name, tensor in base.items():
        if name in live:  # lm_head.weight is tied to the embedding: not a parameter of its own
            assert torch.equal(live[name], tensor), f"{name}: a frozen base weight moved"
    merged = t.policy_state()
    moved = [k for k in base if not torch.equal(merged[k], base[k])]
    assert len(moved) == len(adapted) and all(k.endswith("_proj.weight") for k in moved)
    # the merged weights compute what the adapted policy computes
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    plain.load_state_dict(merged)
    t.policy.eval()
    torch.testing.assert_close(_logits(plain), _logits(t.policy), rtol=1e-5, atol=1e-5)
    assert (_logits(plain) - _logits(AutoModelForCausalLM.from_pretrained(model_dir))).abs().max() > 1e-3

    # the HF export: a plain checkpoint of the base architecture, no adapter tensors, same logits
    t.save_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("lora" in k for k in exported.state_dict())
    torch.testing.assert_close(_logits(exported), _logits(t.policy), rtol=1e-5, atol=1e-5)
    # beside it the adapters alone, in PEFT's format (keys and config as peft writes them)
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "hf" / "adapter" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", LORA.rank, LORA.alpha)
    assert len(adapter) == 2 * 14 and "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in adapter
    live = dict(t.policy.named_parameters())
    torch.testing.assert_close(adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                               live["model.layers.0.self_attn.q_proj.lora_A"], rtol=0, atol=0)
    if importlib.util.find_spec("peft"):  # not a dependency; checked by hand with peft 0.21.2: max diff 0.0
        from peft import PeftModel

        with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "hf" / "adapter")
        torch.testing.assert_close(_logits(with_peft.eval()), _logits(t.policy), rtol=1e-5, atol=1e-5)


def test_the_in_trainer_reference_is_the_base_model_without_a_copy(model_dir):
    t = _trainer(model_dir, DataParallel(None), msgspec_replace(CFG, reference_in_trainer=True, minibatches_per_step=1),
                 AlgoConfig(advantage="grpo", samples_per_prompt=2, policy_loss="ppo", kl_coef=0.1))
    assert t.reference is not None and not isinstance(t.reference, torch.nn.Module)  # shares the policy's weights
    metrics = _train(t)
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the base model at step 0
    assert metrics[-1]["kl"] > 1e-6
    t.policy.eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.testing.assert_close(_logits(t.reference), _logits(base), rtol=1e-5, atol=1e-6)
    assert (_logits(t.policy) - _logits(base)).abs().max() > 1e-3  # the adapters are back on after it


def msgspec_replace(cfg, **changes):
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


def test_colocated_hand_over_writes_the_merged_weights_into_the_engine(model_dir):
    from meshrl.engines import TorchEngine, TorchEngineConfig
    from meshrl.reshard.colocated import LocalHandover

    t = _trainer(model_dir, DataParallel(None))
    engine = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(device="cpu", max_batch_size=4, max_seq_len=32))
    handover = LocalHandover(t.export_parameters, engine, layout_parameters=t.layout_parameters)
    for version in (1, 2):
        _train(t, 1)
        handover.write(engine, version)
        merged = t.policy_state()
        assert engine.version == version
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                     "model.embed_tokens.weight"):
            torch.testing.assert_close(engine.model.get_hf(name), merged[name], rtol=0, atol=0)


def test_bad_lora_settings_fail_naming_the_problem(model_dir):
    from meshrl.config import ConfigError, load_config
    from meshrl.pipeline import PipelineConfig

    with pytest.raises(ValueError, match="trainer.lora.rank must be >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="trainer.lora.alpha"):
        LoRAConfig(rank=4, alpha=float("nan"))
    with pytest.raises((ValueError, ConfigError), match="trainer.lora"):
        load_config(PipelineConfig, None, ["trainer.lora.target_modules=[]"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"match no linear layer .*'q_proj'"):
        apply_lora(model, LoRAConfig(rank=2, target_modules=("query_key_value",)))
    with pytest.raises(ValueError, match="exceeds model.layers.0.self_attn.q_proj"):
        apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoRAConfig(rank=64))
    # the tiny model ties lm_head to the embedding: an adapter there would reach no engine
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to another parameter .* leave 'lm_head' out"):
        apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoRAConfig(rank=2, target_modules=("q_proj", "lm_head")))


# ---- dp = 2 (FSDP2 over gloo) -------------------------------------------------------------------


def _rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshrl.reshard.layout import local_tensors, source_layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        t = _trainer(model_dir, DataParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))), dtype=torch.float64)
        metrics = _train(t)
        gathered = t.policy_state()  # full tensors, merged on rank 0
        # what the distributed push reads: each rank's merged rows, laid out as the base weights are;
        # the layout is read on rank 0 alone (as connect() does): a collective in it would hang here
        layout = source_layout(t.layout_parameters()) if rank == 0 else None
        dist.barrier()
        exported = list(t.export_parameters())
        assert rank != 0 or source_layout(exported) == layout
        local = local_tensors(exported)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in exported}
        # the colocated hand-over at dp = 2: every rank writes the whole merged model into its engine
        from meshrl.engines import TorchEngine, TorchEngineConfig
        from meshrl.reshard.colocated import LocalHandover

        engine = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(device="cpu", max_batch_size=2, max_seq_len=16))
        LocalHandover(t.export_parameters, engine, layout_parameters=t.layout_parameters).write(engine, 1)
        served = {n: engine.model.get_hf(n) for n in ("model.layers.0.self_attn.q_proj.weight",
                                                      "model.layers.1.mlp.down_proj.weight")}
        if rank == 0:
            torch.save({"metrics": metrics, "gathered": gathered, "full": full, "local0": local, "served": served},
                       Path(out) / "dp2.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes (10-30 s)
def test_dp2_lora_trains_like_dp1_and_its_sharded_merge_is_the_full_merge(model_dir, tmp_path):
    run_processes(_rank_main, (free_port(), model_dir, str(tmp_path)), 2, timeout_s=300, what="the dp=2 LoRA trainer ranks")
    dp2 = torch.load(tmp_path / "dp2.pt")
    t = _trainer(model_dir, DataParallel(None), dtype=torch.float64)
    metrics = _train(t)
    for step, (a, b) in enumerate(zip(dp2["metrics"], metrics, strict=True)):
        for key in ("loss", "grad_norm", "ratio_max", "num_tokens"):
            assert math.isclose(a[key], b[key], **METRIC_TOL), f"step {step} {key}: dp2 {a[key]} vs dp1 {b[key]}"
    merged = t.policy_state()
    for name, tensor in merged.items():
        # 3 steps x 2 mini-batches at lr = 3e-2 (bounds.py)
        torch.testing.assert_close(dp2["gathered"][name], tensor, rtol=0, atol=param_atol(6 * 3e-2))
    for name, tensor in dp2["served"].items():  # what the (float32) colocated engine serves: the merge, rounded
        torch.testing.assert_close(tensor, dp2["gathered"][name].to(tensor.dtype), rtol=0, atol=0)
    for name, tensor in dp2["full"].items():  # the shard-by-shard merge, gathered, is the full merge
        torch.testing.assert_close(tensor, dp2["gathered"][name], rtol=1e-6, atol=1e-6)
        rows = dp2["local0"][name].shape[0]
        torch.testing.assert_close(dp2["local0"][name], tensor[:rows], rtol=0, atol=0)


# ---- the pipeline ---------------------------------------------------------------------------------


def _digit_share(problem, completion: str) -> float:
    """Varied rewards for a random policy (the task's exact match would give 0 everywhere)."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


@pytest.mark.slow
def test_pipeline_with_lora_serves_the_adapted_policy_at_every_version(ray_cluster, tmp_path, model_dir):
    from meshrl.config import load_config
    from meshrl.pipeline import Pipeline, PipelineConfig

    cfg = load_config(PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={tmp_path / 'run'}", "run.total_steps=3", "run.eval_every=0",
        "run.progress=false", "task.digits=1", "task.num_test=8", "algo=grpo", "algo.samples_per_prompt=2",
        "queue.max_staleness=0", "trainer.samples_per_step=8", "rollout.prompts_per_request=2",
        "rollout.requests_in_flight=2", "rollout.max_new_tokens=3", "trainer.lr=3e-2", "trainer.lora.rank=4",
        "reward.num_workers=0",  # the rollout worker scores: one process fewer
    ])
    summary = asyncio.run(Pipeline(cfg, reward=_digit_share).run())
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert [s["version"] for s in steps] == [1, 2, 3] and all(s["staleness_max"] == 0 for s in steps)
    # at η = 0 the engine generated with exactly the trainer's adapted policy: ratios are 1
    for s in steps:
        assert abs(s["ratio_max"] - 1) < 1e-3 and abs(s["ratio_mean"] - 1) < 1e-4, s
    final = AutoModelForCausalLM.from_pretrained(summary["checkpoint"]).state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert not any("lora" in k for k in final)
    assert max((final[k] - base[k]).abs().max().item() for k in base) > 1e-3  # the run trained
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted


def test_a_lora_checkpoint_resumes_exactly_and_refuses_another_adapter_shape(model_dir, tmp_path):
    import msgspec

    from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state
    from meshrl.config import ConfigError, load_config
    from meshrl.pipeline import PipelineConfig
    from meshrl.pipeline.checkpoint import RunState, check_fingerprint, run_fingerprint

    t = _trainer(model_dir, DataParallel(None))
    _train(t, 2)
    save_trainer_state(t, tmp_path / "ckpt")
    from torch.distributed.checkpoint import FileSystemReader

    saved = [k for k in FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
             if k.startswith("policy.")]
    assert len(saved) == 2 * 14 and all(".lora_" in k for k in saved)  # the adapters, not the frozen base
    on = t.train_step(make_samples(2, CFG.samples_per_step, group=2), 2)
    resumed = _trainer(model_dir, DataParallel(None))
    assert load_trainer_state(resumed, tmp_path / "ckpt") == 2
    again = resumed.train_step(make_samples(2, CFG.samples_per_step, group=2), 2)
    assert again["loss"] == on["loss"]
    merged, merged_again = t.policy_state(), resumed.policy_state()
    assert all(torch.equal(merged[k], merged_again[k]) for k in merged)

    def config(*extra: str) -> PipelineConfig:
        return load_config(PipelineConfig, None, [f"model.path={model_dir}", *extra])

    # the fingerprint goes through the checkpoint's msgpack and back, as a resume reads it
    state = RunState(step=2, version=2, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"", fingerprint=run_fingerprint(config("trainer.lora.rank=4")))
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=RunState)
    check_fingerprint(tmp_path, state, config("trainer.lora.rank=4", "trainer.lr=1e-5"))  # the same adapters
    for other in ("trainer.lora.rank=8", "trainer.lora.alpha=4", "trainer.lora.rank=0",
                  "trainer.lora.target_modules=[q_proj]"):
        with pytest.raises(ConfigError, match="trainer.lora"):
            check_fingerprint(tmp_path, state, config("trainer.lora.rank=4", other))
