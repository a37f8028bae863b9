"""Importance weights that correct for tokens sampled by a different policy than the one trained.

In asynchronous training a sample's tokens come from the *behaviour* policy (the engine, possibly
several versions old, in another precision and kernel set), while the loss is computed against a
*target* policy (the trainer's recomputed old/proximal log-probs). The per-token importance ratio
ρ_t = π_target(y_t) / π_behaviour(y_t) makes the gradient unbiased again, at the cost of variance;
these weight functions trade some of the bias back for bounded variance:

- ``TruncatedTokenIS(cap)``: w_t = min(ρ_t, cap) (truncated IS, Ionides 2008; for LLM RL Yao et
  al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
- ``TruncatedSeqIS(cap)``: w_i = min(Π_t ρ_t, cap) for every token of sequence i.
- ``MaskedTokenIS(low, high)``: w_t = ρ_t if low ≤ ρ_t ≤ high else 0 (masked IS: drop the token;
  Liu, Li et al. 2025, "When speed kills stability"; IcePop in Ring-1T).
- ``MaskedSeqIS(low, high)``: the same with the sequence ratio Π_t ρ_t, dropping whole sequences.

Each is a small callable built once (``make_importance_sampling``) and handed to a policy loss
(``importance_sampling=``), which multiplies its per-token loss by the weights.

Simplifications on purpose: weights are detached (they correct the sampling distribution, they
are not trained through); a dropped token keeps counting in the loss normaliser (the trainer may
count only kept tokens instead: the weights depend on no trainable parameter, so they can be
computed for the whole batch before the step); log-ratios are clamped to ±20 before ``exp``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch

from ._common import (
    MAX_LOG_RATIO,
    check_coef,
    check_like,
    check_mask,
    check_tensor,
    safe_log_ratio,
)
from .metrics import masked_max, masked_mean

IMPORTANCE_SAMPLING_MODES = (
    "none",
    "truncated_token",
    "truncated_seq",
    "masked_token",
    "masked_seq",
)


class ISWeights(NamedTuple):
    """Importance weights and their metrics."""

    weights: torch.Tensor
    """``[B, T]`` detached weights, 0 at masked positions and at dropped tokens."""
    metrics: dict[str, torch.Tensor]
    """``is_weight_mean``, ``is_weight_max`` and ``is_truncated_frac`` or ``is_dropped_frac``:
    token-weighted over the valid tokens (reduction rules in ``meshrl.algos.metrics``)."""


class ImportanceSampling(Protocol):
    """Maps ``(target_logprobs [B, T], behavior_logprobs [B, T], mask [B, T])`` to ISWeights."""

    def __call__(
        self, target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ISWeights: ...


def _log_ratios(
    fn: str, target: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, *, per_seq: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached ``log ρ`` per token ``[B, T]`` (per sequence, broadcast, when ``per_seq``)."""
    check_tensor(fn, "target_logprobs", target, ndim=2)
    check_like(fn, "behavior_logprobs", behavior, "target_logprobs", target)
    mask = check_mask(fn, mask, "target_logprobs", target)
    log_rho = safe_log_ratio(target.detach(), behavior.detach(), mask)  # [B, T]
    if per_seq:
        seq = log_rho.sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, 1]
        log_rho = seq.expand_as(log_rho)
    return log_rho, mask


def _check_bounds(fn: str, low: float, high: float) -> tuple[float, float]:
    low = check_coef(fn, "low", low)
    if isinstance(high, bool) or not isinstance(high, (int, float)) or math.isnan(high):
        raise ValueError(f"{fn}: `high` must be a number, got {high!r}")
    if not high > low:
        raise ValueError(f"{fn}: need low < high, got low={low!r}, high={high!r}")
    return low, float(high)


