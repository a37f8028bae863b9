"""Loss aggregation: a per-token loss ``[B, T]`` becomes one scalar, with an explicit normaliser.

A loss summed over a micro-batch and divided by a *global* count (valid tokens or sequences over
every micro-batch and every dp rank of the step) makes the step's gradient independent of how the
batch was split: the sum of the micro-batch gradients is the gradient of the whole batch. Dividing
by a local ``.mean()`` would not be, which is why no loss here ever calls one.

Three modes, each a small callable built once per step by the trainer (``make_aggregator``):

- ``token_mean``: Σ_valid x / num_tokens. Every token weighs the same (DAPO).
- ``seq_mean_token_mean``: Σ_seq (mean of the sequence's valid tokens) / num_seqs. Every
  sequence weighs the same (the original GRPO); short answers' tokens weigh more.
- ``seq_mean_token_sum``: Σ_valid x / (num_seqs · max_tokens), a constant normaliser
  (Dr. GRPO), which removes the length bias of dividing by each sequence's own length.

Simplification on purpose: micro-batches split a batch by whole sequences (rows), never inside
a sequence; ``seq_mean_token_mean`` is only split-invariant under that rule.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ._common import check_mask, check_tensor, zero_masked

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


class Aggregator(Protocol):
    """Anything that turns a per-token loss ``[B, T]`` and its mask ``[B, T]`` into a scalar."""

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


def _normaliser(cls: str, name: str, value: object) -> float:
    # A 0-dim tensor (an all-reduced count) is accepted too; float() syncs once per step, not per
    # micro-batch, because the aggregator is built once per step.
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{cls}: `{name}` must be a number or 0-dim tensor, got {tuple(value.shape)}"
            )
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}: `{name}` must be a number, got {type(value).__name__}")
    v = float(value)
    if not (v > 0 and v != float("inf")):
        raise ValueError(f"{cls}: `{name}` must be a finite count > 0, got {value!r}")
    return v


def _check(cls: str, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_tensor(cls, "per_token", per_token, ndim=2)
    return check_mask(cls, mask, "per_token", per_token)


class TokenMean:
    """Σ over valid tokens of ``per_token``, divided by the global valid-token count.

    Args:
        num_tokens: valid tokens in the whole step, across micro-batches and dp ranks (> 0).
    """

    def __init__(self, num_tokens: float):
        self.num_tokens = _normaliser("TokenMean", "num_tokens", num_tokens)

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_token [B, T]``, ``mask [B, T]`` (valid = non-zero) → 0-dim loss."""
        mask = _check("TokenMean", per_token, mask)
        return zero_masked(per_token, mask).sum() / self.num_tokens

    def __repr__(self) -> str:
        return f"TokenMean(num_tokens={self.num_tokens:g})"


class SeqMeanTokenMean:
    """Σ over sequences of each sequence's valid-token mean, divided by the global sequence count.

    A sequence with no valid token contributes 0.

    Args:
        num_seqs: sequences in the whole step, across micro-batches and dp ranks (> 0); normally
            those with at least one valid token.
    """

    def __init__(self, num_seqs: float):
        self.num_seqs = _normaliser("SeqMeanTokenMean", "num_seqs", num_seqs)

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_token [B, T]``, ``mask [B, T]`` (valid = non-zero) → 0-dim loss."""
        mask = _check("SeqMeanTokenMean", per_token, mask)
        seq_sum = zero_masked(per_token, mask).sum(-1)  # [B]
        seq_len = mask.sum(-1).clamp(min=1).to(per_token.dtype)  # [B]
        return (seq_sum / seq_len).sum() / self.num_seqs

    def __repr__(self) -> str:
        return f"SeqMeanTokenMean(num_seqs={self.num_seqs:g})"


class SeqMeanTokenSum:
    """Σ over valid tokens, divided by ``num_seqs · max_tokens`` (Dr. GRPO's constant normaliser).

    Args:
        num_seqs: sequences in the whole step, across micro-batches and dp ranks (> 0).
        max_tokens: the constant that replaces each sequence's length, normally the generation
            budget (max response tokens); 1 gives the plain sequence-mean of token-sums.
    """

    def __init__(self, num_seqs: float, max_tokens: float):
        self.num_seqs = _normaliser("SeqMeanTokenSum", "num_seqs", num_seqs)
        self.max_tokens = _normaliser("SeqMeanTokenSum", "max_tokens", max_tokens)

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_token [B, T]``, ``mask [B, T]`` (valid = non-zero) → 0-dim loss."""
        mask = _check("SeqMeanTokenSum", per_token, mask)
        return zero_masked(per_token, mask).sum() / (self.num_seqs * self.max_tokens)

    def __repr__(self) -> str:
        return f"SeqMeanTokenSum(num_seqs={self.num_seqs:g}, max_tokens={self.max_tokens:g})"


def make_aggregator(
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_tokens: float | None = None,
) -> Aggregator:
    """Build the aggregator for ``algo.aggregation = mode`` from the step's global counts.

    The one place a mode name becomes a function; the trainer calls it once per step and passes
    the result to every loss as ``aggregate=``.

    Args:
        mode: ``"token_mean"`` | ``"seq_mean_token_mean"`` | ``"seq_mean_token_sum"``.
        num_tokens: global valid-token count (needed by ``token_mean``).
        num_seqs: global sequence count (needed by the two ``seq_mean_*`` modes).
        max_tokens: constant per-sequence length (needed by ``seq_mean_token_sum``).
    """

    def need(name: str, value: float | None) -> float:
        if value is None:
            raise ValueError(f"make_aggregator: mode {mode!r} needs `{name}`")
        return value

    if mode == "token_mean":
        return TokenMean(need("num_tokens", num_tokens))
    if mode == "seq_mean_token_mean":
        return SeqMeanTokenMean(need("num_seqs", num_seqs))
    if mode == "seq_mean_token_sum":
        return SeqMeanTokenSum(need("num_seqs", num_seqs), need("max_tokens", max_tokens))
    raise ValueError(
        f"make_aggregator: unknown aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}"
    )
