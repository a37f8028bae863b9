"""LoRA for the policy: low-rank adapters on chosen linear layers, trained alone, merged on export.

``apply_lora(model, cfg)`` replaces every ``nn.Linear`` whose attribute name is in
``cfg.target_modules`` with a ``LoRALinear``. It keeps the base ``weight`` and ``bias`` under the
same names, frozen, and adds ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``:
``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`` with ``s = alpha / rank`` (Hu et al. 2021, "LoRA"). Every other
parameter is frozen. ``A`` starts Kaiming-uniform and ``B`` at zero, so training starts from the
base model exactly. The optimiser then holds state for the adapters only, and backward computes no
weight gradient for the frozen matrices.

The engines never see adapters. Every export carries the merged weights ``W + s · B A`` under the
base model's names: the HF checkpoint, the object-store and distributed pushes, and the colocated
hand-over. TorchEngine and SGLang therefore generate with plain weights, at full speed. Under
FSDP2 the merge is done shard by shard: ``W`` and ``B`` are both row-sharded (dim 0 is ``out`` in
both, so their chunks match), and ``A`` (``r x in``, small) is gathered. That gather makes a merged
export a collective: every rank must take part, as in every other export.

``save_adapter`` writes the adapters alone in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A.weight``), next to the merged
checkpoint: ``PeftModel.from_pretrained(base, path)`` loads them onto the base model.

The reference policy of a KL term is the base model, which is the policy with its adapters
switched off (``adapters_off``). So with LoRA, ``trainer.reference_in_trainer=true`` costs no
second copy of the model.

Simplifications, on purpose: no adapter dropout (RL compares log-probs of the same weights, and
the trainer runs without dropout); the critic, when there is one, is trained in full; adapters on
a tied weight (``lm_head`` of a model with tied embeddings) are refused; while a distributed push
sends, the rank holds a merged copy of its shard of the adapted weights (the colocated hand-over
at dp = 1 merges one weight at a time). Checkpoints hold the adapters and their optimiser state,
not the frozen base (it is the model path's, unchanged).
"""

from __future__ import annotations

import collections
import contextlib
import math
from pathlib import Path
from typing import Iterator, Mapping

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "adapters_off", "BaseModel", "named_weights", "merge_state_dict",
           "is_adapter_name", "save_adapter"]

_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Low-rank adapters for the policy (``trainer.lora``); rank 0 trains every parameter."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 32.0
    """Updates are scaled by alpha / rank. LoRA usually wants a larger trainer.lr than full
    fine-tuning (about 10x)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Attribute names of the linear layers that get adapters, in every decoder layer."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"trainer.lora.rank must be >= 0 (0: no LoRA), got {self.rank}")
        if not 0 < self.alpha < math.inf:
            raise ValueError(f"trainer.lora.alpha must be a finite number > 0, got {self.alpha}")
        if not self.target_modules:
            raise ValueError("trainer.lora.target_modules is empty: name the linear layers that get adapters")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trained low-rank update (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        super().__init__()
        self.in_features, self.out_features, self.scale = base.in_features, base.out_features, scale
        self.weight = base.weight  # the same Parameter objects: names and tying stay as they were
        self.bias = base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) initialise A
        self.adapter_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return y
        h = F.linear(x, self.lora_A)  # [..., r]
        if y.dim() < 2:
            return y + F.linear(h, self.lora_B) * self.scale
        # y + s·h Bᵀ as one GEMM with the scale and the sum in its epilogue (no separate kernels
        # over the [tokens, out] activations, forward or backward)
        return torch.addmm(y.flatten(0, -2), h.flatten(0, -2), self.lora_B.t(), alpha=self.scale).view(y.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze ``model`` and put adapters on its ``cfg.target_modules`` (in place, before FSDP2 wraps it).

    Returns the adapted modules' names; raises ``ValueError`` naming the model's linear layers when
    no target matches, or when the rank exceeds a target's smaller dimension.
    """
    if not cfg.enabled:
        raise ValueError("apply_lora needs trainer.lora.rank > 0")
    model.requires_grad_(False)
    shared = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    adapted, linear_names = [], set()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            linear_names.add(name)
            if name not in cfg.target_modules:
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if cfg.rank > min(child.in_features, child.out_features):
                raise ValueError(f"trainer.lora.rank={cfg.rank} exceeds {full}'s shape "
                                 f"({child.out_features} x {child.in_features}): a low-rank update needs rank <= "
                                 f"{min(child.in_features, child.out_features)}")
            if shared[id(child.weight)] > 1:  # tie_word_embeddings: one tensor, two names
                raise ValueError(f"trainer.lora.target_modules: {full}.weight is tied to another parameter (the model "
                                 f"ties its embeddings), so an adapter on it could not be merged into one weight for "
                                 f"the engines: leave {name!r} out")
            setattr(parent, name, LoRALinear(child, cfg.rank, cfg.scale))
            adapted.append(full)
    if not adapted:
        raise ValueError(f"trainer.lora.target_modules {list(cfg.target_modules)} match no linear layer of "
                         f"{type(model).__name__}; its linear layers are named {sorted(linear_names)}")
    return adapted


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within: ``model`` computes as its base model (the adapters add nothing)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapter_on = False
    try:
        yield
    finally:
        for m in layers:
            m.adapter_on = True


