"""The Trainer role: the policy (and for PPO its critic), optimisers, LR schedule, weight export.

A synchronous actor (one call at a time): ``train_step`` decodes a batch from the queue's wire
format and runs one ``PolicyUpdater`` step; ``export_weights`` hands the policy's Hugging Face
named tensors to ``meshrl.reshard``; ``save_hf`` writes a checkpoint that
``AutoModelForCausalLM.from_pretrained`` loads.

Simplification for now: one process (dp = 1), full fp32 parameters, no FSDP; the data-parallel
FSDP2 trainer replaces the model setup here without changing the endpoints.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Literal

import msgspec
import torch

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.train_step import PolicyUpdater, build_step_batch
from meshrl.mesh import Actor, endpoint
from meshrl.modeling import ValueModel, load_causal_lm
from meshrl.queues import Sample, decode_samples

__all__ = ["TrainerConfig", "Trainer", "batch_stats", "lr_lambda"]


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Optimisation of the policy and critic."""

    samples_per_step: int = 256
    """Samples (completions, not prompts) per train step; a multiple of algo.samples_per_prompt."""
    lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0
    """Linear LR warm-up, in train steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR after warm-up: constant, or cosine decay to min_lr_ratio × lr at the last step."""
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    tokens_per_microbatch: int = 16384
    """Padded tokens (rows × longest row) per forward/backward; bounds activation memory."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    minibatches_per_step: int = 1
    """Optimiser updates per pass (the batch is split into this many mini-batches)."""
    sync_interval: int = 1
    """Train steps between weight publishes; each publish is one policy version."""
    threads: int = 1
    """torch intra-op threads in the trainer process."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_per_step", "tokens_per_microbatch", "ppo_epochs", "minibatches_per_step", "sync_interval", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_step % self.minibatches_per_step:
            raise ValueError(
                f"trainer.samples_per_step={self.samples_per_step} is not divisible by "
                f"trainer.minibatches_per_step={self.minibatches_per_step}"
            )


def lr_lambda(cfg: TrainerConfig, total_steps: int):
    """The LR multiplier per step: linear warm-up, then constant or cosine."""

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def batch_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """What the trained batch looked like: rewards, task metrics, staleness, lengths."""
    n = len(samples)
    staleness = [version - s.behavior_version for s in samples]
    out = {
        "reward_mean": sum(s.reward for s in samples) / n,
        "reward_failed_frac": sum(s.reward_failed for s in samples) / n,
        "staleness_mean": sum(staleness) / n,
        "staleness_max": float(max(staleness)),
        "response_tokens_mean": sum(len(s.response_ids) for s in samples) / n,
        "truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
        "samples": float(n),
    }
    for key in {k for s in samples for k in s.reward_info}:
        out[f"reward_info/{key}"] = sum(s.reward_info.get(key, 0.0) for s in samples) / n
    return out


class Trainer(Actor):
    """Owns the policy, the critic (GAE only) and their optimisers."""

    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        *,
        temperature: float,
        max_new_tokens: int,
        total_steps: int,
    ) -> None:
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg, self.model_path = cfg, model_path
        self.policy = load_causal_lm(model_path).train()
        self.pad_id = self.policy.config.pad_token_id if self.policy.config.pad_token_id is not None else 0
        self.critic = ValueModel.from_pretrained(model_path).train() if algo.uses_critic else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.critic_optimizer = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr, betas=cfg.betas)
        self.updater = PolicyUpdater(
            self.policy, self.critic, algo, temperature=temperature, max_new_tokens=max_new_tokens,
            tokens_per_microbatch=cfg.tokens_per_microbatch, ppo_epochs=cfg.ppo_epochs,
            minibatches=cfg.minibatches_per_step,
        )  # fmt: skip
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.steps = 0

    @endpoint
    def train_step(self, encoded_samples: bytes, version: int) -> dict[str, float]:
        """One optimisation step, at policy ``version``, on a batch in the queue's wire format.

        Returns the step's metrics: the losses' (meshrl.algos), the batch's rewards and
        staleness (``version - behavior_version``), LR, gradient norm and timings.
        """
        start = time.perf_counter()
        samples = decode_samples(encoded_samples)
        batch = build_step_batch(samples, pad_id=self.pad_id)
        stats = batch_stats(samples, version)
        metrics = self.updater.step(
            batch, policy_optimizer=self.optimizer, critic_optimizer=self.critic_optimizer,
            max_grad_norm=self.cfg.max_grad_norm, generator=self.generator,
        )  # fmt: skip
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.steps += 1
        metrics["train_time_s"] = time.perf_counter() - start
        metrics["trained_tokens"] = float(batch.packed.num_response_tokens)
        return {**stats, **metrics}

    @endpoint
    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full tensors under Hugging Face names (what engines load)."""
        return {name: t.detach() for name, t in self.policy.state_dict().items()}

    @endpoint
    def save_hf(self, path: str) -> str:
        """Write an HF-loadable safetensors checkpoint of the policy, with config and tokenizer."""
        from transformers import AutoTokenizer

        out = Path(path)
        self.policy.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out)
        return str(out)
