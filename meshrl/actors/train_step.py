"""One RL optimisation step on a batch of samples: advantages, micro-batches, losses, gradients.

    samples ─► pack ─► (no grad) values, proximal log-probs ─► rewards (+KL) ─► advantages
        ─► for each PPO epoch and mini-batch: micro-batches by token budget ─► loss.backward()
        ─► clip grad norm ─► optimiser step

The loss functions come from ``meshrl.algos``, chosen once from ``AlgoConfig`` when the updater
is built. Each loss is normalised by the *mini-batch's* valid-token (or sequence) count, passed
explicitly, so the gradient does not depend on how a mini-batch is split into micro-batches.

Simplifications on purpose: sequences that hit the length limit are treated as terminal (no
value bootstrap); a single process computes the whole step (data parallelism wraps this from
outside, see Trainer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from meshrl import algos
from meshrl.actors.algo_config import AlgoConfig
from meshrl.modeling import Packed, ValueModel, pack, response_logprobs
from meshrl.queues import Sample

__all__ = ["StepBatch", "build_step_batch", "split_by_tokens", "PolicyUpdater"]


@dataclass
class StepBatch:
    packed: Packed
    behavior_logprobs: torch.Tensor  # [B, R]
    ref_logprobs: torch.Tensor | None  # [B, R]
    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B] int64
    lengths: list[int]  # prompt + response tokens per sample

    @property
    def mask(self) -> torch.Tensor:
        return self.packed.response_mask > 0  # [B, R] bool


def _pad(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def build_step_batch(samples: Sequence[Sample], *, pad_id: int) -> StepBatch:
    """Pack samples into tensors; per-token fields are aligned on response tokens."""
    if not samples:
        raise ValueError("a train step needs at least one sample")
    packed = pack(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=pad_id,
        loss_masks=[s.loss_mask for s in samples],
    )  # fmt: skip
    width = packed.response_ids.shape[1]
    has_ref = all(s.ref_logprobs is not None for s in samples)
    return StepBatch(
        packed=packed,
        behavior_logprobs=_pad([s.behavior_logprobs for s in samples], width),
        ref_logprobs=_pad([s.ref_logprobs for s in samples], width) if has_ref else None,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        lengths=[s.num_tokens for s in samples],
    )


def split_by_tokens(indices: Sequence[int], lengths: Sequence[int], tokens_per_microbatch: int) -> list[list[int]]:
    """Greedy micro-batches whose padded size (rows × longest row) stays within the budget.

    A single sequence longer than the budget gets a micro-batch of its own.
    """
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in indices:
        grown = max(longest, lengths[i])
        if current and grown * (len(current) + 1) > tokens_per_microbatch:
            out.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        out.append(current)
    return out


def _select(batch: StepBatch, rows: list[int]) -> Packed:
    idx = torch.tensor(rows, dtype=torch.long)
    p = batch.packed
    width = max(batch.lengths[i] for i in rows)
    return Packed(
        p.input_ids[idx, :width], p.attention_mask[idx, :width], p.predict_index[idx],
        p.response_mask[idx], p.response_ids[idx],
    )  # fmt: skip


class PolicyUpdater:
    """Computes one RL step for a policy (and critic) with optimisers owned by the caller."""

    def __init__(
        self,
        policy: torch.nn.Module,
        critic: ValueModel | None,
        algo: AlgoConfig,
        *,
        temperature: float,
        max_new_tokens: int,
        tokens_per_microbatch: int,
        ppo_epochs: int = 1,
        minibatches: int = 1,
    ) -> None:
        if algo.uses_critic and critic is None:
            raise ValueError("algo.advantage=gae needs a critic")
        self.policy, self.critic, self.algo = policy, critic, algo
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.tokens_per_microbatch, self.ppo_epochs, self.minibatches = tokens_per_microbatch, ppo_epochs, minibatches
        is_fn = algos.make_importance_sampling(
            algo.importance_sampling, is_cap=algo.is_cap, is_low=algo.is_low, is_high=algo.is_high
        )
        self.policy_loss = algos.make_policy_loss(
            algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
            importance_sampling=is_fn, is_cap=algo.is_cap,
        )  # fmt: skip
        self.kl = algos.kl_estimator(algo.kl_estimator)

    # -- no-grad passes over the whole batch -------------------------------------------------

    @torch.no_grad()
    def _forward_all(self, batch: StepBatch, fn: Callable[[Packed], torch.Tensor]) -> torch.Tensor:
        rows = list(range(len(batch.lengths)))
        out = torch.zeros_like(batch.behavior_logprobs)
        for mb in split_by_tokens(rows, batch.lengths, self.tokens_per_microbatch):
            out[torch.tensor(mb)] = fn(_select(batch, mb))
        return out

    def _logprobs(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.policy(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        logp = response_logprobs(logits, packed, temperature=self.temperature)
        index = packed.predict_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        scaled = torch.gather(logits, 1, index).float()
        if self.temperature > 0:
            scaled = scaled / self.temperature
        return logp, algos.entropy_from_logits(scaled)

    def advantages(self, batch: StepBatch, old_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages ``[B, R]`` and, with a critic, returns ``[B, R]``."""
        algo, mask = self.algo, batch.mask
        last = mask & (mask.long().cumsum(1) == mask.long().sum(1, keepdim=True))  # last valid token
        token_rewards = torch.where(last, batch.rewards[:, None].expand_as(mask), torch.zeros_like(batch.behavior_logprobs))
        if algo.kl_coef > 0 and algo.kl_in_reward:
            token_rewards = algos.kl_in_reward(
                token_rewards, batch.behavior_logprobs, batch.ref_logprobs, mask, kl_coef=algo.kl_coef, estimator=self.kl
            )
        if algo.advantage == "gae":
            adv, returns = algos.gae(token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam)
            if algo.normalize_advantages:
                valid = adv[mask]
                if valid.numel() > 1:
                    adv = torch.where(mask, (adv - valid.mean()) / (valid.std() + 1e-6), torch.zeros_like(adv))
            return adv, returns
        if algo.advantage == "reinforce_pp":
            return algos.reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma), None
        seq_rewards = token_rewards.sum(1)  # outcome reward (+ folded KL) per sequence
        if algo.advantage == "grpo":
            adv = algos.grpo_advantages(seq_rewards, batch.group_ids, scale_by_std=algo.grpo_scale_by_std)
        else:
            adv = algos.rloo_advantages(seq_rewards, batch.group_ids)
        return adv[:, None].expand_as(batch.behavior_logprobs).contiguous(), None

    # -- the step -----------------------------------------------------------------------------

    def step(
        self,
        batch: StepBatch,
        *,
        policy_optimizer: torch.optim.Optimizer,
        critic_optimizer: torch.optim.Optimizer | None,
        max_grad_norm: float,
        generator: torch.Generator | None = None,
    ) -> dict[str, float]:
        algo = self.algo
        old_values = self._forward_all(batch, self.critic) if self.critic is not None else None
        proximal = None
        if algo.policy_loss == "decoupled_ppo":
            proximal = self._forward_all(batch, lambda p: self._logprobs(p)[0])
        adv, returns = self.advantages(batch, old_values)
        old_logprobs = proximal if proximal is not None else batch.behavior_logprobs

        num_rows = len(batch.lengths)
        self._loss_sum = 0.0  # micro-batch losses share the mini-batch normaliser, so they add up
        policy_metrics, extra = [], {"grad_norm": 0.0, "critic_grad_norm": 0.0, "skipped_updates": 0.0}
        for _ in range(self.ppo_epochs):
            order = torch.randperm(num_rows, generator=generator).tolist() if self.minibatches > 1 else list(range(num_rows))
            for minibatch in (order[i :: self.minibatches] for i in range(self.minibatches)):
                policy_metrics += self._minibatch(batch, sorted(minibatch), adv, returns, old_values, old_logprobs, policy_optimizer, critic_optimizer)
                # A NaN/inf gradient skips the update (counted) instead of poisoning the weights.
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_grad_norm))
                extra["grad_norm"] = grad_norm
                if math.isfinite(grad_norm):
                    policy_optimizer.step()
                else:
                    extra["skipped_updates"] = extra.get("skipped_updates", 0.0) + 1
                if self.critic is not None and critic_optimizer is not None:
                    critic_norm = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), max_grad_norm))
                    extra["critic_grad_norm"] = critic_norm
                    if math.isfinite(critic_norm):
                        critic_optimizer.step()
        reduced = {k: float(v) for k, v in algos.reduce_metrics(policy_metrics).items()}
        mask = batch.mask
        reduced.update(extra)
        reduced["loss"] = self._loss_sum / (self.ppo_epochs * self.minibatches)
        reduced["advantage_mean"] = float(adv[mask].mean()) if mask.any() else 0.0
        if returns is not None and mask.any():
            reduced["value_mean"] = float(old_values[mask].mean())
        return reduced

    def _minibatch(self, batch, rows, adv, returns, old_values, old_logprobs, policy_optimizer, critic_optimizer):
        algo, mask = self.algo, batch.mask
        sel = torch.tensor(rows)
        num_tokens = float(mask[sel].sum())
        aggregate = algos.make_aggregator(
            algo.aggregation, num_tokens=max(num_tokens, 1.0), num_seqs=len(rows), max_tokens=self.max_new_tokens
        )
        policy_optimizer.zero_grad(set_to_none=True)
        if critic_optimizer is not None:
            critic_optimizer.zero_grad(set_to_none=True)
        metrics = []
        for mb in split_by_tokens(rows, batch.lengths, self.tokens_per_microbatch):
            packed, idx = _select(batch, mb), torch.tensor(mb)
            m = mask[idx]
            logp, entropy = self._logprobs(packed)
            loss, pm = self.policy_loss(
                logp, old_logprobs[idx], batch.behavior_logprobs[idx], adv[idx], m, aggregate=aggregate, entropy=entropy.detach()
            )
            if algo.entropy_coef > 0:
                loss = loss - algo.entropy_coef * aggregate(entropy, m)
            if algo.kl_coef > 0 and not algo.kl_in_reward:
                kl_loss, km = algos.kl_loss(logp, batch.ref_logprobs[idx], m, aggregate=aggregate, estimator=self.kl)
                loss = loss + algo.kl_coef * kl_loss
                pm = {**pm, **{k: v for k, v in km.items() if k != "num_tokens"}}
            loss.backward()
            if self.critic is not None:
                values = self.critic(packed)
                vloss, vm = algos.value_loss(values, old_values[idx], returns[idx], m, aggregate=aggregate, clip=algo.value_clip)
                (algo.value_coef * vloss).backward()
                pm = {**pm, **{k: v for k, v in vm.items() if k != "num_tokens"}}
            metrics.append(pm)
            self._loss_sum += float(loss.detach())
        return metrics
