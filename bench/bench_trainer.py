"""One train step of the embedded default on CPU (dp = 1, plain modules): the number to keep fast.

Run: ``OMP_NUM_THREADS=1 pytest bench/bench_trainer.py --benchmark-only``. Cases, each a full
``PolicyTrainer.train_step`` (pack, no-grad passes, advantages, micro-batches, AdamW) on 256
samples a little longer than the example's (7-token prompts where the task's "a+b=" are 4-6 tokens;
2-7 response tokens, EOS included), single-threaded:

- ``ppo``: the example's default (GAE with a critic: value pass, critic forward/backward too);
- ``grpo``: 8 samples per prompt, no critic;
- ``decoupled_ppo``: PPO plus the proximal log-prob pass (``algo=async_ppo``).

``extra_info`` has ms per step and the process CPU ms per step (less inflated by shared cores).
Simplification on purpose: the model has the embedded default's shape with random weights (no warm
start), which costs exactly the same per step.
"""

from __future__ import annotations

import os
import random
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from meshrl.actors import AlgoConfig, TrainerConfig  # noqa: E402
from meshrl.actors.data_parallel import DataParallel  # noqa: E402
from meshrl.actors.policy_trainer import PolicyTrainer  # noqa: E402
from meshrl.queues import Sample  # noqa: E402

SAMPLES = 256
ROUNDS = 5
ALGOS = {
    "ppo": AlgoConfig(),
    "grpo": AlgoConfig(advantage="grpo", samples_per_prompt=8),
    "decoupled_ppo": AlgoConfig(policy_loss="decoupled_ppo"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    from meshrl.embedded import EmbeddedModelConfig, build_char_tokenizer, build_model_config

    path = tmp_path_factory.mktemp("embedded")
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config(EmbeddedModelConfig(), tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def batch(step: int, group: int) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for i in range(SAMPLES):
        response = [rng.randrange(4, 20) for _ in range(rng.randrange(1, 7))] + [1]
        out.append(Sample(prompt_id=i // group, group_id=step * SAMPLES + i // group, group_size=group,
                          prompt_ids=[3] + [rng.randrange(4, 20) for _ in range(6)], response_ids=response,
                          behavior_logprobs=[-rng.uniform(0.1, 3.0) for _ in response], behavior_version=0,
                          reward=float(rng.random() < 0.5)))
    return out


@pytest.mark.parametrize("algo", list(ALGOS))
def test_train_step_cpu(benchmark, model_dir, algo):
    torch.set_num_threads(1)
    cfg = ALGOS[algo]
    trainer = PolicyTrainer(model_dir, TrainerConfig(), cfg, dp=DataParallel(None), temperature=1.0,
                            max_new_tokens=8, total_steps=ROUNDS + 1)
    batches = iter([batch(s, cfg.samples_per_prompt) for s in range(ROUNDS + 1)])
    cpu0 = time.process_time()
    metrics = benchmark.pedantic(lambda: trainer.train_step(next(batches), 0), rounds=ROUNDS, warmup_rounds=1)
    cpu_ms = (time.process_time() - cpu0) / (ROUNDS + 1) * 1e3
    assert metrics["skipped_updates"] == 0 and metrics["grad_norm"] > 0
    benchmark.extra_info["ms_per_step"] = round(benchmark.stats.stats.median * 1e3, 1)
    benchmark.extra_info["cpu_ms_per_step"] = round(cpu_ms, 1)
    print(f"\n{algo}: {benchmark.stats.stats.median * 1e3:.0f} ms per step of {SAMPLES} samples "
          f"({cpu_ms:.0f} ms process CPU)")
