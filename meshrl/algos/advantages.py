"""Advantage estimators and critic returns: GAE, GRPO, RLOO, REINFORCE++ and reward-to-go.

All per-token tensors cover the *response* tokens only: ``[B, T]`` with ``mask [B, T]`` marking
the tokens the policy produced (not padding, not tool or environment text). Outputs are detached
(computed under ``torch.no_grad()``): advantages and returns are targets, not part of the graph.

Simplifications on purpose:

- Masked positions are *skipped*, not treated as steps: the recursions run over the valid tokens
  of each row only, so tool output in the middle of a multi-turn response and right padding both
  leave the valid tokens' values unchanged. Rewards placed on masked positions are ignored: put
  the outcome reward on the last valid token. Outputs are 0 at masked positions.
- The recursions loop over T in Python (one small kernel per token, on ``[B]`` vectors); they
  run once per step, on the whole batch, so this is not a hot path.
- GRPO/RLOO group statistics use ``torch.unique``, which syncs with the host once per call.
- Group (GRPO, RLOO) and batch (REINFORCE++) statistics are computed in float64 and the result
  cast back to the input's dtype, and a group (batch) whose rewards are all equal gets exactly 0:
  in float32 the rounded mean of seven 0.7s leaves r − mean ≈ 6e-8 and a std as small, whose
  ratio is a same-sign advantage of 0.056 on every sample. NaN/inf rewards still propagate.
- REINFORCE++'s batch normalisation uses the batch passed in, or, given ``all_reduce``, the
  whole batch of which each data-parallel rank holds a part.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._common import check_coef, check_like, check_mask, check_tensor, zero_masked


def _check_tokens(fn: str, token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_tensor(fn, "token_rewards", token_rewards, ndim=2)
    return check_mask(fn, mask, "token_rewards", token_rewards)


def _check_discount(fn: str, name: str, value: float) -> float:
    v = check_coef(fn, name, value)
    if v > 1.0:
        raise ValueError(f"{fn}: `{name}` must be in [0, 1], got {value!r}")
    return v


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    δ_t = r_t + γ V_{t+1} − V_t and A_t = δ_t + γλ A_{t+1}, where t+1 is the next *valid* token
    of the row, and after the last valid token V = ``bootstrap_values`` (0 when omitted).

    Args:
        token_rewards: ``[B, T]`` float, reward received after each token (outcome reward on the
            last valid token, per-token KL penalties anywhere).
        values: ``[B, T]`` float, the critic's V(s_t) for the state before each token.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        gamma: discount in [0, 1].
        lam: GAE λ in [0, 1]; 1 gives Monte-Carlo returns minus values, 0 gives one-step TD.
        bootstrap_values: ``[B]`` float, V(s_T) after the last token for sequences cut off by
            the length limit, 0 for sequences that ended (omit for all-ended).

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, 0 at masked positions; ``returns = A + V``
        at valid positions (the critic's target).
    """
    fn = "gae"
    mask = _check_tokens(fn, token_rewards, mask)
    check_like(fn, "values", values, "token_rewards", token_rewards)
    gamma = _check_discount(fn, "gamma", gamma)
    lam = _check_discount(fn, "lam", lam)
    rewards = zero_masked(token_rewards, mask)  # [B, T]
    vals = zero_masked(values, mask).to(rewards.dtype)  # [B, T]
    batch, steps = rewards.shape
    if bootstrap_values is None:
        next_value = rewards.new_zeros(batch)  # [B]
    else:
        check_tensor(fn, "bootstrap_values", bootstrap_values, ndim=1)
        if bootstrap_values.shape[0] != batch:
            raise ValueError(
                f"{fn}: `bootstrap_values` has shape {tuple(bootstrap_values.shape)}, expected "
                f"[B] = ({batch},)"
            )
        next_value = bootstrap_values.to(rewards.dtype).clone()  # [B]
    last_gae = rewards.new_zeros(batch)  # [B]
    zero = rewards.new_zeros(())
    columns = []
    for t in reversed(range(steps)):
        m = mask[:, t]  # [B]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae_t = delta + gamma * lam * last_gae
        columns.append(torch.where(m, gae_t, zero))
        # A masked token is invisible: the next valid token's value and advantage carry over it.
        next_value = torch.where(m, vals[:, t], next_value)
        last_gae = torch.where(m, gae_t, last_gae)
    advantages = torch.stack(columns[::-1], dim=1) if columns else rewards.clone()  # [B, T]
    returns = torch.where(mask, advantages + vals, zero)  # [B, T]
    return advantages, returns


