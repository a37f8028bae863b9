"""The critic's loss for PPO: squared error to the returns, optionally clipped around old values.

Value clipping (Schulman et al. 2017's reference implementation; studied by Engstrom et al. 2020,
"Implementation Matters in Deep Policy Gradients") keeps the new value within ``clip`` of the
value predicted when the batch was collected, taking the larger of the clipped and unclipped
errors so the bound only ever slows the critic down.

Simplifications on purpose: the loss carries the conventional ½ factor; the value coefficient is
the trainer's to apply; old values and returns are constants (detached).
"""

from __future__ import annotations

import torch

from ._common import check_coef, check_like, check_mask, check_tensor, zero_masked
from .aggregation import Aggregator
from .metrics import NUM_TOKENS, masked_max, masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregator,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """½ (V − R)², or with ``clip`` ½ max((V − R)², (V_old + clamp(V − V_old, ±clip) − R)²).

    Args:
        values: ``[B, T]`` float, the critic's current predictions (with grad).
        old_values: ``[B, T]`` float, its predictions when the batch was collected.
        returns: ``[B, T]`` float, targets (``gae``'s returns).
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        aggregate: the step's aggregator with its global normaliser (``make_aggregator``).
        clip: ε ≥ 0 for value clipping, or None for the plain squared error.

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``value_mean``, ``value_error`` (mean squared
        error, unclipped), ``value_error_max``, ``value_clip_frac`` (tokens where the clipped
        error is the larger, 0 without clip) and ``num_tokens``.
    """
    fn = "value_loss"
    check_tensor(fn, "values", values, ndim=2)
    check_like(fn, "old_values", old_values, "values", values)
    check_like(fn, "returns", returns, "values", values)
    mask = check_mask(fn, mask, "values", values)
    if clip is not None:
        clip = check_coef(fn, "clip", clip)
    v = zero_masked(values, mask)  # [B, T]
    v_old = zero_masked(old_values.detach(), mask)
    target = zero_masked(returns.detach(), mask)
    error = (v - target).square()  # [B, T]
    if clip is None:
        per_token = 0.5 * error
        clipped_wins = torch.zeros_like(mask)
    else:
        v_clipped = v_old + (v - v_old).clamp(-clip, clip)
        clipped_error = (v_clipped - target).square()
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clipped_wins = clipped_error.detach() > error.detach()
    loss = aggregate(per_token, mask)
    with torch.no_grad():
        err = error.detach()
        metrics = {
            "value_mean": masked_mean(v.detach(), mask),
            "value_error": masked_mean(err, mask),
            "value_error_max": masked_max(err, mask),
            "value_clip_frac": masked_mean(clipped_wins.to(err.dtype), mask),
            NUM_TOKENS: mask.sum().to(err.dtype),
        }
    return loss, metrics
