"""A static KV cache: one preallocated row per running sequence, sized from a memory budget.

Layout ``kv[L, 2, rows, Hkv, S, D]`` (2 = key, value), allocated once. A running sequence owns
one row; the engine keeps running rows packed at ``[0, B)`` (``move_rows`` fills holes left by
finished sequences), so decode attention reads the contiguous views ``kv[l, :, :B, :, :S]`` with no
gather. A decode step writes one position per row with a single ``index_put_`` per layer, whose
flat indices are computed once per step and shared by all layers.

On CUDA (when Triton is installed) two kernels replace the decode step's torch ops around the cache:
``rope_and_write`` rotates q and k and stores k and v at each row's position (one launch instead of
~6), and ``decode_attention`` is a flash-decoding kernel: each program takes one (row, kv head) and
all the query heads that share it (GQA without repeating k/v), reads only the row's ``pos + 1``
valid positions (the static ``max_seq_len`` of a CUDA graph costs nothing), keeps scores and the
softmax in float32, and, when rows x kv heads are too few to fill the GPU, splits positions over
programs and merges their partial softmaxes in a second launch. The torch paths (model.py) stay the
reference and the CPU implementation.

Colocated with a trainer (``meshrl.actors.hybrid``), ``release`` gives the cache's memory back to
torch's caching allocator (no ``empty_cache``: training reuses the block) and ``restore`` takes it
again; every view of ``kv`` stays valid (they share its storage), and ``restore`` says whether the
address moved (CUDA graphs captured over the old one must then be captured again). The restored
contents are undefined (``stale``): the engine zeroes what attention may read before it is written.

Simplifications, on purpose: no paging and no prefix sharing (the ``n`` samples of a prompt share
its prefill *compute*; its KV is copied into each sample's row), and every row reserves
``max_seq_len`` positions, so the budget is ``rows * bytes_per_row``.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: model.py uses its torch paths
    triton = None

# Triton's CPU interpreter (tests without a GPU) miscomputes bf16 tl.dot; there the kernels upcast
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


def triton_kernels_available(device: torch.device) -> bool:
    """Whether the Triton decode kernels can run on ``device`` (``MESHRL_NO_TRITON=1`` turns them off)."""
    if triton is None or os.environ.get("MESHRL_NO_TRITON") == "1":
        return False
    return device.type == "cuda" or _DOT_F32


class KVCache:
    """Keys and values for ``rows`` sequences of up to ``max_seq_len`` tokens, in every layer."""

    def __init__(self, *, num_layers: int, rows: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if rows < 1:
            raise ValueError(f"the KV cache needs at least one row, got rows={rows}")
        self.rows, self.max_seq_len, self.num_kv_heads = rows, max_seq_len, num_kv_heads
        self.kv = torch.zeros(num_layers, 2, rows, num_kv_heads, max_seq_len, head_dim, dtype=dtype, device=device)
        self._flat = [self.kv[i].view(-1, head_dim) for i in range(num_layers)]  # [2*rows*Hkv*S, D]
        self.positions = torch.arange(max_seq_len, device=device)  # [S]
        # flat index of (kind, row 0, head, position 0); a row adds Hkv*S, a position adds 1
        kind = torch.arange(2, device=device)[:, None]
        head = torch.arange(num_kv_heads, device=device)[None, :]
        self._write_base = ((kind * rows * num_kv_heads + head) * max_seq_len)[None]  # [1, 2, Hkv]
        self._row_offset = torch.arange(rows, device=device) * (num_kv_heads * max_seq_len)  # [rows]
        self._nbytes = self.kv.untyped_storage().nbytes()
        self._ptr = self.kv.data_ptr()
        self.released = False
        self.stale = False
        """Restored after a release: positions not written since hold garbage (possibly NaN bit patterns)."""

    @staticmethod
    def bytes_per_row(*, num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                      dtype: torch.dtype) -> int:
        """Bytes one sequence's row occupies (keys and values, every layer)."""
        return 2 * num_layers * num_kv_heads * max_seq_len * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def release(self) -> None:
        """Free the cache's memory (to the caching allocator); its tensors stay, empty, until ``restore``."""
        if not self.released:
            self.kv.untyped_storage().resize_(0)
            self.released = True

    def restore(self) -> bool:
        """Allocate the memory again (same size); returns whether its address changed. Contents are
        undefined afterwards (``stale``)."""
        if not self.released:
            return False
        self.kv.untyped_storage().resize_(self._nbytes)
        self.released, self.stale = False, True
        moved, self._ptr = self.kv.data_ptr() != self._ptr, self.kv.data_ptr()
        return moved

    def decode_write_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat indices ``[B, 2, Hkv]`` where rows ``[0, B)`` write the key/value of position ``pos``."""
        b = pos.shape[0]
        return self._write_base + (self._row_offset[:b] + pos)[:, None, None]

    def write_index(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat indices ``[K, 2, Hkv]`` of position ``pos[i]`` in cache row ``rows[i]``."""
        return self._write_base + (self._row_offset[rows] + pos)[:, None, None]

    def write_decode(self, layer: int, index: torch.Tensor, kv_new: torch.Tensor) -> None:
        """Store ``kv_new[K, 2, Hkv, D]`` (keys then values) at flat ``index`` ``[K, 2, Hkv]``."""
        self._flat[layer].index_put_((index,), kv_new)

    def rows_prefix(self, layer: int, rows: torch.Tensor, rows_start: int | None, s: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, Hkv, s, D]`` of the given rows: a view when they are consecutive."""
        if rows_start is not None:
            kv = self.kv[layer, :, rows_start: rows_start + rows.shape[0], :, :s]
        else:
            kv = self.kv[layer, :, :, :, :s].index_select(1, rows)
        return kv[0], kv[1]

    def layer_prefix(self, layer: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of keys and values ``[b, Hkv, s, D]`` of rows ``[0, b)``, positions ``[0, s)``."""
        kv = self.kv[layer, :, :b, :, :s]
        return kv[0], kv[1]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, seq_len: int) -> None:
        """Copy positions ``[0, seq_len)`` of rows ``src`` into rows ``dst`` (disjoint sets; sources may repeat)."""
        view = self.kv[:, :, :, :, :seq_len]
        view.index_copy_(2, dst, view.index_select(2, src))