@torch.no_grad()
def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """Reward-to-go G_t = r_t + γ G_{t+1} over the valid tokens of each row.

    Args:
        token_rewards: ``[B, T]`` float, reward after each token.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        gamma: discount in [0, 1].

    Returns:
        ``[B, T]`` returns, 0 at masked positions.
    """
    fn = "discounted_returns"
    mask = _check_tokens(fn, token_rewards, mask)
    gamma = _check_discount(fn, "gamma", gamma)
    rewards = zero_masked(token_rewards, mask)  # [B, T]
    running = rewards.new_zeros(rewards.shape[0])  # [B]
    zero = rewards.new_zeros(())
    columns = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        g_t = rewards[:, t] + gamma * running
        columns.append(torch.where(m, g_t, zero))
        running = torch.where(m, g_t, running)
    return torch.stack(columns[::-1], dim=1) if columns else rewards.clone()


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, normalised over the batch's valid tokens.

    A = (G − mean(G)) / (std(G) + eps), mean and (population) std over every valid token of the
    batch. Fold the KL penalty into ``token_rewards`` first (``kl_in_reward``): that is where
    REINFORCE++ puts it.

    Args:
        token_rewards: ``[B, T]`` float, outcome reward on the last valid token plus per-token
            KL penalties.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        gamma: discount in [0, 1].
        eps: added to the std so it is never 0 (a constant batch gives exactly 0 regardless).
        all_reduce: ``all_reduce(t, op)`` sums (``"sum"``) or maxes (``"max"``) a float64
            tensor over the data-parallel ranks that hold the rest of the batch, whose
            statistics are then the whole batch's; None: these rows are the whole batch.

    Returns:
        ``[B, T]`` advantages in the dtype of ``token_rewards``, 0 at masked positions (all 0 if
        no token is valid, or if every valid token has the same return).
    """
    fn = "reinforce_pp_advantages"
    check_coef(fn, "eps", eps, strict=True)
    returns = discounted_returns(token_rewards, mask, gamma=gamma)  # [B, T]
    mask = check_mask(fn, mask, "token_rewards", token_rewards)
    if returns.numel() == 0 and all_reduce is None:  # a shape check, no sync; amax below needs an element
        return returns
    reduce = all_reduce if all_reduce is not None else (lambda t, op: t)
    g = returns.double()  # float64 statistics (module docstring)
    sums = reduce(torch.stack([mask.sum().to(g.dtype), g.sum()]), "sum")  # masked positions of `returns` are 0
    count = sums[0].clamp(min=1)
    mean = sums[1] / count
    centred = torch.where(mask, g - mean, 0.0)  # [B, T]
    # second pass: `mean` is rounded at the returns' magnitude (1e6 → 1e-10), which the division by
    # a tiny std would blow up; the residuals' own mean is exact enough to remove it
    centred = torch.where(mask, centred - reduce(centred.sum().reshape(1), "sum")[0] / count, 0.0)
    # Exactly 0 for a constant batch whatever the rounding of its mean; a NaN/inf return leaves
    # the mean non-finite, so it still poisons the step (the trainer skips it).
    neg_inf = g.new_tensor(-math.inf)
    hi = torch.where(mask, g, -math.inf).amax() if g.numel() else neg_inf
    neg_lo = torch.where(mask, -g, -math.inf).amax() if g.numel() else neg_inf
    extremes = reduce(torch.stack([hi, neg_lo]), "max")
    spread = extremes[0] + extremes[1]
    centred = torch.where((spread == 0) & mean.isfinite(), 0.0, centred)
    std = (reduce(centred.square().sum().reshape(1), "sum")[0] / count).sqrt()
    return (centred / (std + eps)).to(returns.dtype)


def _groups(fn: str, rewards: torch.Tensor, group_ids: torch.Tensor):
    """``(index [B] in 0..G-1, count [G], centred [B], spread [G])``, all statistics in float64.

    ``centred`` is r − group mean, exactly 0 in a group whose finite rewards are all equal
    (module docstring); ``spread`` is each group's max − min reward.
    """
    check_tensor(fn, "rewards", rewards, ndim=1)
    if not isinstance(group_ids, torch.Tensor):
        got = type(group_ids).__name__
        raise ValueError(f"{fn}: `group_ids` must be a torch.Tensor, got {got}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"{fn}: `group_ids` must be an integer tensor, got dtype {group_ids.dtype}"
        )
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"{fn}: `group_ids` has shape {tuple(group_ids.shape)} but `rewards` has shape "
            f"{tuple(rewards.shape)}; they must match"
        )
    # Group ids are arbitrary integers: renumber them 0..G-1 (syncs once to size the result).
    _, index = torch.unique(group_ids, return_inverse=True)  # [B] in 0..G-1
    num_groups = int(index.max()) + 1 if index.numel() else 0
    r = rewards.double()  # [B]
    count = r.new_zeros(num_groups).index_add_(0, index, torch.ones_like(r))  # [G]
    total = r.new_zeros(num_groups).index_add_(0, index, r)  # [G]
    hi = r.new_full((num_groups,), -math.inf).scatter_reduce_(0, index, r, "amax")  # [G]
    lo = r.new_full((num_groups,), math.inf).scatter_reduce_(0, index, r, "amin")  # [G]
    spread = hi - lo  # [G]
    # Exactly 0 for a group of equal rewards whatever the rounding of its mean; a NaN/inf reward
    # leaves its group's total non-finite, so it still poisons the group (the trainer skips the step).
    constant = (spread == 0) & total.isfinite()  # [G]
    centred = torch.where(constant[index], 0.0, r - (total / count)[index])  # [B]
    return index, count, centred, spread


@torch.no_grad()
def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, *, tol: float = 1e-6) -> torch.Tensor:
    """Which samples belong to a group whose rewards differ (DAPO's dynamic-sampling filter).

    A group whose samples all got the same reward (all right or all wrong) has zero group-relative
    advantage: it teaches nothing, yet its tokens still count in a token-mean normaliser and dilute
    the step as accuracy rises. Masking them out keeps the step's scale on the informative groups.

    Args:
        rewards: ``[B]`` float, one scalar reward per sample.
        group_ids: ``[B]`` integer, samples of one prompt share an id.
        tol: rewards closer than this count as equal.

    Returns:
        ``[B]`` bool, True where the sample's group has max - min reward > ``tol``.
    """
    fn = "informative_groups"
    check_coef(fn, "tol", tol)
    index, _, _, spread = _groups(fn, rewards, group_ids)
    return spread[index] > tol


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024): reward minus its group's mean.

    With ``scale_by_std`` the result is divided by the group's (Bessel-corrected) std + eps, as
    in DeepSeekMath; Dr. GRPO (Liu et al. 2025) turns it off because it over-weights groups whose
    rewards barely differ (too easy or too hard prompts). A group of one sample gets 0.

    Args:
        rewards: ``[B]`` float, one scalar reward per sample.
        group_ids: ``[B]`` integer, samples of the same prompt share an id; ids are arbitrary
            integers and groups may differ in size.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std so it is never 0 (a constant group gives exactly 0 regardless).

    Returns:
        ``[B]`` advantages in the dtype of ``rewards``; broadcast them over tokens in the loss.
        They sum to 0 in every group (up to that dtype's rounding); a constant group gets 0.
    """
    fn = "grpo_advantages"
    check_coef(fn, "eps", eps, strict=True)
    index, count, centred, _ = _groups(fn, rewards, group_ids)
    if not scale_by_std:
        return centred.to(rewards.dtype)
    square_sum = torch.zeros_like(count).index_add_(0, index, centred.square())  # [G]
    std = (square_sum / (count - 1).clamp(min=1)).sqrt()  # [G]
    return (centred / (std[index] + eps)).to(rewards.dtype)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i − mean of the *other* samples of its group = n/(n−1) · (r_i − group mean), an
    unbiased baseline (it does not depend on the sample itself). A group of one sample gets 0.

    Args:
        rewards: ``[B]`` float, one scalar reward per sample.
        group_ids: ``[B]`` integer, arbitrary ids; groups may differ in size.

    Returns:
        ``[B]`` advantages in the dtype of ``rewards``; they sum to 0 in every group (up to that
        dtype's rounding); a constant group gets 0.
    """
    index, count, centred, _ = _groups("rloo_advantages", rewards, group_ids)
    n = count[index]  # [B]
    return (centred * n / (n - 1).clamp(min=1)).to(rewards.dtype)
