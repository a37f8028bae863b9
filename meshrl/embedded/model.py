"""The embedded default policy: a Qwen2-architecture model small enough to learn on a laptop CPU.

Built from a ``transformers.Qwen2Config`` (random initialisation; the warm start teaches it the
task's format), so it saves, loads and serves like any Hugging Face causal LM.
"""

from __future__ import annotations

import msgspec
from transformers import PreTrainedTokenizerBase, Qwen2Config

__all__ = ["EmbeddedModelConfig", "build_model_config"]


class EmbeddedModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the embedded default model (about 1M parameters at the defaults)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 64
    """Longest prompt + completion, in tokens."""


def build_model_config(cfg: EmbeddedModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
