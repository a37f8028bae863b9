"""The decoder (Qwen2/Qwen2.5, Qwen3, Llama) as three verbs: ``prefill``, ``decode_step``, ``logits``.

Parameters live in the engine layout of ``layout.py`` (fused ``qkv`` and ``gate_up``) as plain
tensors in ``Transformer.params``; weight updates copy *into* them, so their addresses never change
(CUDA graphs captured over them stay valid). Under tensor parallelism each rank holds its shard and
the caller passes ``all_reduce``, applied after the row-parallel ``o`` and ``down`` projections; the
model never sees a mesh.

The KV cache is a static slot cache (``kv_cache.py``): one row per running sequence, written in
place. Decode attention reads each row's prefix ``[0, S)`` of the cache under an additive mask.
Prefill packs prompts without padding for everything but attention, and runs the last layer's
attention/MLP for the last prompt token only (the other positions only need their keys/values).

Two implementations of the decode step share everything but the small ops between matmuls. The
torch one (CPU, float32, and the reference): decode attention is plain matmul + softmax under a
mask. The fused one (CUDA with Triton, bf16/fp16): RMSNorm and SiLU*up are one Triton launch each,
RoPE + KV write and attention are the kernels of ``kv_cache.py``, and the LM head's logits stay
bf16 for the fused sampler; a layer is then 9-10 launches (4 of them cuBLAS matmuls) instead of
~25, which is what bounds a small model's step. The fused norms and SiLU round where HF's modules
round (the normalised x before the weight, SiLU's output before the product).

Simplifications, on purpose: no prefix caching; prefill attention is SDPA over a right-padded view
(no paged or varlen kernels), so it runs the same on CPU and GPU.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch paths are used
    triton = None

from meshrl.engines.kv_cache import KVCache, decode_attention, rope_and_write, triton_kernels_available
from meshrl.engines.layout import EngineLayout, ModelSpec


class PackedPrompts:
    """Prompts concatenated without padding, with what prefill needs to place each token.

    tokens, positions, prompt_of: ``[total]`` (id, position in its prompt, prompt index);
    last: ``[N]`` packed index of each prompt's last token; rows: ``[N]`` cache row that receives
    each prompt's KV; rows_start: ``rows[0]`` when rows are consecutive (lets attention read the
    cache through a view), else None; max_len: the longest prompt (host int).
    """

    __slots__ = ("tokens", "positions", "prompt_of", "last", "rows", "rows_start", "max_len")

    def __init__(self, prompts: list[list[int]], rows: list[int], device: torch.device):
        lengths = [len(q) for q in prompts]
        flat = [tok for q in prompts for tok in q]
        pos = [j for n in lengths for j in range(n)]
        owner = [i for i, n in enumerate(lengths) for _ in range(n)]
        ends = list(itertools.accumulate(lengths))
        packed = torch.tensor([flat, pos, owner], dtype=torch.int64).to(device, non_blocking=True)  # one copy
        self.tokens, self.positions, self.prompt_of = packed[0], packed[1], packed[2]
        self.last = torch.tensor([e - 1 for e in ends], dtype=torch.int64).to(device, non_blocking=True)
        self.rows = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        self.rows_start = rows[0] if consecutive else None
        self.max_len = max(lengths)


class _Layer:
    """Views of one decoder layer's parameters (attribute access is cheaper than dict lookups)."""

    __slots__ = ("attn_norm", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w_t", "o_b", "mlp_norm",
                 "gate_up_w", "gate_up_b", "down_w_t", "down_b")

    def __init__(self, params: dict[str, torch.Tensor], i: int):
        p = f"layers.{i}."
        self.attn_norm = params[p + "attn_norm.weight"]
        self.qkv_w = params[p + "qkv.weight"]
        self.qkv_b = params.get(p + "qkv.bias")
        self.q_norm = params.get(p + "q_norm.weight")
        self.k_norm = params.get(p + "k_norm.weight")
        self.o_w_t = params[p + "o.weight"].t()  # transposed views: addmm(x, a, w.t()) fuses the residual
        self.o_b = params.get(p + "o.bias")
        self.mlp_norm = params[p + "mlp_norm.weight"]
        self.gate_up_w = params[p + "gate_up.weight"]
        self.gate_up_b = params.get(p + "gate_up.bias")
        self.down_w_t = params[p + "down.weight"].t()
        self.down_b = params.get(p + "down.bias")