# ---- Triton decode kernels ------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rope_write_kernel(qkv_ptr, qkv_stride, pos_ptr, pos_stride, rope_ptr, kv_ptr, stride_kind, stride_row,
                           stride_head, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
        # one program per (row, head of q|k|v); rope table rows are [cos | signed sin]
        b, j = tl.program_id(0), tl.program_id(1)
        pos = tl.load(pos_ptr + b * pos_stride)
        d = tl.arange(0, D)
        src = qkv_ptr + b * qkv_stride + j * D
        x = tl.load(src + d).to(tl.float32)
        if j < H + HKV:  # q and k rotate: x * cos + roll(x, D/2) * signed_sin, rounded once
            partner = tl.load(src + (d + D // 2) % D).to(tl.float32)
            cos = tl.load(rope_ptr + pos * 2 * D + d).to(tl.float32)
            sin = tl.load(rope_ptr + pos * 2 * D + D + d).to(tl.float32)
            x = x * cos + partner * sin
        if j < H:
            tl.store(src + d, x.to(qkv_ptr.dtype.element_ty))  # q stays in qkv for the attention kernel
        else:
            kind, h = (j - H) // HKV, (j - H) % HKV
            dst = kv_ptr + kind * stride_kind + b * stride_row + h * stride_head + pos * D
            tl.store(dst + d, x.to(kv_ptr.dtype.element_ty))

    @triton.jit
    def _decode_attn_kernel(q_ptr, q_stride, kv_ptr, stride_kind, stride_row, stride_head, pos_ptr, pos_stride,
                            out_ptr, out_stride, part_ptr, ml_ptr, qk_scale, chunk, splits,
                            H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
        # one program per (row, kv head, split of positions); its G query heads form the dot's M
        b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = sp * chunk
        end = tl.minimum(tl.load(pos_ptr + b * pos_stride).to(tl.int32) + 1, start + chunk)  # the row's positions
        g, d, n = tl.arange(0, G_PAD), tl.arange(0, D), tl.arange(0, BLOCK_N)
        heads = kvh * G + g
        q = tl.load(q_ptr + b * q_stride + heads[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = kv_ptr + b * stride_row + kvh * stride_head
        v_base = k_base + stride_kind
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (log2 units)
        l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            idx = n0 + n
            valid = idx < end
            k = tl.load(k_base + idx[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_base + idx[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            if DOT_F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [G_PAD, BLOCK_N], float32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # probabilities in bf16, as flash attention
            m_i = m_new
        hmask = (g < G)[:, None]
        if not SPLIT:
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * out_stride + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=hmask)
        else:  # partial softmax of this split: merged by _merge_splits_kernel
            row = (b * H + heads) * splits + sp  # [G_PAD]
            tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=hmask)
            tl.store(ml_ptr + row * 2, m_i, mask=g < G)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=g < G)

    @triton.jit
    def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, out_stride, splits, H: tl.constexpr, D: tl.constexpr,
                             SPLITS_PAD: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        sp, d = tl.arange(0, SPLITS_PAD), tl.arange(0, D)
        row = (b * H + h) * splits + sp
        used = sp < splits
        m = tl.load(ml_ptr + row * 2, mask=used, other=float("-inf"))  # -inf: a split past the row's length
        w = tl.exp2(m - tl.max(m, 0))
        l_sum = tl.sum(tl.load(ml_ptr + row * 2 + 1, mask=used, other=0.0) * w, 0)
        acc = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / l_sum
        tl.store(out_ptr + b * out_stride + h * D + d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def rope_and_write(cache: KVCache, layer: int, qkv: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor,
                   num_heads: int) -> None:
    """Rotate q in place in ``qkv`` ``[B, (H + 2Hkv) * D]``; store rotated k and v at ``pos`` ``[B]`` of rows [0, B).

    ``rope``: ``[max_len, 2, D]`` cos and signed sin (``Transformer.rope_table``).
    """
    b, d, hkv = qkv.shape[0], rope.shape[-1], cache.num_kv_heads
    kv = cache.kv[layer]  # [2, rows, Hkv, S, D]
    _rope_write_kernel[(b, num_heads + 2 * hkv)](qkv, qkv.stride(0), pos, pos.stride(0), rope, kv, kv.stride(0),
                                                 kv.stride(1), kv.stride(2), H=num_heads, HKV=hkv, D=d, num_warps=1)


def decode_attention(cache: KVCache, layer: int, qkv: torch.Tensor, pos: torch.Tensor, num_heads: int,
                     scale: float, seq_bound: int) -> torch.Tensor:
    """Attention of rows [0, B) over their cached positions ``[0, pos]``; returns ``[B, H * D]``.

    q is read from ``qkv`` (after ``rope_and_write``). ``seq_bound`` (host-known, >= max(pos) + 1)
    only decides how positions are split over programs; each program stops at its row's length.
    """
    b, hkv, d = qkv.shape[0], cache.num_kv_heads, cache.kv.shape[-1]
    kv = cache.kv[layer]
    g = num_heads // hkv
    block_n = 64
    splits = max(1, min(triton.cdiv(seq_bound, 256), triton.cdiv(_sm_count(qkv.device), b * hkv)))
    chunk = triton.cdiv(triton.cdiv(seq_bound, splits), block_n) * block_n
    splits = triton.cdiv(seq_bound, chunk)
    out = qkv.new_empty(b, num_heads * d)
    if splits > 1:
        part = torch.empty(b * num_heads * splits, d, dtype=torch.float32, device=qkv.device)
        ml = torch.empty(b * num_heads * splits, 2, dtype=torch.float32, device=qkv.device)
    else:
        part = ml = out  # unused
    _decode_attn_kernel[(b, hkv, splits)](
        qkv, qkv.stride(0), kv, kv.stride(0), kv.stride(1), kv.stride(2), pos, pos.stride(0), out, out.stride(0), part, ml,
        scale * 1.4426950408889634, chunk, splits, H=num_heads, G=g, G_PAD=max(16, triton.next_power_of_2(g)),
        D=d, BLOCK_N=block_n, SPLIT=splits > 1, DOT_F32=_DOT_F32, num_warps=4)
    if splits > 1:
        _merge_splits_kernel[(b, num_heads)](part, ml, out, out.stride(0), splits, H=num_heads, D=d,
                                             SPLITS_PAD=triton.next_power_of_2(splits), num_warps=1)
    return out
