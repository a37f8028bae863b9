"""The trainer's shared-prompt passes for Llama-family decoders, in plain torch.

``modeling.policy_logprobs(..., share_prompts=True)`` runs each distinct prompt of a batch once and
lets every row of its group attend to that prompt's keys and values. Through the model's own
forward that is two HF calls with a ``DynamicCache`` between them (mask building, the cache's
bookkeeping, the model's wrappers), and ``torch.compile`` can only take each decoder layer alone,
with a cache entry per layer and per pass. This module computes the same two passes from the
decoder's own modules (embeddings, norms, projections, MLPs and its rotary embedding, so every
weight, bias and RoPE variant is the model's) with only the attention glue written here: causal
attention over each prompt, then each row's response tokens over its prompt's keys and values and
its own earlier tokens. The numbers are HF's: tests/test_head_logprobs.py holds log-probs,
entropies and gradients to 1e-10 of every row run whole in float64 with SDPA (1e-6 with HF's eager
attention, whose softmax is float32), and on the laptop bench's model the log-probs are bitwise
HF's in float32 and under bf16 autocast (the gradients within bf16's rounding). ``compile_passes``
turns the whole of it into one compiled function: the laptop bench's 32-sample train step took
11.5-11.8 ms against 14.3-15.4 ms with the decoder layers compiled one by one (bench/RESULTS.md).

Which decoders: Llama, Qwen2 and Qwen3 (``model_type``), with full attention in every layer (no
sliding window), SDPA or eager attention, no dropout left in attention, parameters that are plain
tensors (FSDP2 shards parameters and gathers them in its module hooks, which these passes do not
call), and the model called as itself (LoRA's reference view, ``lora.BaseModel``, switches the
adapters off around the model's own call). Anything else takes the model's own forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fits", "shared_passes", "compile_passes"]

FAMILY = frozenset({"llama", "qwen2", "qwen3"})
_FITS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def fits(model, decoder: nn.Module) -> bool:
    """Whether ``shared_passes`` computes ``decoder``'s numbers (module docstring): its structure
    checked once per decoder, its attention implementation and its parameters' kind at each call
    (a model sharded or switched to another attention after its first pass)."""
    if not isinstance(model, nn.Module):
        return False
    known = _FITS.get(decoder)
    if known is None:
        known = _FITS[decoder] = _structure_fits(decoder)
    if not known or getattr(decoder.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    from torch.distributed.tensor import DTensor

    return not isinstance(decoder.embed_tokens.weight, DTensor)  # shard_model shards the root with the layers


def _structure_fits(decoder: nn.Module) -> bool:
    config = getattr(decoder, "config", None)
    if getattr(config, "model_type", None) not in FAMILY:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    for layer in decoder.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return False
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
        if getattr(attn, "sliding_window", None) is not None or getattr(attn, "attention_dropout", 0.0):
            return False
    return True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
           prefix: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoder layer on ``x`` ``[N, S, H]`` under ``mask`` ``[N, 1, S, K]`` (True: attend), the
    keys and values of ``prefix`` (``[N, kv_heads, K - S, d]``, RoPE applied) before its own:
    the layer's output and its own keys and values."""
    attn = layer.self_attn
    n, s, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(n, s, -1, attn.head_dim)
    k = attn.k_proj(h).view(n, s, -1, attn.head_dim)
    v = attn.v_proj(h).view(n, s, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: each head normed before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    own = (k, v)
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention, as HF's repeat_kv
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(n, s, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x)), own


def shared_passes(decoder: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group: torch.Tensor,
                  row_plen: torch.Tensor, response_ids: torch.Tensor, response_valid: torch.Tensor) -> torch.Tensor:
    """``[B, R, H]``: the final-normed hidden states that predict each row's response tokens.

    ``prompt_ids``, ``prompt_mask``: ``[G, P]`` the distinct prompts, right-padded; ``group``,
    ``row_plen``: ``[B]`` each row's prompt and its length; ``response_ids``, ``response_valid``:
    ``[B, R - 1]`` each row's response tokens but the last (those predict the next) and which are
    real. Position 0 of the result is the prompt's last hidden state (it predicts response token 0),
    position ``j`` the row's own at response token ``j - 1``."""
    g, p = prompt_ids.shape
    device = prompt_ids.device
    x = decoder.embed_tokens(prompt_ids)
    cos, sin = decoder.rotary_emb(x, torch.arange(p, device=device)[None].expand(g, p))
    seen = prompt_mask.bool()
    mask = (torch.ones(p, p, dtype=torch.bool, device=device).tril()[None] & seen[:, None, :])[:, None]  # [G, 1, P, P]
    cached = []
    for layer in decoder.layers:
        x, kv = _layer(layer, x, cos, sin, mask)
        cached.append(kv)
    last = decoder.norm(x)[group, row_plen - 1]  # [B, H]
    b, s = response_ids.shape
    if s == 0:
        return last[:, None]
    y = decoder.embed_tokens(response_ids)
    cos, sin = decoder.rotary_emb(y, row_plen[:, None] + torch.arange(s, device=device)[None])
    own = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None] & response_valid[:, None, :]  # [B, S, S]
    mask = torch.cat([seen[group][:, None, :].expand(b, s, p), own], 2)[:, None]  # [B, 1, S, P + S]
    for layer, (k, v) in zip(decoder.layers, cached):
        y, _ = _layer(layer, y, cos, sin, mask, prefix=(k[group], v[group]))
    return torch.cat([last[:, None], decoder.norm(y)], 1)


class _Passes:
    """``shared_passes``, eager or (``compile_passes``) compiled."""

    forward = staticmethod(shared_passes)


def compile_passes(backend: str = "inductor") -> None:
    """Compile ``shared_passes`` with ``torch.compile`` (``backend``, dynamic shapes) for the rest of
    the process: both passes and every layer in one graph; each model pays one compile."""
    if _Passes.forward is shared_passes:
        _Passes.forward = staticmethod(torch.compile(shared_passes, dynamic=True, backend=backend))
