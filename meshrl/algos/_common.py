"""Argument checks and masked-tensor helpers shared by every function in ``meshrl.algos``.

Simplifications on purpose: checks look at shapes and dtypes only, never at values, because a
value check (``mask.all()``, ``x.isfinite().all()``) is a host-device sync on the training hot
path. Masks are accepted as ``bool`` or as 0/1 integer/float tensors; any non-zero entry counts
as valid.
"""

from __future__ import annotations

import torch

# exp(20) ≈ 4.9e8: far past any clip range, yet finite in float16/bfloat16/float32, so a wild
# log-ratio (a token the engine sampled at -inf, a stale sample) cannot overflow to inf.
MAX_LOG_RATIO = 20.0


def check_tensor(fn: str, name: str, x: object, *, ndim: int | None = None) -> torch.Tensor:
    """Check that ``x`` is a floating-point tensor (of ``ndim`` dims when given)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{fn}: `{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"{fn}: `{name}` must have {ndim} dims, got shape {tuple(x.shape)}"
        )
    return x


def check_like(fn: str, name: str, x: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Check that ``x`` is a floating-point tensor with exactly the shape of ``ref``."""
    check_tensor(fn, name, x)
    assert isinstance(x, torch.Tensor)
    if x.shape != ref.shape:
        raise ValueError(
            f"{fn}: `{name}` has shape {tuple(x.shape)} but `{ref_name}` has shape "
            f"{tuple(ref.shape)}; they must match"
        )
    return x


def check_mask(fn: str, mask: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor after checking that it has the shape of ``ref``."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{fn}: `mask` must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise ValueError(f"{fn}: `mask` must be bool or 0/1 integer/float, got dtype {mask.dtype}")
    if mask.shape != ref.shape:
        raise ValueError(
            f"{fn}: `mask` has shape {tuple(mask.shape)} but `{ref_name}` has shape "
            f"{tuple(ref.shape)}; they must match"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def check_advantages(fn: str, advantages: object, ref: torch.Tensor) -> torch.Tensor:
    """Return advantages as ``[B, T]``: a ``[B]`` tensor (one per sequence) is broadcast."""
    check_tensor(fn, "advantages", advantages)
    assert isinstance(advantages, torch.Tensor)
    if advantages.shape == ref.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == ref.shape[0]:
        return advantages.unsqueeze(-1).expand_as(ref)
    raise ValueError(
        f"{fn}: `advantages` has shape {tuple(advantages.shape)}; it must be [B, T] = "
        f"{tuple(ref.shape)} (per token) or [B] = ({ref.shape[0]},) (per sequence)"
    )


def check_coef(
    fn: str, name: str, value: object, *, low: float = 0.0, strict: bool = False
) -> float:
    """Check that ``value`` is a finite real number ``>= low`` (``> low`` when ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{fn}: `{name}` must be a number, got {type(value).__name__}")
    v = float(value)
    if not (v == v and abs(v) != float("inf")) or v < low or (strict and v == low):
        op = ">" if strict else ">="
        raise ValueError(f"{fn}: `{name}` must be finite and {op} {low}, got {value!r}")
    return v


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked positions set to 0 by selection, not multiplication.

    ``torch.where`` gives masked entries a gradient of exactly zero even when they hold inf or
    NaN, where ``x * mask`` would give ``0 * inf = NaN``. Apply it to raw inputs *before* any
    non-linearity so that nothing downstream ever sees the garbage.
    """
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def safe_log_ratio(
    logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log π/π_other`` per token, 0 at masked positions, clamped to ±MAX_LOG_RATIO.

    The clamp also stops the gradient outside the range: a token 20 nats off-policy has no
    trustworthy gradient anyway.
    """
    diff = zero_masked(logprobs, mask) - zero_masked(other_logprobs, mask)  # [B, T]
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
