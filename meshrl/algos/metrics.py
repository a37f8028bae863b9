"""Loss metrics that are cheap to combine across micro-batches and data-parallel ranks.

Every loss in ``meshrl.algos`` returns ``(loss, metrics)``; ``metrics`` maps a name to a 0-dim
tensor computed under ``torch.no_grad()``. One naming rule says how each is combined:

- ``num_tokens``: the micro-batch's valid-token count; combine by **sum**.
- a name ending in ``_max``: a maximum over the micro-batch's valid tokens (0 when it has none,
  which is neutral because every such metric is non-negative); combine by **max**.
- every other name: a mean over the micro-batch's valid tokens (0 when it has none); combine by
  the mean **weighted by** ``num_tokens``.

Across dp ranks the same rule maps to two all-reduces: SUM of ``(value * num_tokens, num_tokens)``
and MAX of the ``_max`` metrics. Simplification on purpose: sequence-level quantities (GSPO's
sequence ratio, sequence-level importance weights) are reported per token too, so a long
sequence weighs more; one rule for everything beats a second kind of weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NUM_TOKENS = "num_tokens"


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [B, T]`` over the valid positions of bool ``mask [B, T]``; 0 when none are.

    A local statistic for metrics only: losses take their normaliser from an aggregator.
    """
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / mask.sum().clamp(min=1)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of non-negative ``x [B, T]`` over the valid positions of ``mask``; 0 when none are."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).amax()


def metric_reduction(name: str) -> str:
    """How metric ``name`` combines across micro-batches: ``"sum"``, ``"max"`` or ``"mean"``."""
    if name == NUM_TOKENS:
        return "sum"
    if name.endswith("_max"):
        return "max"
    return "mean"


def reduce_metrics(per_microbatch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of several micro-batches (or ranks) into those of their union.

    Args:
        per_microbatch: one metrics dict per micro-batch, each with a ``num_tokens`` entry and
            the same keys.

    Returns:
        One dict with the same keys: sums, maxima and ``num_tokens``-weighted means (see the
        module docstring). If no micro-batch has a valid token, means are 0.
    """
    if not per_microbatch:
        raise ValueError("reduce_metrics: `per_microbatch` is empty; pass at least one dict")
    keys = list(per_microbatch[0])
    for i, m in enumerate(per_microbatch):
        if NUM_TOKENS not in m:
            raise ValueError(f"reduce_metrics: metrics dict {i} has no `{NUM_TOKENS}` entry")
        if set(m) != set(keys):
            raise ValueError(
                f"reduce_metrics: metrics dict {i} has keys {sorted(m)}, expected {sorted(keys)}"
            )
    counts = torch.stack([m[NUM_TOKENS].to(torch.float64) for m in per_microbatch])  # [M]
    total = counts.sum()
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        values = torch.stack([m[key].to(torch.float64) for m in per_microbatch])  # [M]
        kind = metric_reduction(key)
        if kind == "sum":
            out[key] = values.sum()
        elif kind == "max":
            out[key] = values.amax()
        else:
            out[key] = (values * counts).sum() / total.clamp(min=1)
    return out
