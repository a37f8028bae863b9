"""Generation engines: TorchEngine (embedded default) and SGLangEngine, one interface.

``types`` (requests, results, the ``Engine`` protocol) imports only msgspec; the TorchEngine names
load torch on first use, so roles that only exchange requests stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshrl.engines.types import Completion, Engine, GenerateRequest, GenerateResult, SamplingParams, StreamDelta

_LAZY = {
    "TorchEngine": "meshrl.engines.torch_engine",
    "TorchEngineConfig": "meshrl.engines.torch_engine",
    "ModelSpec": "meshrl.engines.layout",
    "EngineLayout": "meshrl.engines.layout",
    "ParamLayout": "meshrl.engines.layout",
    "FusedPart": "meshrl.engines.layout",
    "TensorParallel": "meshrl.engines.tp",
    "make_app": "meshrl.engines.serve",
}

__all__ = ["Completion", "Engine", "GenerateRequest", "GenerateResult", "SamplingParams", "StreamDelta", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrl.engines' has no attribute {name!r}")
