"""Tiny models for the tests, in one place: configs, random models, model directories, samples.

- ``qwen2`` / ``qwen3`` / ``llama``: transformers configs of a few thousand parameters; every test
  names only what it depends on (a vocabulary its token ids fit in, tied embeddings, a TP split).
- ``hf_model``: a random model of a config, seeded; ``sharp`` scales its matrices so that greedy
  outputs differ between seeds (the weight-push tests tell versions apart by them).
- ``model_dir``: a saved model with the embedded default's architecture (or a config's) and its
  character tokenizer, what ``--model DIR`` takes. The session fixtures ``tiny_model`` (1 layer) and
  ``tiny_model_2l`` (2 layers) in conftest.py are written once; a test that changes a directory
  writes its own with ``model_dir``.
- ``make_samples``: deterministic trainer samples of mixed lengths.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import torch

__all__ = ["qwen2", "qwen3", "llama", "hf_model", "char_tokenizer", "model_dir", "make_samples"]


def _base(vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int, intermediate_size: int | None,
          positions: int, tied: bool, **extra: Any) -> dict[str, Any]:
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=positions, tie_word_embeddings=tied, **{"eos_token_id": None, **extra})


def qwen2(*, vocab_size: int = 72, hidden_size: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          intermediate_size: int | None = None, positions: int = 96, tied: bool = True, **extra: Any):
    """A tiny Qwen2 config (no EOS token unless given: generation runs to max_new_tokens)."""
    from transformers import Qwen2Config

    return Qwen2Config(**_base(vocab_size, hidden_size, layers, heads, kv_heads, intermediate_size, positions, tied, **extra))


def qwen3(*, vocab_size: int = 72, hidden_size: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          intermediate_size: int | None = None, positions: int = 96, tied: bool = False, head_dim: int = 16, **extra: Any):
    from transformers import Qwen3Config

    return Qwen3Config(head_dim=head_dim, **_base(vocab_size, hidden_size, layers, heads, kv_heads, intermediate_size,
                                                  positions, tied, **extra))


def llama(*, vocab_size: int = 72, hidden_size: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          intermediate_size: int | None = None, positions: int = 96, tied: bool = False, **extra: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**_base(vocab_size, hidden_size, layers, heads, kv_heads, intermediate_size, positions, tied, **extra))


def hf_model(config: Any, *, seed: int = 0, sharp: float | None = None, dtype: torch.dtype | None = None):
    """A random causal LM of ``config`` in eval mode; ``sharp`` multiplies every matrix by it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {})).eval()
    if sharp is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(sharp)
    return model


@functools.cache
def char_tokenizer():
    """The embedded default's character tokenizer (built once; callers must not change it)."""
    from meshrl.embedded import build_char_tokenizer

    return build_char_tokenizer()


def model_dir(path: Path, *, layers: int = 2, hidden: int = 32, positions: int | None = None, seed: int = 0,
              config: Any = None) -> str:
    """A random model of the embedded default's architecture (Qwen2, smaller) and the char
    tokenizer, saved at ``path`` as ``--model DIR`` reads it; a ``config`` (say ``qwen2(...)``)
    replaces that architecture, and ``layers``/``hidden``/``positions`` are then unused."""
    from transformers import AutoModelForCausalLM

    from meshrl.embedded import EmbeddedModelConfig, build_model_config

    tok = char_tokenizer()
    if config is None:
        shape = EmbeddedModelConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    **({"max_position_embeddings": positions} if positions else {}))
        config = build_model_config(shape, tok)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_samples(step: int, n: int, *, group: int = 1, vocab: int = 90, reward: float | None = None) -> list:
    """Deterministic samples of mixed lengths (so micro-batches and ranks get uneven rows)."""
    from meshrl.queues import Sample

    rng = random.Random(1000 + step)
    out = []
    for i in range(n):
        prompt = [3] + [rng.randrange(4, vocab) for _ in range(rng.randrange(3, 9))]
        response = [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 9))]
        out.append(Sample(
            prompt_id=i // group, group_id=step * 1000 + i // group, group_size=group, prompt_ids=prompt,
            response_ids=response, behavior_logprobs=[-rng.uniform(2.0, 5.0) for _ in response], behavior_version=step,
            reward=rng.random() if reward is None else reward,
        ))
    return out
