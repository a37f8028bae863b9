"""The generation-engine interface shared by TorchEngine (embedded) and SGLangEngine.

Requests and results are msgspec Structs so they cross Ray and HTTP without pickling user
objects. Field names follow SGLang's `/generate` where they overlap (``max_new_tokens``,
``top_k = -1`` for "off", ``finish_reason`` types), so the adapter is a thin translation.

Log-probs: every engine returns, for each sampled token, ``log softmax(logits / temperature)``
at that token — the temperature-scaled distribution *before* top-p / top-k truncation. The
trainer recomputes log-probs the same way (logits divided by the same temperature), so the
importance ratio compares like with like. With a temperature below ``GREEDY_TEMPERATURE`` (1e-6:
greedy) the log-probs are those of the unscaled logits.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, Protocol, Sequence, runtime_checkable

import msgspec

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "keep"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request. Defaults match SGLang's, except ``max_new_tokens`` is explicit."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens per sample (the stop token counts)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it (SGLang's convention)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a sample (the model's EOS always does unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Generate exactly ``max_new_tokens`` (throughput benchmarks)."""
    n: int = 1
    """Samples per prompt; they share the prompt's prefill."""
    seed: int | None = None
    """Per-request sampling seed; None draws from the engine's generator."""

    def __post_init__(self) -> None:
        # msgspec checks field types only when decoding; requests built in code (or from a JSON
        # body's dict) get the same checks here, so a bad value fails its own request, with its name,
        # and never reaches the running batch (where it would fail every request in flight)
        for name in ("max_new_tokens", "top_k", "n"):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != v:
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        # Plain Python values from here on (numpy integers overflow in the seed hash, a list of stop ids
        # does not concatenate with the EOS tuple): the struct is frozen, so set them the one allowed way.
        for name in ("max_new_tokens", "top_k", "n"):
            msgspec.structs.force_setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p"):
            msgspec.structs.force_setattr(self, name, float(getattr(self, name)))
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.seed is not None:
            msgspec.structs.force_setattr(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below ``GREEDY_TEMPERATURE`` (as SGLang treats it)."""
        return self.temperature < GREEDY_TEMPERATURE


GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this decode greedily (dividing by them would overflow float32 logits to inf/NaN)."""

_INT_LIMIT = 2**62


def _check_int(name: str, v: object) -> None:
    """An int field (not a bool, not a float) within int64 with room to spare."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not -_INT_LIMIT < v < _INT_LIMIT:
        raise ValueError(f"{name}={v} is out of range (|value| < 2**62)")


class GenerateRequest(msgspec.Struct, kw_only=True):
    """One prompt to complete ``sampling.n`` times."""

    input_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""
    """Caller's id, used by ``abort``; the engine assigns one when empty."""


class Completion(msgspec.Struct, kw_only=True):
    """One generated sample."""

    output_ids: list[int]
    """Generated token ids, the stop token included when one ended the sample."""
    logprobs: list[float]
    """Log-prob of each output token under the sampling distribution (module docstring)."""
    finish_reason: FinishReason
    versions: list[int]
    """Policy version of the weights that produced each output token."""

    @property
    def behavior_version(self) -> int:
        """The oldest policy version that contributed a token (-1 for an empty completion)."""
        return min(self.versions) if self.versions else -1


class StreamDelta(msgspec.Struct, kw_only=True):
    """What one sample of a streamed request (``TorchEngine.generate_stream``) produced since its last delta."""

    index: int
    """The sample (``0 .. n-1``)."""
    output_ids: list[int]
    """New token ids (possibly none in a sample's last delta), in order; never sent twice."""
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None
    """Set on the sample's last delta only; the concatenated deltas then equal its ``Completion``."""


class GenerateResult(msgspec.Struct, kw_only=True):
    """The ``n`` completions of one request, in sample order."""

    request_id: str
    prompt_tokens: int
    completions: list[Completion]


@runtime_checkable
class Engine(Protocol):
    """What a rollout worker needs from an engine.

    Weight updates follow SGLang's shape: ``begin_weight_update`` stages, ``load_weights`` may be
    called several times with Hugging Face-named (full, unsharded) tensors, and
    ``end_weight_update`` makes the whole new version visible at once, between decode steps.
    """

    @property
    def version(self) -> int: ...

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def update_weights(self, named_tensors, version: int) -> None: ...
