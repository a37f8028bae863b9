"""What the GPU benches share: Qwen2.5-shaped random models and synthetic training batches.

Imported by the bench scripts run as ``python3 bench/<script>.py`` (their folder is on sys.path).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

SHAPES = {  # the config.json of each Qwen2.5 model, and a tiny one for the CPU checks
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def write_model(path: Path, shape: str) -> None:
    """A random bf16 model of ``shape`` as a Hugging Face checkpoint (with the embedded tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from meshrl.embedded import build_char_tokenizer

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rms_norm_eps=1e-6, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)  # save_hf copies a tokenizer; any one will do
    del model


def make_batch(step: int, args: argparse.Namespace, vocab: int):
    """``args.samples`` random samples (``args.prompt_len`` + ``args.response_len`` tokens, groups of 8
    when they divide, else 2, a group's samples completions of one prompt) whose behaviour log-probs
    are what a random model gives: ratios near 1."""
    from meshrl.queues import Sample

    rng = random.Random(step)
    group = 8 if args.samples % 8 == 0 else 2
    uniform = -math.log(vocab)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.samples // group)]
    return [
        Sample(prompt_id=i // group, group_id=step * 100_000 + i // group, group_size=group,
               prompt_ids=prompts[i // group],
               response_ids=[rng.randrange(vocab) for _ in range(args.response_len)],
               behavior_logprobs=[uniform + rng.uniform(-0.1, 0.1) for _ in range(args.response_len)],
               behavior_version=step, reward=float(rng.random() < 0.5))
        for i in range(args.samples)
    ]
