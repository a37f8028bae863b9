"""The engine's weight layout: model shape from an HF config, HF <-> engine names, fusions, TP plan.

This is the one place that knows how Hugging Face checkpoints map onto TorchEngine's parameters:

* q/k/v projections are fused into one ``qkv`` matrix (rows ``[q | k | v]``), gate/up into one
  ``gate_up`` matrix (rows ``[gate | up]``), so a layer runs two matmuls where HF runs five;
* with tied embeddings the engine has no ``lm_head``: ``lm_head.weight`` is accepted and skipped,
  ``model.embed_tokens.weight`` feeds both ends (SGLang does the same);
* the tensor-parallel plan is data (``ParamLayout.shard_dim`` + ``parts``), not code: column-parallel
  parameters (``qkv``, ``gate_up``) split every fused part along dim 0 and concatenate the rank's
  pieces; row-parallel ones (``o``, ``down``) split dim 1; the rest is replicated. ``local_slices``
  turns the plan into "this slice of this HF tensor goes to that slice of my local parameter", which
  both the engine's own ``load_weights`` and the reshard planner read.

Simplifications, on purpose: embeddings and ``lm_head`` are replicated under TP (no vocab
parallelism); KV heads are split, never replicated, so ``num_key_value_heads % tp_size == 0`` is
required; sliding-window attention and dynamic or LongRoPE scaling are rejected at load time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelSpec":
        """Read a ``transformers`` config (Qwen2/Qwen2.5, Qwen3 or Llama); raise on anything else."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; TorchEngine runs {SUPPORTED_MODEL_TYPES}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported: set use_sliding_window=False")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        inv_freq, scaling = _rope_parameters(cfg)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        eos = cfg.eos_token_id
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            eos_token_ids=eos_ids,
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(scaling),
        )


def _rope_parameters(cfg: Any) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as the model's own HF rotary class computes them: the
    default RoPE by that class's formula, the scaled kinds (linear, llama3, yarn) by transformers'
    own function. Not through the model's module: importing it costs an engine process ~2 s."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("dynamic", "longrope"):  # HF's rotary class re-derives them per forward (dynamic_rope_update)
        raise ValueError(f"{kind} RoPE scaling is not supported (its frequencies depend on the sequence length)")
    if kind == "default":
        base = rope.get("rope_theta", getattr(cfg, "rope_theta", None))  # transformers 5 moved it into rope_parameters
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    return inv_freq.float(), scaling


class FusedPart(msgspec.Struct, frozen=True):
    """One HF tensor inside an engine parameter, concatenated along dim 0 with its siblings."""

    hf_name: str
    """Full Hugging Face name, e.g. ``model.layers.0.self_attn.k_proj.weight``."""
    offset: int
    """Rows of the *unsharded* engine parameter that precede this part."""
    size: int
    """Rows (dim 0) of the HF tensor."""


