"""The CPU path's machine-dependent choices (meshrl.cpu): short rows attend through SDPA's math
path with the same numbers and gradients, ``MESHRL_CPU_BF16`` decides bf16 for the trainer and the
engine alike, and a compute process keeps its freed memory instead of page-faulting it back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from meshrl import cpu
from meshrl.actors import AlgoConfig, TrainerConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.modeling import pack, policy_logprobs

from tiny import hf_model, make_samples, qwen2

torch.set_num_threads(1)


@pytest.fixture
def bf16_env(monkeypatch):
    """Set MESHRL_CPU_BF16 for one test (native_bf16 reads it once per process: cache cleared)."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(cpu.BF16_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu.BF16_ENV, value)
        cpu.native_bf16.cache_clear()

    yield set_to
    cpu.native_bf16.cache_clear()


def test_short_rows_attend_through_the_math_path_with_the_same_logprobs_and_gradients():
    model = hf_model(qwen2(layers=2), seed=3).train()
    # right-padded rows of different lengths: the padding mask is what the math path must honour
    packed = pack([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[14, 15, 16, 17], [18], [19, 20]], pad_id=0)
    results = []
    for ctx in (cpu.attention_for(torch.device("cpu"), packed.input_ids.shape[1]), torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
        model.zero_grad(set_to_none=True)
        with ctx:
            logp, ent = policy_logprobs(model, packed)
        (logp.sum() + ent.sum()).backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (math_logp, math_grads), (flash_logp, flash_grads) = results
    assert torch.count_nonzero(math_logp) == int(packed.response_mask.sum())  # every response token has its log-prob
    torch.testing.assert_close(math_logp, flash_logp, rtol=1e-5, atol=1e-5)
    for a, b in zip(math_grads, flash_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_long_rows_and_other_devices_keep_the_default_kernels():
    assert isinstance(cpu.attention_for(torch.device("cpu"), cpu.SHORT_ROWS + 1), type(cpu.contextlib.nullcontext()))
    assert isinstance(cpu.attention_for(torch.device("cuda"), 8), type(cpu.contextlib.nullcontext()))


def test_meshrl_cpu_bf16_decides_for_trainer_and_engine_alike(bf16_env, tiny_model):
    from meshrl.engines import TorchEngine, TorchEngineConfig

    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2)

    def trainer(cfg: TrainerConfig = TrainerConfig(), dtype: torch.dtype = torch.float32) -> PolicyTrainer:
        return PolicyTrainer(tiny_model, cfg, algo, dp=DataParallel(None), temperature=1.0, max_new_tokens=8,
                             total_steps=1, dtype=dtype)

    model = hf_model(qwen2(layers=1))
    bf16_env("1")
    assert cpu.native_bf16() and trainer().cpu_autocast
    assert not trainer(dtype=torch.float64).cpu_autocast  # float64 master weights: the invariant tests' precision
    assert not trainer(TrainerConfig(cpu_bf16_autocast=False)).cpu_autocast  # an explicit choice wins
    assert TorchEngine.from_hf_model(model, config=TorchEngineConfig(device="cpu")).dtype == torch.bfloat16
    bf16_env("0")
    assert not cpu.native_bf16() and not trainer().cpu_autocast
    assert trainer(TrainerConfig(cpu_bf16_autocast=True)).cpu_autocast
    assert TorchEngine.from_hf_model(model, config=TorchEngineConfig(device="cpu")).dtype == torch.float32
    bf16_env("sometimes")
    with pytest.raises(ValueError, match="MESHRL_CPU_BF16='sometimes'"):
        cpu.native_bf16()
    bf16_env(None)  # by the CPU's flags: whatever they say, the same answer twice
    assert cpu.native_bf16() == cpu.native_bf16()


def test_a_bf16_train_step_learns_and_stays_close_to_float32(bf16_env, tiny_model):
    algo = AlgoConfig(advantage="grpo", samples_per_prompt=2)
    samples = sorted(make_samples(0, 8, group=2), key=lambda s: s.group_id)
    metrics = {}
    for value in ("0", "1"):
        bf16_env(value)
        t = PolicyTrainer(tiny_model, TrainerConfig(samples_per_step=8), algo, dp=DataParallel(None), temperature=1.0,
                          max_new_tokens=8, total_steps=1)
        metrics[value] = t.train_step(samples, 0)
    for m in metrics.values():
        assert m["skipped_updates"] == 0 and m["grad_norm"] > 0
    # bf16 rounds each matmul's inputs: the same step, within bf16's precision
    assert metrics["1"]["grad_norm"] == pytest.approx(metrics["0"]["grad_norm"], rel=5e-2)
    assert metrics["1"]["loss"] == pytest.approx(metrics["0"]["loss"], rel=5e-2, abs=1e-3)


def test_a_compute_process_keeps_freed_memory_instead_of_faulting_it_back(tiny_model):
    """Train steps on a thread (as an actor's method runs), one intra-op thread: with glibc's
    defaults each step's activations are fresh pages (faulted in again, step after step);
    ``compute_process`` keeps them."""
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt is glibc's")
    script = textwrap.dedent("""
        import resource, sys, threading, torch
        sys.path.insert(0, sys.argv[3])
        from meshrl.actors import AlgoConfig, TrainerConfig
        from meshrl.actors.data_parallel import DataParallel
        from meshrl.actors.policy_trainer import PolicyTrainer
        from meshrl.cpu import compute_process
        from tiny import make_samples
        compute_process(1) if sys.argv[1] == "on" else torch.set_num_threads(1)
        trainer = PolicyTrainer(sys.argv[2], TrainerConfig(), AlgoConfig(advantage="grpo", samples_per_prompt=4),
                                dp=DataParallel(None), temperature=1.0, max_new_tokens=8, total_steps=10)
        batches = [sorted(make_samples(step, 256, group=4), key=lambda s: s.group_id) for step in range(8)]
        out = []
        def run():
            for batch in batches[:3]:
                trainer.train_step(batch, 0)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for batch in batches[3:]:
                trainer.train_step(batch, 0)
            out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        print(out[0], torch.get_num_threads())
    """)
    faults = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", script, mode, tiny_model, str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=300, check=True)
        per_step, threads = out.stdout.split()
        faults[mode] = float(per_step)
    assert threads == "1"
    # not vacuous: the default gives the pages back every step (how many depends on glibc's dynamic mmap
    # threshold, which grows with what the process freed before: 83 to several hundred a step here)
    assert faults["off"] > 50, faults
    assert faults["on"] < faults["off"] / 4, faults
