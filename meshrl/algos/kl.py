"""KL divergence to a reference policy: per-token estimators, as a reward penalty or a loss term.

The estimators (Schulman, "Approximating KL Divergence", 2020) estimate KL(π ‖ π_ref) from tokens
sampled from π, with log r = log π_ref − log π per token:

- ``k1 = −log r``: unbiased, high variance, can be negative.
- ``k2 = ½ (log r)²``: biased, low variance, always ≥ 0.
- ``k3 = r − 1 − log r``: unbiased, low variance, always ≥ 0.

As a *loss term*, what matters is the gradient, not the value: with on-policy samples k1's
gradient is zero in expectation, k2's is the gradient of the reverse KL(π ‖ π_ref), and k3's is
that of the forward KL(π_ref ‖ π). In the *reward* (detached) only the value matters; k1 is the
classic choice there (InstructGPT, REINFORCE++).

Simplifications on purpose: log r is clamped to ±20 before ``exp``; masked positions give 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._common import check_coef, check_like, check_mask, check_tensor, safe_log_ratio
from .aggregation import Aggregator
from .metrics import NUM_TOKENS, masked_max, masked_mean

KLEstimator = Callable[..., torch.Tensor]


def _log_r(
    fn: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(fn, "logprobs", logprobs)
    check_like(fn, "ref_logprobs", ref_logprobs, "logprobs", logprobs)
    if mask is None:
        mask = torch.ones_like(logprobs, dtype=torch.bool)
    else:
        mask = check_mask(fn, mask, "logprobs", logprobs)
    return safe_log_ratio(ref_logprobs, logprobs, mask), mask  # log π_ref/π, [B, T]


def kl_k1(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """k1 = log π − log π_ref per token.

    Args:
        logprobs: ``[B, T]`` float, log π of the sampled tokens (the sampling policy).
        ref_logprobs: ``[B, T]`` float, log π_ref of the same tokens.
        mask: optional ``[B, T]`` bool (or 0/1); masked positions give 0.

    Returns:
        ``[B, T]`` per-token estimate (differentiable w.r.t. both inputs).
    """
    log_r, _ = _log_r("kl_k1", logprobs, ref_logprobs, mask)
    return -log_r


def kl_k2(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """k2 = ½ (log π − log π_ref)² per token. Arguments as ``kl_k1``."""
    log_r, _ = _log_r("kl_k2", logprobs, ref_logprobs, mask)
    return 0.5 * log_r.square()


def kl_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """k3 = π_ref/π − 1 − log(π_ref/π) per token (Schulman's low-variance estimator).

    Arguments as ``kl_k1``; masked positions give exactly 0 (r = 1 there).
    """
    log_r, _ = _log_r("kl_k3", logprobs, ref_logprobs, mask)
    # expm1 keeps r − 1 accurate when π ≈ π_ref, where the estimate is a difference of near-equals.
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimator(name: str) -> KLEstimator:
    """The estimator function for ``algo.kl_estimator = name`` (``"k1"`` | ``"k2"`` | ``"k3"``)."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"kl_estimator: unknown KL estimator {name!r}; choose one of {tuple(KL_ESTIMATORS)}"
        ) from None


@torch.no_grad()
def kl_in_reward(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = kl_k1,
) -> torch.Tensor:
    """Fold a KL penalty into per-token rewards: r'_t = r_t − kl_coef · KL_t (detached).

    Args:
        token_rewards: ``[B, T]`` float, reward after each response token.
        logprobs: ``[B, T]`` float, log-probs of the sampled tokens under the sampling policy
            (the behaviour log-probs, or the trainer's recomputed old log-probs).
        ref_logprobs: ``[B, T]`` float, the reference model's log-probs of the same tokens.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        kl_coef: penalty weight β ≥ 0.
        estimator: ``kl_k1`` (default), ``kl_k2`` or ``kl_k3``; pick it once (``kl_estimator``).

    Returns:
        ``[B, T]`` penalised rewards, 0 at masked positions.
    """
    fn = "kl_in_reward"
    check_tensor(fn, "token_rewards", token_rewards, ndim=2)
    check_like(fn, "logprobs", logprobs, "token_rewards", token_rewards)
    mask = check_mask(fn, mask, "token_rewards", token_rewards)
    beta = check_coef(fn, "kl_coef", kl_coef)
    kl = estimator(logprobs, ref_logprobs, mask)  # [B, T]
    rewards = torch.where(mask, token_rewards, token_rewards.new_zeros(()))
    return rewards - beta * kl.to(rewards.dtype)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregator,
    estimator: KLEstimator = kl_k3,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term (GRPO's form); the trainer adds ``kl_coef * loss``.

    Args:
        logprobs: ``[B, T]`` float, current log-probs (with grad) of the sampled tokens.
        ref_logprobs: ``[B, T]`` float, the reference model's log-probs of the same tokens.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        aggregate: the step's aggregator (global normaliser), see ``make_aggregator``.
        estimator: ``kl_k1``, ``kl_k2`` or ``kl_k3`` (default, as in GRPO).

    Returns:
        ``(loss, metrics)``: the aggregated KL (not yet scaled by ``kl_coef``) and
        ``{"kl", "kl_abs_max", "num_tokens"}`` (reduction rules in ``meshrl.algos.metrics``).
    """
    fn = "kl_loss"
    check_tensor(fn, "logprobs", logprobs, ndim=2)
    mask = check_mask(fn, mask, "logprobs", logprobs)
    per_token = estimator(logprobs, ref_logprobs, mask)  # [B, T]
    loss = aggregate(per_token, mask)
    with torch.no_grad():
        kl = per_token.detach()
        metrics = {
            "kl": masked_mean(kl, mask),
            "kl_abs_max": masked_max(kl.abs(), mask),
            NUM_TOKENS: mask.sum().to(kl.dtype),
        }
    return loss, metrics