class ParamLayout(msgspec.Struct, frozen=True):
    """One engine parameter: global shape, the HF tensors it is made of, and its TP sharding."""

    name: str
    """Engine name, e.g. ``layers.0.qkv.weight``."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    parts: tuple[FusedPart, ...]
    """HF tensors concatenated along dim 0, in order; one part when nothing is fused."""
    shard_dim: int | None
    """Dim split over the tp axis: 0 column-parallel (each part split), 1 row-parallel, None replicated."""

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of one rank's shard."""
        if self.shard_dim is None or tp_size == 1:
            return self.shape
        shape = list(self.shape)
        if shape[self.shard_dim] % tp_size:
            raise ValueError(f"{self.name}: dim {self.shard_dim} of {self.shape} does not split over tp={tp_size}")
        shape[self.shard_dim] //= tp_size
        return tuple(shape)

    def local_slices(self, tp_rank: int, tp_size: int) -> list[tuple[str, tuple[slice, ...], tuple[slice, ...]]]:
        """``(hf_name, slice of the HF tensor, slice of this rank's local parameter)`` per part."""
        out = []
        for p in self.parts:
            full = tuple(slice(None) for _ in self.shape)
            if self.shard_dim is None or tp_size == 1:
                dst = (slice(p.offset, p.offset + p.size),) + full[1:]
                out.append((p.hf_name, full, dst))
            elif self.shard_dim == 0:
                if p.size % tp_size:
                    raise ValueError(f"{p.hf_name}: {p.size} rows do not split over tp={tp_size}")
                n = p.size // tp_size
                src = (slice(tp_rank * n, (tp_rank + 1) * n),) + full[1:]
                dst = (slice(p.offset // tp_size, p.offset // tp_size + n),) + full[1:]
                out.append((p.hf_name, src, dst))
            else:
                n = self.local_shape(tp_size)[self.shard_dim]
                src = list(full)
                src[self.shard_dim] = slice(tp_rank * n, (tp_rank + 1) * n)
                out.append((p.hf_name, tuple(src), full))
        return out


class EngineLayout:
    """All parameters of a model in engine layout, with the HF -> engine index."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.params: dict[str, ParamLayout] = {}
        s = spec
        qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self._add("embed.weight", (s.vocab_size, s.hidden_size), ["model.embed_tokens.weight"], None)
        for i in range(s.num_layers):
            hf, en = f"model.layers.{i}.", f"layers.{i}."
            attn = [hf + f"self_attn.{p}_proj" for p in "qkv"]
            self._add(en + "attn_norm.weight", (s.hidden_size,), [hf + "input_layernorm.weight"], None)
            self._add(en + "qkv.weight", (qd + 2 * kvd, s.hidden_size), [a + ".weight" for a in attn], 0,
                      sizes=[qd, kvd, kvd])
            if s.qkv_bias:
                self._add(en + "qkv.bias", (qd + 2 * kvd,), [a + ".bias" for a in attn], 0, sizes=[qd, kvd, kvd])
            if s.qk_norm:
                self._add(en + "q_norm.weight", (s.head_dim,), [hf + "self_attn.q_norm.weight"], None)
                self._add(en + "k_norm.weight", (s.head_dim,), [hf + "self_attn.k_norm.weight"], None)
            self._add(en + "o.weight", (s.hidden_size, qd), [hf + "self_attn.o_proj.weight"], 1)
            if s.o_bias:
                self._add(en + "o.bias", (s.hidden_size,), [hf + "self_attn.o_proj.bias"], None)
            self._add(en + "mlp_norm.weight", (s.hidden_size,), [hf + "post_attention_layernorm.weight"], None)
            mlp = [hf + "mlp.gate_proj", hf + "mlp.up_proj"]
            inter = s.intermediate_size
            self._add(en + "gate_up.weight", (2 * inter, s.hidden_size), [m + ".weight" for m in mlp], 0,
                      sizes=[inter, inter])
            self._add(en + "down.weight", (s.hidden_size, inter), [hf + "mlp.down_proj.weight"], 1)
            if s.mlp_bias:
                self._add(en + "gate_up.bias", (2 * inter,), [m + ".bias" for m in mlp], 0, sizes=[inter, inter])
                self._add(en + "down.bias", (s.hidden_size,), [hf + "mlp.down_proj.bias"], None)
        self._add("norm.weight", (s.hidden_size,), ["model.norm.weight"], None)
        if not s.tie_word_embeddings:
            self._add("lm_head.weight", (s.vocab_size, s.hidden_size), ["lm_head.weight"], None)
        self.hf_index: dict[str, tuple[str, int]] = {
            p.hf_name: (pl.name, i) for pl in self.params.values() for i, p in enumerate(pl.parts)
        }
        self.skipped_hf_names: frozenset[str] = frozenset(["lm_head.weight"] if s.tie_word_embeddings else [])

    def _add(self, name: str, shape: tuple[int, ...], hf_names: list[str], shard_dim: int | None,
             sizes: list[int] | None = None) -> None:
        sizes = sizes or [shape[0]]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = tuple(FusedPart(hf_name=n, offset=o, size=z) for n, o, z in zip(hf_names, offsets, sizes))
        self.params[name] = ParamLayout(name=name, shape=shape, parts=parts, shard_dim=shard_dim)

    def is_skipped(self, hf_name: str) -> bool:
        """Names a checkpoint may carry that the engine ignores (tied lm_head, RoPE buffers)."""
        return hf_name in self.skipped_hf_names or hf_name.endswith(_SKIPPED_SUFFIXES)

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """Global shape of an HF tensor, from the engine layout."""
        name, i = self._lookup(hf_name)
        pl = self.params[name]
        return (pl.parts[i].size,) + pl.shape[1:]

    def _lookup(self, hf_name: str) -> tuple[str, int]:
        try:
            return self.hf_index[hf_name]
        except KeyError:
            raise KeyError(
                f"{hf_name!r} is not a weight of this {self.spec.model_type} model "
                f"(expected names like 'model.layers.0.self_attn.q_proj.weight')"
            ) from None

    def placements(self, hf_name: str, tp_rank: int = 0, tp_size: int = 1
                   ) -> tuple[str, tuple[slice, ...], tuple[slice, ...]]:
        """Where a full HF tensor goes on one rank: ``(engine name, HF slice, local slice)``."""
        name, i = self._lookup(hf_name)
        _, src, dst = self.params[name].local_slices(tp_rank, tp_size)[i]
        return name, src, dst

    def validate_tp(self, tp_size: int) -> None:
        """Raise if the model's heads or MLP width do not split over ``tp_size`` ranks."""
        s = self.spec
        for what, n in (("num_attention_heads", s.num_heads), ("num_key_value_heads", s.num_kv_heads),
                        ("intermediate_size", s.intermediate_size)):
            if n % tp_size:
                raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
