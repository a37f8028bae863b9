"""Reading Hugging Face checkpoints, and staging weight updates until they are applied as a whole.

A checkpoint is a local directory holding ``config.json`` and ``*.safetensors`` files (sharded or
not), as written by ``save_pretrained``; nothing is fetched from a hub. ``StagedWeights`` is the
"begin / load (several times) / end" half of a weight update: pieces are copied to the engine's
device and dtype as they arrive (so the sender may reuse its buffers), or written by ``meshrl.reshard``
straight into whole engine-layout staging copies (``buffers``), and only ``apply`` writes them into
the live parameters, in place.

Simplifications, on purpose: a staged update holds a full copy of every tensor it received (peak
memory is weights + update); tensors are read whole from safetensors, then sliced for TP.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

import torch

from meshrl.engines.layout import SUPPORTED_MODEL_TYPES, ModelSpec
from meshrl.engines.model import Transformer


def load_hf_config(path: str) -> Any:
    """The ``transformers`` config of a local checkpoint directory."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json: pass a Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def checkpoint_files(path: str) -> list[str]:
    """The model's weight files as ``from_pretrained`` picks them: the shards that
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every ``*.safetensors``
    (other files beside them, an adapter or stale shards, are not the model's)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh).get("weight_map", {}).values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if not files or missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {missing[:3] or 'none at all'}")
        return files
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors files")
    return files


def check_checkpoint_dir(path: str) -> ModelSpec:
    """What TorchEngine and the trainer need of a model directory, from file headers alone (no
    weight is read; milliseconds once transformers is imported): a directory, a config.json of an
    architecture the engine runs (``ModelSpec``, its own reading), and whole safetensors files
    (``checkpoint_files``; a truncated one's header promises bytes past its end). Raises
    ``ValueError`` naming the path, the problem and its fix; returns the model's ``ModelSpec``."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isdir(path):
        why = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ValueError(f"{path} {why}: give a Hugging Face checkpoint directory (config.json + *.safetensors)")
    try:
        with open(os.path.join(path, "config.json")) as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path} has no config.json: give a Hugging Face checkpoint directory (save_pretrained "
                         "writes one)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: config.json is not readable JSON ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        # before transformers reads it: its error for a model_type it does not know is a paragraph about upgrading
        archs = ", ".join(raw.get("architectures") or []) if isinstance(raw, dict) else ""
        *others, last = SUPPORTED_MODEL_TYPES
        raise ValueError(f"{path}: model_type {model_type!r}{f' ({archs})' if archs else ''} is not supported: "
                         f"meshrl runs {', '.join(others)} or {last} checkpoints")
    try:
        spec = ModelSpec.from_hf_config(load_hf_config(path))
    except (OSError, ValueError) as exc:  # attention, activation or RoPE the engine does not run
        raise ValueError(f"{path}: {exc}") from None
    try:
        files = checkpoint_files(path)
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}: save the model there with save_pretrained") from None
    for f in files:
        try:
            with safe_open(os.path.join(path, f), framework="pt"):  # parses the header: offsets past the end fail
                pass
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"{path}: {f} is not a whole safetensors file ({exc}): copy or save it again") from None
    return spec


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's weight files in ``path`` (``checkpoint_files``; CPU tensors, checkpoint dtype)."""
    from safetensors import safe_open

    files = checkpoint_files(path)
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def eos_token_ids(path: str | None, hf_config: Any, generation_eos: int | list[int] | None = None
                  ) -> tuple[int, ...]:
    """EOS ids: the config's, plus ``generation_config.json``'s when the checkpoint has one (or, for a
    model in memory, its ``generation_config.eos_token_id``: ``generation_eos``)."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None), generation_eos]
    gen = os.path.join(path, "generation_config.json") if path else None
    if gen and os.path.isfile(gen):
        with open(gen) as fh:
            sources.append(json.load(fh).get("eos_token_id"))
    for eos in sources:
        for i in [eos] if isinstance(eos, int) else (eos or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def load_all(model: Transformer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load a complete checkpoint; raise naming the HF weights that are missing."""
    loaded = model.load_hf(named_tensors)
    missing = sorted(set(model.layout.hf_index) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {missing[:5]}{more}")


class StagedWeights:
    """A weight update received piecewise, invisible to generation until ``apply``."""

    def __init__(self, model: Transformer):
        self.model = model
        self.pieces: list[tuple[str, tuple[slice, ...], torch.Tensor]] = []
        self.hf_names: set[str] = set()
        self.whole: dict[str, torch.Tensor] = {}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Whole staging copies of every local parameter, by engine name, applied whole by ``apply``.

        For writers that already speak the engine layout (``meshrl.reshard`` receives each rank's
        slices straight into them); they must fill every element.
        """
        if not self.whole:
            self.whole = {name: torch.empty_like(p) for name, p in self.model.params.items()}
        return self.whole

    @torch.no_grad()
    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's piece of each full HF-named tensor to the engine's device and dtype."""
        m = self.model
        for hf_name, t in named_tensors:
            if m.layout.is_skipped(hf_name):
                continue
            name, dst, piece = m.place(hf_name, t)
            self.pieces.append((name, dst, piece.to(device=m.device, dtype=m.dtype, copy=True)))
            self.hf_names.add(hf_name)

    @torch.no_grad()
    def apply(self) -> int:
        """Write every staged piece into the live parameters (in place); returns tensors applied."""
        if self.whole:
            names = list(self.whole)
            torch._foreach_copy_([self.model.params[n] for n in names], [self.whole[n] for n in names])
        for name, dst, piece in self.pieces:
            self.model.params[name][dst].copy_(piece)
        n = len(self.pieces) + len(self.whole)
        self.pieces.clear()
        self.whole = {}
        return n


def stage_checkpoint(model: Transformer, path: str) -> StagedWeights:
    """A checkpoint directory's safetensors (this rank's shard), staged for ``apply``; raises, having
    staged nothing usable, when a name or shape does not fit or the files cannot be read."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path!r}")
    stage = StagedWeights(model)
    try:
        stage.add(iter_safetensors(path))
    except KeyError as exc:  # a tensor name this model does not have
        raise ValueError(f"{path!r}: {exc.args[0] if exc.args else exc}") from None
    if not stage.pieces:
        raise ValueError(f"{path!r} holds no weights of this model")
    return stage