class Transformer:
    """A decoder-only transformer in engine layout, on one device, optionally one TP shard of it."""

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device | str,
                 tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.layout = EngineLayout(spec)
        self.layout.validate_tp(tp_size)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce callable (see meshrl.engines.tp)")
        self.tp_rank, self.tp_size, self.all_reduce = tp_rank, tp_size, all_reduce
        self.num_heads = spec.num_heads // tp_size  # local heads
        self.num_kv_heads = spec.num_kv_heads // tp_size
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.params: dict[str, torch.Tensor] = {
            name: torch.zeros(pl.local_shape(tp_size), dtype=dtype, device=self.device)
            for name, pl in self.layout.params.items()
        }
        self.layers = [_Layer(self.params, i) for i in range(spec.num_layers)]
        self.embed = self.params["embed.weight"]
        self.norm = self.params["norm.weight"]
        self.lm_head = self.params.get("lm_head.weight", self.embed)
        self._rope_len = 0
        d = spec.head_dim
        self.fused_kernels = (triton_kernels_available(self.device) and dtype in (torch.bfloat16, torch.float16)
                              and d >= 16 and d & (d - 1) == 0)
        """Decode with the Triton kernels (see the module docstring); tests may turn it on or off."""

    # ---- weights ----------------------------------------------------------------------------

    def place(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, tuple[slice, ...], torch.Tensor]:
        """This rank's piece of a full HF tensor: ``(engine name, local slice, piece)``; checks shape."""
        name, src, dst = self.layout.placements(hf_name, self.tp_rank, self.tp_size)
        want = self.layout.hf_shape(hf_name)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{hf_name}: expected shape {want}, got {tuple(tensor.shape)}")
        return name, dst, tensor[src]

    @torch.no_grad()
    def load_hf(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors into the parameters now; returns the HF names loaded."""
        loaded = set()
        for hf_name, t in named_tensors:
            if self.layout.is_skipped(hf_name):
                continue
            name, dst, piece = self.place(hf_name, t)
            self.params[name][dst].copy_(piece)
            loaded.add(hf_name)
        return loaded

    @torch.no_grad()
    def get_hf(self, hf_name: str) -> torch.Tensor:
        """One HF-named weight rebuilt from the engine layout (unsharded models only)."""
        if self.tp_size != 1:
            raise ValueError("get_hf needs the whole model; this Transformer holds one TP shard")
        if hf_name == "lm_head.weight" and self.spec.tie_word_embeddings:
            hf_name = "model.embed_tokens.weight"
        name, _, dst = self.layout.placements(hf_name)
        return self.params[name][dst].clone()

    # ---- shared pieces ----------------------------------------------------------------------

    def rope_table(self, max_len: int) -> torch.Tensor:
        """cos and *signed* sin, ``[max_len, 2, D]``, computed exactly as HF's rotary module does.

        ``sin_signed = [-sin_lo, sin_hi]`` turns HF's ``rotate_half(x) * sin`` into
        ``roll(x, D/2) * sin_signed``: one roll instead of a negation plus a concatenation.
        """
        if max_len > self._rope_len:
            inv_freq = torch.tensor(self.spec.rope_inv_freq, dtype=torch.float32)
            freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.spec.rope_attention_scaling).to(self.dtype)
            sin = (emb.sin() * self.spec.rope_attention_scaling).to(self.dtype)
            half = self.head_dim // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._rope = torch.stack((cos, sin), dim=1).to(self.device)
            self._rope_len = max_len
        return self._rope

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim of a 2-D ``x``."""
        if self.fused_kernels:
            return rms_norm_fused(x, weight, self.spec.rms_norm_eps)
        if x.dtype == torch.float32:
            # F.rms_norm is a chain of generic ops on CPU; over a prefill's rows (thousands x
            # hidden) this is 2-4x faster (vector_norm is one reduction kernel); the result differs
            # from it by float32 rounding only (about 1e-6 relative)
            r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            r = r.square_().div_(x.shape[-1]).add_(self.spec.rms_norm_eps).rsqrt_()
            return torch.mul(x, r).mul_(weight)
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)

    def _project(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """Normed fused q/k/v projection (and Qwen3's per-head q/k norms). ``[N, (H + 2Hkv) * D]``."""
        qkv = F.linear(self._norm(x, layer.attn_norm), layer.qkv_w, layer.qkv_b)
        if layer.q_norm is not None:
            nq, nkv, d, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.spec.rms_norm_eps
            qk = qkv[..., : (nq + nkv) * d].unflatten(-1, (nq + nkv, d))  # [..., H + Hkv, D] view
            qk[..., :nq, :] = F.rms_norm(qk[..., :nq, :], (d,), layer.q_norm, eps)
            qk[..., nq:, :] = F.rms_norm(qk[..., nq:, :], (d,), layer.k_norm, eps)
        return qkv

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``_project`` with RoPE applied in place on q and k (torch path)."""
        qkv = self._project(layer, x)  # [..., (H + 2*Hkv) * D]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[..., : (nq + nkv) * d].unflatten(-1, (nq + nkv, d))  # [..., H + Hkv, D] view
        # qk*cos + rotate_half(qk)*sin, written back into qkv so k and v stay adjacent for the cache
        torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin, out=qk)
        return qkv

    def _residual_matmul(self, x: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """``x + a @ w_t (+ bias)`` for 2-D x; one addmm unless TP must all-reduce the product first."""
        if self.all_reduce is None and bias is None:
            # in place: an out-of-place addmm first copies x into its output (one more kernel per call);
            # x is always this step's own residual buffer, which nothing else reads
            return x.addmm_(a, w_t)
        y = torch.mm(a, w_t)
        if self.all_reduce is not None:
            self.all_reduce(y)  # row-parallel: partial sums over this rank's slice of the inner dim
        return x + y if bias is None else x + y + bias

    def _out_and_mlp(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual o-projection, then the residual gated MLP. x: ``[N, hidden]``, attn: ``[N, H*D]``."""
        x = self._residual_matmul(x, attn, layer.o_w_t, layer.o_b)
        gate_up = F.linear(self._norm(x, layer.mlp_norm), layer.gate_up_w, layer.gate_up_b)  # [N, 2 * I]
        if self.fused_kernels:
            act = silu_mul_fused_(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate, inplace=True).mul_(up)  # in place: no new [N, I] buffers on the hot path
        return self._residual_matmul(x, act, layer.down_w_t, layer.down_b)

    def logits(self, x: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Final norm and LM head, in float32 for sampling and log-probs. ``[B, hidden] -> [B, V]``.

        ``float32=False`` keeps the model dtype (the fused sampler upcasts in registers: same values).
        """
        logits = F.linear(self._norm(x, self.norm), self.lm_head)
        return logits.float() if float32 else logits

    # ---- the verbs --------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, p: "PackedPrompts", cache: KVCache) -> torch.Tensor:
        """Run packed prompts (no padding in the matmuls), write their KV into ``p.rows``.

        Matmuls and elementwise work run on the ``[total, hidden]`` packed tokens; only attention
        sees a padded ``[N, H, T, D]`` view (queries scattered in, keys/values read back from the
        cache). Returns ``[N, V]`` float32 logits of each prompt's last token.
        """
        n, t = p.last.shape[0], p.max_len
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cs = self.rope_table(t)[p.positions]  # [total, 2, D]
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # [total, 1, D]: broadcast over heads
        write_idx = cache.write_index(p.rows[p.prompt_of], p.positions)  # [total, 2, Hkv]
        x = F.embedding(p.tokens, self.embed)  # [total, hidden]
        for i, layer in enumerate(self.layers):
            qkv = self._qkv(layer, x, cos, sin)  # [total, (H + 2Hkv) * D]
            cache.write_decode(i, write_idx, qkv[:, nq * d:].unflatten(-1, (2, nkv, d)))
            k, v = cache.rows_prefix(i, p.rows, p.rows_start, t)  # [N, Hkv, T, D]
            if i < len(self.layers) - 1:
                q = qkv.new_zeros(n, t, nq * d)
                q[p.prompt_of, p.positions] = qkv[:, : nq * d]  # [N, T, H*D], right-padded
                # padded queries see stale cache entries past their prompt; their outputs are dropped
                attn = F.scaled_dot_product_attention(q.view(n, t, nq, d).transpose(1, 2), k, v, is_causal=True,
                                                      scale=self.scale, enable_gqa=nkv != nq)  # [N, H, T, D]
                x = self._out_and_mlp(layer, x, attn.transpose(1, 2)[p.prompt_of, p.positions].flatten(1))
            else:
                # last layer: only the last prompt token's output matters (the cache already has
                # every position's k/v), so attention, o-projection and MLP run on N rows, not all
                q_last = qkv[p.last, : nq * d].view(n, nkv, nq // nkv, d)  # [N, Hkv, G, D]
                valid = cache.positions[:t] <= p.positions[p.last][:, None]  # [N, T]
                attn = self._attend(q_last, k, v, self._attn_mask(valid)).view(n, nq * d)
                x = self._out_and_mlp(layer, x[p.last], attn)  # [N, hidden]
        return self.logits(x)

    def _attn_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """The additive mask ``_attend`` takes, ``[B * Hkv, 1, S]``, from ``valid`` ``[B, S]`` (built once per step)."""
        mask = torch.where(valid, 0.0, float("-inf")).to(self.dtype)  # [B, S]
        b, s = mask.shape
        return mask[:, None, None, :].expand(b, self.num_kv_heads, 1, s).reshape(b * self.num_kv_heads, 1, s)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Single-query GQA attention. q ``[B, Hkv, G, D]``, k/v ``[B, Hkv, S, D]``, mask ``[B * Hkv, 1, S]``.

        Batched matmuls over (row, kv head) with no repeat of k/v, the mask added inside the first
        (``baddbmm``: one op less than matmul + add); returns ``[B, Hkv, G, D]``.
        """
        b, hkv, g, d = q.shape
        scores = torch.baddbmm(mask, q.reshape(b * hkv, g, d), k.flatten(0, 1).transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)  # [B * Hkv, G, S]
        return torch.bmm(probs, v.flatten(0, 1)).view(b, hkv, g, d)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, seq_len: int,
                    float_logits: bool = True) -> torch.Tensor:
        """One token for each of the first B cache rows. tokens, pos: ``[B]``; returns ``[B, V]``.

        Row b attends to cache positions ``[0, pos[b]]``; ``seq_len`` (host-known, >= max(pos)+1)
        bounds the slice of the cache read, so no host sync is needed to size it.
        """
        if self.fused_kernels:
            return self.logits(self._decode_fused(tokens, pos, cache, seq_len), float_logits)
        b, s = tokens.shape[0], seq_len
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cs = self.rope_table(cache.max_seq_len)[pos]  # [B, 2, D]
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # [B, 1, D]
        valid = cache.positions[:s] <= pos[:, None]  # [B, S]
        mask = self._attn_mask(valid)  # [B * Hkv, 1, S], shared by all layers
        write_idx = cache.decode_write_index(pos)  # [B, 2, Hkv], shared by all layers
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        for i, layer in enumerate(self.layers):
            qkv = self._qkv(layer, x, cos, sin)  # [B, (H + 2Hkv) * D]
            cache.write_decode(i, write_idx, qkv[:, nq * d:].view(b, 2, nkv, d))
            k, v = cache.layer_prefix(i, b, s)  # [B, Hkv, S, D] views of the cache
            q = qkv[:, : nq * d].view(b, nkv, nq // nkv, d)  # [B, Hkv, G, D]: GQA without repeat
            attn = self._attend(q, k, v, mask).view(b, nq * d)  # [B, H * D]
            x = self._out_and_mlp(layer, x, attn)
        return self.logits(x, float_logits)

    def _decode_fused(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, seq_len: int
                      ) -> torch.Tensor:
        """The layers of ``decode_step`` with the Triton kernels; returns the last hidden state ``[B, hidden]``."""
        rope = self.rope_table(cache.max_seq_len)  # [S, 2, D]
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        for i, layer in enumerate(self.layers):
            qkv = self._project(layer, x)  # [B, (H + 2Hkv) * D]
            rope_and_write(cache, i, qkv, pos, rope, self.num_heads)
            attn = decode_attention(cache, i, qkv, pos, self.num_heads, self.scale, seq_len)  # [B, H * D]
            x = self._out_and_mlp(layer, x, attn)
        return x


# ---- Triton kernels of the fused path ---------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_stride + c, mask=c < n, other=0.0).to(tl.float32)
        xn = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        y = xn.to(out_ptr.dtype.element_ty).to(tl.float32) * w  # HF rounds before the weight
        tl.store(out_ptr + row * out_stride + c, y.to(out_ptr.dtype.element_ty), mask=c < n)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, stride, inter, BLOCK: tl.constexpr):
        row, c = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(gu_ptr + row * stride + c, mask=c < inter, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride + inter + c, mask=c < inter, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty).to(tl.float32)  # HF rounds SiLU's output
        tl.store(gu_ptr + row * stride + c, (act * u).to(gu_ptr.dtype.element_ty), mask=c < inter)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (float32 statistics) of a 2-D ``x`` with unit last stride, one launch."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](x, x.stride(0), weight, out, out.stride(0), n, eps, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)))
    return out


def silu_mul_fused_(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` written over the gate half of ``gate_up`` ``[N, 2I]``; returns that ``[N, I]`` view."""
    inter = gate_up.shape[-1] // 2
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, 1024))](gate_up, gate_up.stride(0), inter, BLOCK=1024,
                                                                   num_warps=4)
    return gate_up[:, :inter]
