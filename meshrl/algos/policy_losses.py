"""Policy-gradient losses: PPO's clipped surrogate, decoupled PPO and GSPO.

All three minimise, per valid token, ``w_t · max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high))``
with ρ the ratio of the current policy to the one the clip is centred on and w an optional,
detached importance weight from ``meshrl.algos.importance``; they differ in what ρ and w are:

- ``ppo_policy_loss`` (Schulman et al. 2017): ρ_t = π_θ/π_old per token; separate ε_low and
  ε_high (DAPO's clip-higher, Yu et al. 2025) and an optional dual clip (Ye et al. 2020) that
  bounds the loss of a negative-advantage token by −c·A. With ``importance_sampling`` it also
  corrects π_old back to the behaviour policy that sampled the tokens (TIS / MIS).
- ``decoupled_ppo_loss`` (Hilton et al. 2022; AReaL, Fu et al. 2025): the same with π_old the
  trainer's recomputed *proximal* policy and the behaviour→proximal weight always on.
- ``gspo_policy_loss`` (Zheng et al. 2025): one ratio per sequence, the geometric mean
  (Π_t ρ_t)^(1/|y|), clipped per sequence with a much smaller ε.

Every loss returns ``(loss, metrics)``; metric names and how to combine them across micro-batches
are in ``meshrl.algos.metrics``. Simplifications on purpose: ``old``/``proximal``/``behaviour``
log-probs and advantages are treated as constants (detached); the clip fractions count the tokens
whose clip *binds* (zero gradient), not every ratio outside the band.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    MAX_LOG_RATIO,
    check_advantages,
    check_coef,
    check_like,
    check_mask,
    check_tensor,
    safe_log_ratio,
    zero_masked,
)
from .aggregation import Aggregator
from .importance import ImportanceSampling, MaskedTokenIS
from .metrics import NUM_TOKENS, masked_max, masked_mean

Metrics = dict[str, torch.Tensor]


def check_clip(fn: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    check_coef(fn, "clip_low", clip_low)
    if clip_low >= 1.0:
        raise ValueError(
            f"{fn}: `clip_low` must be < 1 (the ratio floor is 1 − clip_low), got {clip_low!r}"
        )
    check_coef(fn, "clip_high", clip_high)
    if dual_clip is not None and check_coef(fn, "dual_clip", dual_clip) <= 1.0:
        raise ValueError(
            f"{fn}: `dual_clip` must be > 1 (it bounds −A·ρ by −A·c), got {dual_clip!r}"
        )


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token clipped loss ``[B, T]`` and its clip fractions; inputs already 0/1 at masked."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    per_token = torch.maximum(-advantages * ratio, -advantages * clipped)  # [B, T]
    with torch.no_grad():
        r, a = ratio.detach(), advantages
        metrics = {
            "clip_frac_low": masked_mean(((a < 0) & (r < 1.0 - clip_low)).to(r.dtype), mask),
            "clip_frac_high": masked_mean(((a > 0) & (r > 1.0 + clip_high)).to(r.dtype), mask),
        }
    if dual_clip is not None:
        # For A < 0 the unclipped branch grows without bound in ρ; cap it at −c·A.
        dual = torch.minimum(per_token, -dual_clip * advantages)
        per_token = torch.where(advantages < 0, dual, per_token)
        with torch.no_grad():
            metrics["dual_clip_frac"] = masked_mean(((a < 0) & (r > dual_clip)).to(r.dtype), mask)
    return per_token, metrics


def _common_metrics(
    fn: str,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    behavior_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> Metrics:
    """Ratio, KL, entropy metrics; ``token_log_ratio [B, T]`` is log π_θ/π_old per token."""
    with torch.no_grad():
        r, lr = ratio.detach(), token_log_ratio.detach()
        metrics = {
            "ratio_mean": masked_mean(r, mask),
            "ratio_max": masked_max(r, mask),
            # k3 estimate of KL(π_old ‖ π_θ) from tokens sampled by π_old: ≥ 0, low variance.
            "approx_kl": masked_mean(torch.expm1(lr) - lr, mask),
            NUM_TOKENS: mask.sum().to(r.dtype),
        }
        if behavior_logprobs is not None:
            # KL(π_behaviour ‖ π_θ): staleness plus engine/trainer numerics, what users tune on.
            mis = safe_log_ratio(logprobs.detach(), behavior_logprobs.detach(), mask)
            metrics["mismatch_kl"] = masked_mean(torch.expm1(mis) - mis, mask)
        if entropy is not None:
            check_like(fn, "entropy", entropy, "logprobs", logprobs)
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
    return metrics


def _weigh_and_aggregate(
    fn, per_token, metrics, ratio, log_ratio, logprobs, old_logprobs, behavior_logprobs, mask,
    aggregate, importance_sampling, entropy,
):
    """The tail every clipped policy loss shares: optional IS weights, aggregation, metrics."""
    if importance_sampling is not None:
        assert behavior_logprobs is not None
        is_weights = importance_sampling(old_logprobs, behavior_logprobs, mask)
        per_token = per_token * is_weights.weights.to(per_token.dtype)
        metrics.update(is_weights.metrics)
    loss = aggregate(per_token, mask)
    metrics.update(_common_metrics(fn, ratio, log_ratio, logprobs, mask, behavior_logprobs, entropy))
    return loss, metrics


def _ppo(
    fn: str,
    old_name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    aggregate: Aggregator,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    behavior_logprobs: torch.Tensor | None,
    importance_sampling: ImportanceSampling | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    check_tensor(fn, "logprobs", logprobs, ndim=2)
    check_like(fn, old_name, old_logprobs, "logprobs", logprobs)
    mask = check_mask(fn, mask, "logprobs", logprobs)
    adv = zero_masked(check_advantages(fn, advantages, logprobs).detach(), mask)  # [B, T]
    check_clip(fn, clip_low, clip_high, dual_clip)
    if behavior_logprobs is not None:
        check_like(fn, "behavior_logprobs", behavior_logprobs, "logprobs", logprobs)
    elif importance_sampling is not None:
        raise ValueError(f"{fn}: `importance_sampling` needs `behavior_logprobs`")

    log_ratio = safe_log_ratio(logprobs, old_logprobs.detach(), mask)  # [B, T], 0 at masked
    ratio = log_ratio.exp()
    per_token, metrics = _clipped_surrogate(ratio, adv, mask, clip_low, clip_high, dual_clip)
    return _weigh_and_aggregate(
        fn, per_token, metrics, ratio, log_ratio, logprobs, old_logprobs, behavior_logprobs, mask,
        aggregate, importance_sampling, entropy,
    )


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregator,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    importance_sampling: ImportanceSampling | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric clip, optional dual clip and optional IS correction.

    Per token: ``w · max(−A ρ, −A clip(ρ, 1 − clip_low, 1 + clip_high))``, for A < 0 further
    bounded by ``−dual_clip · A``; ρ = exp(logprobs − old_logprobs).

    Args:
        logprobs: ``[B, T]`` float, current log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, T]`` float, log-probs under the policy the clip is centred on (the
            trainer's recomputed log-probs at the start of the step, or the behaviour log-probs).
        advantages: ``[B, T]`` per token or ``[B]`` per sequence (broadcast over tokens).
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        aggregate: the step's aggregator with its global normaliser (``make_aggregator``).
        clip_low: ε_low ∈ [0, 1): the ratio floor for A < 0 is 1 − clip_low.
        clip_high: ε_high ≥ 0: the ratio ceiling for A > 0 is 1 + clip_high (DAPO: 0.28).
        dual_clip: c > 1 or None; bounds the loss of A < 0 tokens by −c·A.
        behavior_logprobs: ``[B, T]`` float, the engine's log-probs of the sampled tokens; enables
            the ``mismatch_kl`` metric, and is required by ``importance_sampling``.
        importance_sampling: weight function from ``meshrl.algos.importance`` applied to
            (``old_logprobs``, ``behavior_logprobs``), or None for no correction.
        entropy: ``[B, T]`` float per-token entropy (``entropy_from_logits``), for the metric only.

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``clip_frac_low``, ``clip_frac_high``,
        ``ratio_mean``, ``ratio_max``, ``approx_kl``, ``num_tokens``, and when enabled
        ``dual_clip_frac``, ``mismatch_kl``, ``entropy`` and the ``is_*`` weight metrics.
    """
    return _ppo(
        "ppo_policy_loss", "old_logprobs", logprobs, old_logprobs, advantages, mask, aggregate,
        clip_low, clip_high, dual_clip, behavior_logprobs, importance_sampling, entropy,
    )


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregator,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float | None = None,
    importance_sampling: ImportanceSampling | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO (AReaL): clip around the proximal policy, reweight behaviour → proximal.

    Per token: ``w · max(−A ρ, −A clip(ρ, 1 − clip_low, 1 + clip_high))`` with
    ρ = π_θ/π_prox and w = π_prox/π_behav, the importance weight that makes stale samples
    (generated by an older policy version) an unbiased estimate for the proximal policy. By
    default tokens whose w exceeds ``is_cap`` are dropped (AReaL's behaviour-weight cap);
    ``importance_sampling`` replaces that rule with any weight function (e.g. truncation).

    Args:
        logprobs: ``[B, T]`` float, current log-probs (with grad).
        proximal_logprobs: ``[B, T]`` float, the trainer's recomputed log-probs under the weights
            at the start of this step (π_prox).
        behavior_logprobs: ``[B, T]`` float, the engine's log-probs of the sampled tokens.
        advantages: ``[B, T]`` per token or ``[B]`` per sequence.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        aggregate: the step's aggregator (``make_aggregator``).
        clip_low, clip_high, dual_clip: as in ``ppo_policy_loss``.
        is_cap: drop tokens with π_prox/π_behav > is_cap; None keeps every token.
        importance_sampling: custom weight function; exclusive with ``is_cap``.
        entropy: ``[B, T]`` float per-token entropy, for the metric only.

    Returns:
        ``(loss, metrics)`` as ``ppo_policy_loss``, always with ``mismatch_kl`` and the ``is_*``
        metrics.
    """
    fn = "decoupled_ppo_loss"
    if importance_sampling is not None and is_cap is not None:
        raise ValueError(f"{fn}: pass `is_cap` or `importance_sampling`, not both")
    if importance_sampling is None:
        high = math.inf if is_cap is None else check_coef(fn, "is_cap", is_cap, strict=True)
        importance_sampling = MaskedTokenIS(low=0.0, high=high)
    if behavior_logprobs is None:
        raise ValueError(f"{fn}: `behavior_logprobs` is required")
    return _ppo(
        fn, "proximal_logprobs", logprobs, proximal_logprobs, advantages, mask, aggregate,
        clip_low, clip_high, dual_clip, behavior_logprobs, importance_sampling, entropy,
    )


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregator,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    behavior_logprobs: torch.Tensor | None = None,
    importance_sampling: ImportanceSampling | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: a sequence-level ratio s_i = exp(mean_t log(π_θ/π_old)), clipped per sequence.

    Implemented in GSPO-token form: every valid token of sequence i carries
    s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)] (value s_i, gradient s_i ∇log π_θ(y_t)), so with
    ``seq_mean_token_mean`` aggregation (the paper's) the gradient is exactly GSPO's sequence
    objective, and per-token advantages are allowed.

    Args:
        logprobs: ``[B, T]`` float, current log-probs (with grad).
        old_logprobs: ``[B, T]`` float, log-probs under the policy that the ratio is taken to.
        advantages: ``[B]`` per sequence (the paper) or ``[B, T]`` per token.
        mask: ``[B, T]`` bool (or 0/1), valid response tokens.
        aggregate: the step's aggregator (``make_aggregator``).
        clip_low, clip_high: ε for the sequence ratio (paper: 3e-4 and 4e-4).
        behavior_logprobs, importance_sampling, entropy: as in ``ppo_policy_loss``.

    Returns:
        ``(loss, metrics)`` as ``ppo_policy_loss``; ``ratio_*`` and ``clip_frac_*`` describe the
        sequence ratios, counted once per valid token.
    """
    fn = "gspo_policy_loss"
    check_tensor(fn, "logprobs", logprobs, ndim=2)
    check_like(fn, "old_logprobs", old_logprobs, "logprobs", logprobs)
    mask = check_mask(fn, mask, "logprobs", logprobs)
    adv = zero_masked(check_advantages(fn, advantages, logprobs).detach(), mask)  # [B, T]
    check_clip(fn, clip_low, clip_high, None)
    if behavior_logprobs is not None:
        check_like(fn, "behavior_logprobs", behavior_logprobs, "logprobs", logprobs)
    elif importance_sampling is not None:
        raise ValueError(f"{fn}: `importance_sampling` needs `behavior_logprobs`")

    token_log_ratio = safe_log_ratio(logprobs, old_logprobs.detach(), mask)  # [B, T]
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(token_log_ratio.dtype)  # [B, 1]
    seq_log_ratio = (token_log_ratio.detach().sum(-1, keepdim=True) / lengths).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )  # [B, 1]
    # Value: the sequence ratio. Gradient: ∇ log π_θ of this token (the stop-gradient trick).
    log_ratio = seq_log_ratio + (token_log_ratio - token_log_ratio.detach())  # [B, T]
    log_ratio = zero_masked(log_ratio, mask)
    ratio = log_ratio.exp()
    per_token, metrics = _clipped_surrogate(ratio, adv, mask, clip_low, clip_high, None)
    return _weigh_and_aggregate(
        fn, per_token, metrics, ratio, token_log_ratio, logprobs, old_logprobs, behavior_logprobs, mask,
        aggregate, importance_sampling, entropy,
    )
