"""One RL optimisation step on a batch of samples: advantages, micro-batches, losses, gradients.

    this rank's share (whole groups) ─► pack ─► (no grad) values, proximal (decoupled PPO or any
        importance sampling) and reference log-probs of its rows ─► rewards (+KL) ─► advantages
        ─► for each PPO epoch and mini-batch: this rank's rows of it ─► micro-batches by token
        budget ─► loss.backward() (FSDP2 sums gradients over ranks) ─► global grad-norm clip ─► step

Each dp rank holds only its share of the step's batch: whole groups, contiguous in the step's
order (``meshrl.queues.parcels.share_groups``; the queue hands each rank its own, or a rank given
the whole batch takes its share itself). GRPO and RLOO advantages are per group, so they need no
collective; GAE whitening and REINFORCE++'s batch statistics are all-reduced. Mini-batches are
drawn from the step's order with a generator seeded alike on every rank, so any dp size trains
the same mini-batches; each loss is normalised by the *mini-batch's* global valid-token (or
sequence) count — one collective for the step — so the gradient is the same for any
micro-batch split and any dp size. Every rank runs as many micro-batches as the rank with most
(padding with empty ones: FSDP2 all-gathers per forward); the counts are one MAX collective.

A NaN/inf loss or gradient norm skips that optimiser update (counted in ``skipped_updates``);
the caller decides when too many in a row stop the run. A mini-batch with no valid token (every
row dropped as a uniform group, or fully masked) skips its optimiser updates too (counted in
``empty_minibatches``): a step on a zero gradient would still apply AdamW's momentum and weight
decay. ``grad_norm`` is the mean over the updates of the step.

Simplifications on purpose: sequences that hit the length limit are treated as terminal (no
value bootstrap); shares are balanced by tokens at group boundaries, not by compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from meshrl import algos
from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.data_parallel import DataParallel, clip_grad_norm
from meshrl.modeling import Packed, ValueModel, pack, policy_logprobs
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

    def to(self, device: torch.device) -> "StepBatch":
        ref = self.ref_logprobs.to(device) if self.ref_logprobs is not None else None
        return StepBatch(self.packed.to(device), self.behavior_logprobs.to(device), ref, self.rewards.to(device),
                         self.group_ids.to(device), self.lengths)


def _pad(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    return torch.tensor([[*row, *[0.0] * (width - len(row))] for row in rows], dtype=torch.float32)  # [B, width]


def build_step_batch(samples: Sequence[Sample], *, pad_id: int) -> StepBatch:
    """Pack samples into tensors; per-token fields are aligned on response tokens."""
    if not samples:
        raise ValueError("a train step needs at least one sample")
    packed = pack(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id=pad_id,
        loss_masks=[s.loss_mask for s in samples],
    )
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
    return batch.packed.rows(rows, width=max(batch.lengths[i] for i in rows))


def _empty(batch: StepBatch) -> Packed:
    """A micro-batch that trains nothing: row 0 with an all-zero loss mask (dp padding)."""
    return _masked(_select(batch, [0]), torch.zeros(1, dtype=torch.bool, device=batch.packed.input_ids.device))


def _masked(p: Packed, keep: torch.Tensor) -> Packed:
    """``p`` with the loss mask of the rows not in ``keep`` (``[B]`` bool) zeroed."""
    return p.with_response_mask(p.response_mask * keep[:, None].to(p.response_mask.dtype))


class PolicyUpdater:
    """Computes one RL step for a policy (and critic) with optimisers owned by the caller.

    ``dp`` places this process on the trainer's data-parallel axis (default: one rank);
    ``reference``, when given, is a frozen policy whose log-probs fill a batch that arrives
    without ``ref_logprobs`` (the in-trainer alternative to a ReferenceWorker).
    """

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
        dp: DataParallel | None = None,
        reference: torch.nn.Module | None = None,
        share_prompts: bool = True,
    ) -> None:
        if algo.uses_critic and critic is None:
            raise ValueError("algo.advantage=gae needs a critic")
        self.policy, self.critic, self.algo, self.reference = policy, critic, algo, reference
        self.share_prompts = share_prompts
        self.dp = dp if dp is not None else DataParallel(None)
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        # what the no-grad passes gather in: float32 (bf16 compute is upcast), float64 for a float64 policy
        first = next(policy.parameters(), None)
        self.dtype = torch.float64 if first is not None and first.dtype == torch.float64 else torch.float32
        self.tokens_per_microbatch, self.ppo_epochs, self.minibatches = tokens_per_microbatch, ppo_epochs, minibatches
        is_fn = algos.make_importance_sampling(
            algo.importance_sampling, is_cap=algo.is_cap, is_low=algo.is_low, is_high=algo.is_high
        )
        self.policy_loss = algos.make_policy_loss(
            algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
            importance_sampling=is_fn, is_cap=algo.is_cap,
        )
        self.kl = algos.kl_estimator(algo.kl_estimator)

    def _plan(self, batch: StepBatch, rows: list[int], total: int, generator: torch.Generator | None
              ) -> tuple[list[list[int] | None], list[tuple[list[int], list[list[int] | None]]]]:
        """This rank's micro-batches: of the no-grad passes (all its rows), and of each mini-batch
        (its rows of it) with that mini-batch's local rows; each list padded with ``None`` (an
        empty micro-batch) to the most any rank runs, so every rank runs as many FSDP2 forwards
        and backwards (one MAX collective for the whole step).

        A mini-batch is drawn from the step's order (``rows`` are this rank's positions in it, of
        ``total``), with ``generator`` seeded alike on every rank: any dp size trains the same
        mini-batches."""
        local = {g: i for i, g in enumerate(rows)}
        minibatches = []
        for _ in range(self.ppo_epochs):
            order = torch.randperm(total, generator=generator).tolist() if self.minibatches > 1 else list(range(total))
            for k in range(self.minibatches):
                minibatches.append(sorted(local[g] for g in order[k :: self.minibatches] if g in local))
        splits = [split_by_tokens(p, batch.lengths, self.tokens_per_microbatch) for p in [list(range(len(rows))), *minibatches]]
        most = torch.tensor([max(1, len(mbs)) for mbs in splits], dtype=torch.long, device=self.dp.device)
        most = self.dp.all_reduce(most, op="max", what="the micro-batch counts").tolist()
        padded: list[list[list[int] | None]] = [[*mbs, *[None] * (n - len(mbs))] for mbs, n in zip(splits, most)]
        return padded[0], list(zip(minibatches, padded[1:]))

    # -- no-grad passes over this rank's rows --------------------------------------------------

    @torch.no_grad()
    def _forward_rows(self, batch: StepBatch, fn: Callable[[Packed], torch.Tensor], microbatches) -> torch.Tensor:
        """``fn`` on every row of this rank's share (``[B, R]``), in ``microbatches``."""
        out = torch.zeros_like(batch.behavior_logprobs, dtype=self.dtype)
        for mb in microbatches:
            if mb is None:
                fn(_empty(batch))  # keeps this rank's FSDP2 all-gathers in step with the others
                continue
            out[torch.tensor(mb, device=out.device)] = fn(_select(batch, mb)).to(self.dtype)
        return out

    def _logprobs(self, packed: Packed, model: torch.nn.Module | None = None, *, entropy: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs ``[B, R]`` and entropies under ``model`` (the policy by default): the
        LM head only where a response token is predicted, chunked, and each prompt of a group run
        once (``modeling.policy_logprobs``)."""
        model = self.policy if model is None else model
        return policy_logprobs(model, packed, temperature=self.temperature, entropy=entropy, share_prompts=self.share_prompts)

    def advantages(self, batch: StepBatch, old_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages ``[B, R]`` and, with a critic, returns ``[B, R]``."""
        algo, mask = self.algo, batch.mask
        last = mask & (mask.long().cumsum(1) == mask.long().sum(1, keepdim=True))  # last valid token
        token_rewards = torch.where(last, batch.rewards[:, None].expand_as(mask), torch.zeros_like(batch.behavior_logprobs))
        kl_penalty = None
        if algo.kl_coef > 0 and algo.kl_in_reward:
            # −β·KL_t on valid tokens, 0 elsewhere: a row with no valid token has none
            kl_penalty = algos.kl_in_reward(
                torch.zeros_like(token_rewards), batch.behavior_logprobs, batch.ref_logprobs, mask,
                kl_coef=algo.kl_coef, estimator=self.kl,
            )
            token_rewards = token_rewards + kl_penalty
        if algo.advantage == "gae":
            adv, returns = algos.gae(token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam)
            if algo.normalize_advantages:
                # whitened over every rank's valid tokens: mean, then the unbiased std around it
                valid = adv[mask].double()
                n, total = self.dp.all_reduce(torch.stack([valid.new_tensor(valid.numel()), valid.sum()]),
                                              what="the GAE advantages' sum").tolist()
                if n > 1:
                    mean = total / n
                    sq = self.dp.all_reduce((valid - mean).square().sum().reshape(1), what="the GAE advantages' spread")
                    std = math.sqrt(float(sq[0]) / (n - 1))
                    adv = torch.where(mask, (adv - mean) / (std + 1e-6), torch.zeros_like(adv))
            return adv, returns
        if algo.advantage == "reinforce_pp":
            reduce = None if self.dp.size == 1 else (
                lambda t, op: self.dp.all_reduce(t, op=op, what="REINFORCE++'s batch statistics"))
            return algos.reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma, all_reduce=reduce), None
        # Each sample's own outcome reward (+ folded KL), not token_rewards.sum(1): a sample with no
        # valid token (an empty response, an episode that failed before the policy played) holds its
        # reward on no token, and a 0 in its place would shift its group-mates' advantages.
        seq_rewards = batch.rewards if kl_penalty is None else batch.rewards + kl_penalty.sum(1)  # [B]
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
        rows: Sequence[int] | None = None,
        total: int | None = None,
    ) -> dict[str, float]:
        """One step on this rank's share of the step's batch.

        ``batch`` holds the step's rows ``rows`` (their positions in the step's order, ascending,
        whole groups) of ``total``; None: the whole batch, on a single rank. ``rows=[]`` with a
        one-row batch: this rank got no group and pads (runs the forwards, trains nothing).
        ``generator`` shuffles mini-batches and must be seeded alike on every rank.
        """
        algo = self.algo
        batch = batch.to(self.dp.device)
        rows = list(range(len(batch.lengths))) if rows is None else list(rows)
        total = len(rows) if total is None else total
        if not rows:
            batch.packed = _masked(batch.packed, torch.zeros(len(batch.lengths), dtype=torch.bool, device=self.dp.device))
        nograd, minibatches = self._plan(batch, rows, total, generator)
        if algo.kl_coef > 0 and batch.ref_logprobs is None:
            if self.reference is None:
                raise ValueError("algo.kl_coef > 0 but the batch has no ref_logprobs and the trainer no reference "
                                 "model: run a ReferenceWorker or set trainer.reference_in_trainer=true")
            batch.ref_logprobs = self._forward_rows(batch, lambda p: self._logprobs(p, self.reference, entropy=False)[0], nograd)
        old_values = self._forward_rows(batch, self.critic, nograd) if self.critic is not None else None
        proximal = None
        # The IS weight is π_old/π_behav: with π_old taken as the behaviour log-probs it would be 1.
        if algo.policy_loss == "decoupled_ppo" or algo.importance_sampling != "none":
            proximal = self._forward_rows(batch, lambda p: self._logprobs(p, entropy=False)[0], nograd)
        adv, returns = self.advantages(batch, old_values)  # whole groups on this rank: GRPO/RLOO need no collective
        old_logprobs = proximal if proximal is not None else batch.behavior_logprobs
        kept = 0.0
        if algo.drop_uniform_groups:
            keep = algos.informative_groups(batch.rewards, batch.group_ids)  # [B]
            kept = float(keep[: len(rows)].sum())
            batch.packed = _masked(batch.packed, keep)

        # each mini-batch's global valid-token and sequence counts, its loss's normaliser: one
        # collective for the step; rows with no valid token (dropped groups, masked) count in neither
        mask = batch.mask
        counts = torch.zeros((len(minibatches), 2), dtype=torch.float64, device=self.dp.device)
        for j, (mb, _) in enumerate(minibatches):
            if mb:
                m = mask[torch.tensor(mb, device=mask.device)]
                counts[j, 0], counts[j, 1] = m.sum(), m.any(-1).sum()
        counts = self.dp.all_reduce(counts, what="the mini-batches' token counts").tolist()

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.dp.device)
        policy_metrics: list[dict[str, torch.Tensor]] = []
        extra = {"skipped_updates": 0.0, "critic_skipped_updates": 0.0, "empty_minibatches": 0.0}
        norms: list[float] = []
        critic_norms: list[float] = []
        for (_, microbatches), (num_tokens, num_seqs) in zip(minibatches, counts):
            loss, metrics = self._minibatch(batch, microbatches, num_tokens, num_seqs, adv, returns, old_values,
                                            old_logprobs, policy_optimizer, critic_optimizer)
            policy_metrics += metrics
            loss = self.dp.all_reduce(loss.reshape(1), what="the mini-batch loss")[0]  # the global loss
            loss_sum += loss
            if num_tokens == 0:
                # Nothing to train (dropped uniform groups, fully masked responses): the gradient
                # is zero, yet an AdamW step would still move the weights (momentum, weight
                # decay). num_tokens is the global count, the same on every rank, so every rank
                # skips alike, clip_grad_norm's collective included.
                extra["empty_minibatches"] += 1
                continue
            # A NaN/inf loss or gradient skips the update (counted) instead of poisoning the
            # weights; the norm and the loss are global, so every rank decides alike.
            grad_norm = clip_grad_norm([p for p in self.policy.parameters() if p.requires_grad], max_grad_norm)
            norms.append(grad_norm)
            if math.isfinite(grad_norm) and math.isfinite(float(loss)):
                policy_optimizer.step()
            else:
                extra["skipped_updates"] += 1
            if self.critic is not None and critic_optimizer is not None:
                critic_norm = clip_grad_norm(list(self.critic.parameters()), max_grad_norm)
                critic_norms.append(critic_norm)
                if math.isfinite(critic_norm):
                    critic_optimizer.step()
                else:
                    extra["critic_skipped_updates"] += 1
        reduced = self.dp.reduce_metrics(algos.reduce_metrics(policy_metrics))
        reduced.update(extra)
        # pre-clip norms, averaged over the updates (mini-batches × epochs) that had a token to train
        reduced["grad_norm"] = sum(norms) / len(norms) if norms else 0.0
        reduced["critic_grad_norm"] = sum(critic_norms) / len(critic_norms) if critic_norms else 0.0
        reduced["loss"] = float(loss_sum) / (self.ppo_epochs * self.minibatches)
        adv_sum, valid, kept = self.dp.all_reduce(
            torch.tensor([float(adv[mask].double().sum()), float(mask.sum()), kept], dtype=torch.float64, device=self.dp.device),
            what="the advantages' sum").tolist()
        reduced["advantage_mean"] = adv_sum / valid if valid else 0.0
        if algo.drop_uniform_groups:
            reduced["uniform_group_frac"] = 1.0 - kept / total
        return reduced

    def _minibatch(self, batch, microbatches, num_tokens, num_seqs, adv, returns, old_values, old_logprobs,
                   policy_optimizer, critic_optimizer):
        """Gradients of one mini-batch from this rank's ``microbatches`` of it, its loss normalised
        by the mini-batch's global valid-token (sequence) count: the local loss and metrics."""
        algo, device = self.algo, self.dp.device
        aggregate = algos.make_aggregator(
            algo.aggregation, num_tokens=max(num_tokens, 1.0), num_seqs=max(num_seqs, 1.0), max_tokens=self.max_new_tokens
        )
        policy_optimizer.zero_grad(set_to_none=True)
        if critic_optimizer is not None:
            critic_optimizer.zero_grad(set_to_none=True)
        metrics, loss_sum = [], torch.zeros((), dtype=torch.float64, device=device)
        for mb in microbatches:
            packed = _select(batch, mb) if mb is not None else _empty(batch)
            idx = torch.tensor(mb if mb is not None else [0], device=device)
            m = packed.response_mask > 0  # [b, R]; all False in a padding micro-batch
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
            loss_sum += loss.detach()  # micro-batch losses share the mini-batch normaliser: they add up
        return loss_sum, metrics
