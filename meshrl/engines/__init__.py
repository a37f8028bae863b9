"""Generation engines: TorchEngine (embedded default) and SGLangEngine, one interface."""

from meshrl.engines.types import Completion, Engine, GenerateRequest, GenerateResult, SamplingParams

__all__ = ["Completion", "Engine", "GenerateRequest", "GenerateResult", "SamplingParams"]