class BaseModel:
    """Calls ``model`` with its adapters off: the frozen reference policy, sharing the policy's weights."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


def is_adapter_name(name: str) -> bool:
    return name.endswith(_ADAPTER_SUFFIXES)


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=scale)


@torch.no_grad()
def named_weights(model: nn.Module, *, merged: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of an adapted ``model`` under the base model's names, adapters left out.

    ``merged=True``: each adapted weight as ``W + s · B A`` (what engines load). With FSDP2 that is a
    DTensor with ``W``'s placements, built from this rank's rows, and a collective (``A`` is
    gathered): every rank must iterate it whole, in the same order. ``merged=False``: the base
    tensors as they are, which have the same shapes, dtypes and shards (a layout; no compute, no
    collective).
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            continue
        owner, _, leaf = name.rpartition(".")
        layer = layers.get(owner) if leaf == "weight" else None
        if not merged or layer is None:
            yield name, p.detach()
            continue
        yield name, _merged_weight(name, layer)


def _merged_weight(name: str, layer: LoRALinear) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    w, a, b = layer.weight, layer.lora_A, layer.lora_B
    if not isinstance(w, DTensor):
        return _merge(w.detach(), a.detach(), b.detach(), layer.scale)
    rows = (Shard(0),) * w.device_mesh.ndim
    if tuple(w.placements) != rows or tuple(b.placements) != rows or w.device_mesh != b.device_mesh:
        raise ValueError(f"{name}: merging LoRA needs the weight and lora_B row-sharded alike on one mesh, got "
                         f"{w.placements} and {b.placements}")
    local = _merge(w.to_local(), a.full_tensor(), b.to_local(), layer.scale)
    return DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def merge_state_dict(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with every ``X.weight`` that has ``X.lora_A``/``X.lora_B`` merged, adapters dropped."""
    out = {}
    for name, t in state.items():
        if is_adapter_name(name):
            continue
        owner = name[: -len(".weight")] if name.endswith(".weight") else None
        if owner is not None and f"{owner}.lora_A" in state:
            t = _merge(t, state[f"{owner}.lora_A"], state[f"{owner}.lora_B"], scale)
        out[name] = t
    return out


def save_adapter(state: Mapping[str, torch.Tensor], cfg: LoRAConfig, base_model: str, path: str | Path) -> Path:
    """The adapters of a full state dict in PEFT's LoRA format at ``path``; returns it."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name[: -len('.lora_A')]}.lora_{name[-1]}.weight": t.detach().cpu().contiguous()
               for name, t in state.items() if is_adapter_name(name)}
    if not tensors:
        raise ValueError("save_adapter: the state dict holds no lora_A/lora_B tensors")
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": sorted(cfg.target_modules), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
