"""Per-token entropy of the policy's next-token distribution, for the entropy bonus and metrics.

Simplifications on purpose: computed from full ``[B, T, V]`` logits in one go (no chunking over
T or V), so it costs another ``[B, T, V]`` buffer; the trainer chunks micro-batches by tokens.
"""

from __future__ import annotations

import torch

from ._common import check_tensor


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p_v log p_v of softmax(logits) over the last dim.

    Logits of ``-inf`` (tokens banned by a vocabulary mask) contribute 0, with a 0 gradient, not
    NaN; a row that is all ``-inf`` has no distribution and gives NaN, as softmax does.

    Args:
        logits: ``[B, T, V]`` float (any leading dims), unnormalised next-token scores.

    Returns:
        ``[B, T]`` entropies in nats (differentiable).
    """
    check_tensor("entropy_from_logits", "logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"entropy_from_logits: `logits` needs a non-empty last (vocabulary) dim, got shape "
            f"{tuple(logits.shape)}"
        )
    logp = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    p = logp.exp()
    # 0 · log 0 = 0: select before multiplying so neither value nor gradient sees −inf.
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -(p * safe_logp).sum(-1)
