"""Batched sampling with per-row temperature, top-k, top-p and seed, plus the sampled log-probs.

``sample`` is one verb over ``[B, V]`` float32 logits. The log-prob returned for each token is
``log_softmax(logits / temperature)`` before top-k/top-p truncation (``types.py`` documents why);
greedy rows (temperature below 1e-6: ``SamplingParams.greedy``) use the unscaled logits and take the argmax.

Randomness is counter-based: row b draws one uniform number ``u = hash(seed_b, position_b)`` and
picks the token by inverse CDF. A sample is therefore a pure function of its seed and its logits:
it does not depend on which other requests share the batch and needs no generator state to move
when rows are compacted. ``uniform`` computes u on the device (no host sync, capturable in a CUDA
graph); ``uniform_np`` computes the same numbers on the host, which is cheaper on CPU than a dozen
tiny kernels. Unseeded requests get a seed drawn from the engine's seeded generator.

On CUDA (with Triton), ``sample_and_record_fused`` does the same draw for batches without
top-k/top-p rows in two launches straight from the LM head's bf16 logits: per (row, vocabulary
block) the max, the sum of ``exp`` and the argmax; then per row the log-normaliser, the block that
holds ``u * total`` mass and the token inside it, its log-prob, and the bookkeeping writes (output
buffers, next input token, position). The torch version reads and writes ``[B, V]`` float32 arrays
about ten times (scale, log-softmax, exp, cumsum, searchsorted, argmax, gather...), which at B=128,
V=152k is most of a small model's step. Both compute the same function (up to float rounding at
CDF boundaries).

Simplifications, on purpose: top-k/top-p sort the full vocabulary (only when some row asks for
them, eagerly, outside CUDA graphs); ``min_p``, repetition penalties and logit biases are not
implemented.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: ``sample`` is used
    triton = None

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def mix_seed(seed: int, sample_index: int) -> int:
    """A 32-bit row seed for sample ``sample_index`` of a request seeded with ``seed`` (host side)."""
    seed, sample_index = int(seed), int(sample_index)  # numpy integers would overflow below
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & _MASK32


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) from int64 ``seed`` (< 2**32) and ``position``, on the device. ``[B]``.

    Same values as ``uniform_np``; every product stays below 2**63, so int64 never overflows. The
    draw is ``(k + 0.5) / 2**23`` for the hash's top 23 bits ``k``: exact in float32, so never 0 or 1
    (24 bits put ``(2**24 - 0.5) / 2**24`` at 1.0 by rounding, which picked the last vocabulary
    entry whatever its mass, past top-k/top-p, once in 2**24 draws).
    """
    x = seed ^ ((position * _GOLDEN) & _MASK32)
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (x >> 16) ^ x
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform_np(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """``uniform`` on the host (numpy, uint64): a dozen vector ops instead of a dozen kernel launches."""
    x = seed ^ ((position * np.uint64(_GOLDEN)) & np.uint64(_MASK32))
    c, m, sh = np.uint64(0x45D9F3B), np.uint64(_MASK32), np.uint64(16)
    x = (((x >> sh) ^ x) * c) & m
    x = (((x >> sh) ^ x) * c) & m
    x = (x >> sh) ^ x
    return ((x >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 23))


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds ``u * total``. ``[B, V] -> [B]``."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    # [B, 1]: unnormalised probs (top-k/top-p zeroed some) are fine; kept below the total, so the pick is
    # a token with mass even where u * total rounds up to it
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
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


# ---- fused CUDA sampler ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _block_stats_kernel(logits_ptr, logits_stride, fstate_ptr, fstate_stride, part_ptr, vocab,
                            NB_PAD: tl.constexpr, BLOCK: tl.constexpr):
        # per (row, vocab block): max and sum of exp of logits * inv_temperature, and the argmax
        b, j = tl.program_id(0), tl.program_id(1)
        c = j * BLOCK + tl.arange(0, BLOCK)
        inv_t = tl.load(fstate_ptr + b * fstate_stride)
        z = tl.load(logits_ptr + b * logits_stride + c, mask=c < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m = tl.max(z, 0)
        base = part_ptr + (b * NB_PAD + j) * 3
        tl.store(base, m)
        tl.store(base + 1, tl.sum(tl.exp(z - m), 0))
        tl.store(base + 2, (j * BLOCK + tl.argmax(z, 0)).to(tl.float32))  # exact: vocab < 2**24

    @triton.jit
    def _pick_and_record_kernel(logits_ptr, logits_stride, fstate_ptr, fstate_stride, flags_ptr, flags_stride,
                                ist_ptr, ist_stride, part_ptr, out_tok_ptr, out_lp_ptr, out_stride, vocab, nb,
                                NB_PAD: tl.constexpr, BLOCK: tl.constexpr, TOK: tl.constexpr, POS: tl.constexpr,
                                OCOL: tl.constexpr, SEED: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, NB_PAD)
        base = part_ptr + (b * NB_PAD + j) * 3
        m = tl.load(base, mask=j < nb, other=float("-inf"))
        m_max = tl.max(m, 0)
        w = tl.load(base + 1, mask=j < nb, other=0.0) * tl.exp(m - m_max)  # each block's mass
        total = tl.sum(w, 0)
        row = ist_ptr + b * ist_stride
        col = tl.load(row + OCOL)
        # u = uniform(seed, output column), the integer hash of ``uniform`` above, bit for bit
        x = tl.load(row + SEED) ^ ((col * 0x9E3779B1) & 0xFFFFFFFF)
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (x >> 16) ^ x
        target = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0) * total
        # inverse CDF: first the block whose cumulative mass passes target, then the token inside it
        cum = tl.cumsum(w, 0)
        jb = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), nb - 1)
        before = tl.sum(tl.where(j < jb, w, 0.0), 0)
        inv_t = tl.load(fstate_ptr + b * fstate_stride)
        i = tl.arange(0, BLOCK)
        c = jb * BLOCK + i
        z = tl.load(logits_ptr + b * logits_stride + c, mask=c < vocab, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(z - m_max)
        k = tl.sum((tl.cumsum(p, 0) + before <= target).to(tl.int32), 0)
        k = tl.minimum(k, tl.max(tl.where(p > 0, i, 0), 0))  # rounding at the block's end: its last token with mass
        tok_sampled = jb * BLOCK + k
        # greedy rows: the first maximal logit (first block holding the max, then its first argmax)
        tok_greedy = tl.sum(tl.where(j == tl.argmax(m, 0), tl.load(base + 2, mask=j < nb, other=0.0), 0.0), 0)
        tok = tl.where(tl.load(flags_ptr + b * flags_stride), tok_greedy.to(tl.int32), tok_sampled).to(tl.int64)
        lp = tl.load(logits_ptr + b * logits_stride + tok).to(tl.float32) * inv_t - (m_max + tl.log(total))
        tl.store(out_tok_ptr + b * out_stride + col, tok)
        tl.store(out_lp_ptr + b * out_stride + col, lp)
        tl.store(row + TOK, tok)
        tl.store(row + POS, tl.load(row + POS) + 1)
        tl.store(row + OCOL, col + 1)


def sample_and_record_fused(logits: torch.Tensor, istate: torch.Tensor, fstate: torch.Tensor, flags: torch.Tensor,
                            out_tok: torch.Tensor, out_lp: torch.Tensor, *, cols: tuple[int, int, int, int]) -> None:
    """``sample`` + recording for rows [0, B) without top-k/top-p, in two Triton launches (CUDA).

    logits: ``[B, V]`` (bf16 straight from the LM head is fine: it is upcast in registers).
    istate ``[rows, C]`` int64 with columns ``cols = (token, position, output column, seed)``;
    fstate ``[rows, 2]`` (column 0: inv_temperature); flags ``[rows, 2]`` bool (column 0: greedy);
    out_tok/out_lp ``[rows, cap]``. Writes token and log-prob at each row's output column, sets the
    next input token and advances position and output column, exactly as ``RunningBatch`` does.
    """
    b, v = logits.shape
    block = min(8192, triton.next_power_of_2(v))
    nb = triton.cdiv(v, block)
    nb_pad = max(16, triton.next_power_of_2(nb))
    part = torch.empty(b, nb_pad, 3, dtype=torch.float32, device=logits.device)
    _block_stats_kernel[(b, nb)](logits, logits.stride(0), fstate, fstate.stride(0), part, v, NB_PAD=nb_pad,
                                 BLOCK=block, num_warps=8)
    tok, pos, ocol, seed = cols
    _pick_and_record_kernel[(b,)](logits, logits.stride(0), fstate, fstate.stride(0), flags, flags.stride(0),
                                  istate, istate.stride(0), part, out_tok, out_lp, out_tok.stride(0), v, nb,
                                  NB_PAD=nb_pad, BLOCK=block, TOK=tok, POS=pos, OCOL=ocol, SEED=seed, num_warps=8)