class _Truncated:
    per_seq: bool

    def __init__(self, cap: float):
        self.cap = check_coef(type(self).__name__, "cap", cap, strict=True)

    @torch.no_grad()
    def __call__(
        self, target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ISWeights:
        """Args: ``[B, T]`` target (trainer) and behaviour (engine) log-probs, ``[B, T]`` mask."""
        fn = type(self).__name__
        log_rho, mask = _log_ratios(
            fn, target_logprobs, behavior_logprobs, mask, per_seq=self.per_seq
        )
        rho = log_rho.exp()  # [B, T]
        weights = torch.where(mask, rho.clamp(max=self.cap), rho.new_zeros(()))
        metrics = {
            "is_weight_mean": masked_mean(weights, mask),
            "is_weight_max": masked_max(weights, mask),
            "is_truncated_frac": masked_mean((rho > self.cap).to(rho.dtype), mask),
        }
        return ISWeights(weights, metrics)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cap={self.cap:g})"


class _Masked:
    per_seq: bool

    def __init__(self, low: float, high: float):
        self.low, self.high = _check_bounds(type(self).__name__, low, high)

    @torch.no_grad()
    def __call__(
        self, target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ISWeights:
        """Args: ``[B, T]`` target (trainer) and behaviour (engine) log-probs, ``[B, T]`` mask."""
        fn = type(self).__name__
        log_rho, mask = _log_ratios(
            fn, target_logprobs, behavior_logprobs, mask, per_seq=self.per_seq
        )
        rho = log_rho.exp()  # [B, T]
        kept = mask & (rho >= self.low) & (rho <= self.high)  # [B, T]
        weights = torch.where(kept, rho, rho.new_zeros(()))
        metrics = {
            "is_weight_mean": masked_mean(weights, mask),
            "is_weight_max": masked_max(weights, mask),
            "is_dropped_frac": masked_mean((~kept).to(rho.dtype), mask),
        }
        return ISWeights(weights, metrics)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(low={self.low:g}, high={self.high:g})"


class TruncatedTokenIS(_Truncated):
    """w_t = min(ρ_t, cap) per token. ``cap`` > 0 (typically 2–10)."""

    per_seq = False


class TruncatedSeqIS(_Truncated):
    """w_i = min(Π_t ρ_t, cap) for every valid token of sequence i. ``cap`` > 0."""

    per_seq = True


class MaskedTokenIS(_Masked):
    """w_t = ρ_t where low ≤ ρ_t ≤ high, else 0 (token dropped). ``high`` may be ``math.inf``."""

    per_seq = False


class MaskedSeqIS(_Masked):
    """w_i = Π_t ρ_t where low ≤ Π_t ρ_t ≤ high, else 0 (sequence dropped)."""

    per_seq = True


def make_importance_sampling(
    mode: str,
    *,
    is_cap: float | None = None,
    is_low: float | None = None,
    is_high: float | None = None,
) -> ImportanceSampling | None:
    """Build the weight function for ``algo.importance_sampling = mode`` (``None`` for ``"none"``).

    Args:
        mode: one of ``IMPORTANCE_SAMPLING_MODES``.
        is_cap: truncation cap (``truncated_*`` modes).
        is_low: lower bound of the kept ratio range (``masked_*`` modes).
        is_high: upper bound of the kept ratio range (``masked_*`` modes).
    """

    def need(name: str, value: float | None) -> float:
        if value is None:
            raise ValueError(f"make_importance_sampling: mode {mode!r} needs `{name}`")
        return value

    if mode == "none":
        return None
    if mode == "truncated_token":
        return TruncatedTokenIS(need("is_cap", is_cap))
    if mode == "truncated_seq":
        return TruncatedSeqIS(need("is_cap", is_cap))
    if mode == "masked_token":
        return MaskedTokenIS(need("is_low", is_low), need("is_high", is_high))
    if mode == "masked_seq":
        return MaskedSeqIS(need("is_low", is_low), need("is_high", is_high))
    raise ValueError(
        f"make_importance_sampling: unknown mode {mode!r}; "
        f"choose one of {IMPORTANCE_SAMPLING_MODES}"
    )
