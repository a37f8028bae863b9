"""Hugging Face model helpers shared by the warm start, the trainer and the reference worker.

Sequences are packed right-padded as ``prompt + response``; per-token quantities (log-probs,
values, masks) are returned over *response* tokens only, shape ``[B, R]`` with ``R`` the longest
response, which is what ``meshrl.algos`` expects. Response token ``j`` of sample ``i`` sits at
position ``P_i + j`` and is predicted by the logits at position ``P_i + j - 1``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

__all__ = ["Packed", "pack", "response_logprobs", "ValueModel", "load_causal_lm", "count_parameters",
           "disable_dropout", "no_progress_bars"]


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout rate of ``model`` set to 0, in place (the saved config keeps its own values).

    RL recomputes log-probs and values that must equal the engine's and the reference's (which run
    without dropout): with dropout on, the importance ratio and the KL are noise even when the
    policy has not moved, and the noise differs with the dp size. Modules stay in train mode, so
    activation checkpointing still applies. Covers ``nn.Dropout`` modules and the float rates that
    attention modules pass to their kernels (``attention_dropout``, ``dropout``)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off meanwhile ("Writing model shards" on every save): the run's
    own progress line is the one a user reads."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@dataclass
class Packed:
    """A right-padded batch of ``prompt + response`` sequences."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    predict_index: torch.Tensor  # [B, R] position whose logits predict response token j
    response_mask: torch.Tensor  # [B, R] 1.0 on response tokens (times the sample's loss mask)
    response_ids: torch.Tensor  # [B, R] response tokens (pad where masked)

    def to(self, device: torch.device | str) -> "Packed":
        return Packed(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.predict_index, self.response_mask, self.response_ids)))

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> Packed:
    """Pack ``prompts[i] + responses[i]`` right-padded; every prompt needs at least one token."""
    if len(prompts) != len(responses):
        raise ValueError(f"pack: {len(prompts)} prompts but {len(responses)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    B, T = len(prompts), max(lengths)
    R = max(1, max(len(r) for r in responses))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    predict_index = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"pack: prompt {i} is empty")
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, :n] = 1
        if r:
            predict_index[i, : len(r)] = torch.arange(len(p) - 1, n - 1)
            response_ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask = loss_masks[i] if loss_masks is not None and loss_masks[i] is not None else None
            if mask is not None and len(mask) != len(r):
                raise ValueError(f"pack: loss mask {i} has {len(mask)} entries for {len(r)} response tokens")
            response_mask[i, : len(r)] = torch.tensor(mask, dtype=torch.float32) if mask is not None else 1.0
    return Packed(input_ids, attention_mask, predict_index, response_mask, response_ids)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 if it is (bf16 logits are upcast; a float64 model, as the
    invariant tests train, keeps its precision through the log-probs and the losses)."""
    return t if t.dtype == torch.float64 else t.float()


def response_logprobs(
    logits: torch.Tensor, packed: Packed, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the response tokens under ``log_softmax(logits / temperature)``.

    ``logits`` is ``[B, T, V]``; temperature 0 (greedy sampling) means the unscaled logits, as
    in the engines (meshrl/engines/types.py).
    """
    index = packed.predict_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = at_least_fp32(torch.gather(logits, 1, index))  # [B, R, V]
    if temperature > 0:
        picked = picked / temperature
    logp = picked.log_softmax(-1).gather(-1, packed.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(packed.response_mask > 0, logp, torch.zeros_like(logp))


class ValueModel(nn.Module):
    """A critic: the policy's architecture without the LM head, plus a scalar value head.

    ``forward`` returns ``[B, R]`` values at the positions that predict each response token,
    i.e. V(s_t) of the state before response token t is emitted.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no arbitrary initial baseline
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ValueModel":
        return cls(AutoModel.from_pretrained(path, dtype=dtype))

    def forward(self, packed: Packed) -> torch.Tensor:
        hidden = self.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False).last_hidden_state
        index = packed.predict_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        values = at_least_fp32(self.head(torch.gather(hidden, 1, index)).squeeze(-1))  # [B, R]
        return torch.where(packed.response_mask > 0, values, torch.zeros_like(values))


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a local Hugging Face causal LM directory; fail with the path when it is not one."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {path} is not a Hugging Face model directory (no config.json)")
    AutoConfig.from_pretrained(path)  # a clear error for a broken config before weights load
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
