"""Batched sampling with per-row temperature, top-k, top-p and seed, plus the sampled log-probs.

``sample`` is one verb over ``[B, V]`` float32 logits. The log-prob returned for each token is
``log_softmax(logits / temperature)`` before top-k/top-p truncation (``types.py`` documents why);
greedy rows (temperature 0) use the unscaled logits and take the argmax.

Randomness is counter-based: row b draws one uniform number ``u = hash(seed_b, position_b)`` and
picks the token by inverse CDF. A sample is therefore a pure function of its seed and its logits:
it does not depend on which other requests share the batch and needs no generator state to move
when rows are compacted. ``uniform`` computes u on the device (no host sync, capturable in a CUDA
graph); ``uniform_np`` computes the same numbers on the host, which is cheaper on CPU than a dozen
tiny kernels. Unseeded requests get a seed drawn from the engine's seeded generator.

Simplifications, on purpose: top-k/top-p sort the full vocabulary (only when some row asks for
them); ``min_p``, repetition penalties and logit biases are not implemented.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def mix_seed(seed: int, sample_index: int) -> int:
    """A 32-bit row seed for sample ``sample_index`` of a request seeded with ``seed`` (host side)."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & _MASK32


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) from int64 ``seed`` (< 2**32) and ``position``, on the device. ``[B]``.

    Same values as ``uniform_np``; every product stays below 2**63, so int64 never overflows.
    """
    x = seed ^ ((position * _GOLDEN) & _MASK32)
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (x >> 16) ^ x
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def uniform_np(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """``uniform`` on the host (numpy, uint64): a dozen vector ops instead of a dozen kernel launches."""
    x = seed ^ ((position * np.uint64(_GOLDEN)) & np.uint64(_MASK32))
    c, m, sh = np.uint64(0x45D9F3B), np.uint64(_MASK32), np.uint64(16)
    x = (((x >> sh) ^ x) * c) & m
    x = (((x >> sh) ^ x) * c) & m
    x = (x >> sh) ^ x
    return ((x >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds ``u * total``. ``[B, V] -> [B]``."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = u[:, None] * cdf[:, -1:]  # [B, 1]: unnormalised probs (top-k/top-p zeroed some) are fine
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _filtered_pick(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw after keeping each row's top_k tokens and smallest top_p mass (SGLang's rule). ``[B]``."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly ahead of each token
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = (rank < top_k[:, None]) & (before <= top_p[:, None])
    idx = _pick(sorted_p * keep, u)
    return order.gather(1, idx[:, None]).squeeze(1)


def sample(logits: torch.Tensor, *, inv_temperature: torch.Tensor, u: torch.Tensor | None,
           top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor, filtered: torch.Tensor,
           any_greedy: bool, all_greedy: bool, any_filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob for each row.

    logits: ``[B, V]`` float32. inv_temperature: ``[B]`` (1.0 for greedy rows). u: ``[B]`` the
    row's uniform draw (``uniform(seed, position)``; None when all rows are greedy). top_k: ``[B]``
    int64 (V when off); top_p: ``[B]`` float32 (1.0 when off). greedy, filtered: ``[B]`` bool, rows
    at temperature 0 and rows using top-k/top-p. The ``any_*``/``all_*`` flags are host-side
    summaries of the rows (known without a sync) that skip unneeded work.
    Returns tokens ``[B]`` int64 and log-probs ``[B]`` float32.
    """
    logprobs = torch.log_softmax(logits * inv_temperature[:, None], dim=-1)  # [B, V]
    if all_greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        tokens = _pick(probs, u)
        if any_filtered:
            tokens = torch.where(filtered, _filtered_pick(probs, top_k, top_p, u), tokens)
        if any_greedy:
            tokens = torch.where(greedy, logprobs.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
