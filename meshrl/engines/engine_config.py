"""TorchEngine's config: how to build and run one engine (``torch_engine.py``)."""

from __future__ import annotations

import msgspec
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to build and run a TorchEngine."""

    dtype: str = "auto"
    """'float32', 'bfloat16', 'float16', or 'auto': bfloat16 on CUDA and on a CPU with bf16
    instructions (``meshrl.cpu.native_bf16``: 1.5x the float32 engine's decode at 256 sequences of
    the embedded model), float32 on other CPUs."""
    device: str = "auto"
    """'cpu', 'cuda', 'cuda:N', or 'auto' (CUDA when available)."""
    max_batch_size: int = 256
    """Most sequences (samples) running at once: the number of KV cache rows."""
    kv_cache_bytes: int = 0
    """Memory budget of the KV cache in bytes; caps the rows below max_batch_size. 0: no cap."""
    max_seq_len: int = 0
    """Prompt + generated tokens per sequence. 0: min(model's max_position_embeddings, 4096)."""
    max_prefill_tokens: int = 16384
    """Padded prompt tokens per prefill forward (at least one request is always admitted)."""
    max_stop_token_ids: int = 8
    """Most stop ids per request, EOS included (a fixed-width row of the stop table)."""
    cuda_graphs: bool = True
    """Capture decode steps in CUDA graphs (CUDA only; batches with top-k/top-p run eagerly)."""
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    """Batch-size buckets to capture; (): 1, 2, 4, 8, then multiples of 16 up to max_batch_size."""
    compile: bool = False
    """torch.compile the decode step (with dynamic batch size; before graph capture when both)."""
    seed: int = 0
    """Seeds the per-request seeds of requests that bring none."""
    initial_version: int = 0
    """Policy version of the weights the engine starts with."""
    generate_timeout_s: float = 3600.0
    """How long one ``generate`` call may wait for its requests before aborting them."""
    stream_interval_steps: int = 1
    """``generate_stream``: decode steps between two reads of the streamed samples' new tokens (on
    CUDA each read waits for its step: raise it where throughput matters more than latency)."""
    contiguous_weights: bool = False
    """Hold every parameter in one allocation, so ``release_memory(weights=True)`` frees it at once and
    ``restore_memory`` gets it back, most often at the same address (set by the colocated mode)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_batch_size < 1 or self.max_prefill_tokens < 1 or self.stream_interval_steps < 1:
            raise ValueError(f"max_batch_size, max_prefill_tokens and stream_interval_steps must be >= 1, got "
                             f"{self.max_batch_size}, {self.max_prefill_tokens} and {self.stream_interval_steps}")
        if not self.generate_timeout_s > 0:  # inf: no bound
            raise ValueError(f"generate_timeout_s must be > 0 seconds, got {self.generate_timeout_s}")
        if self.max_seq_len < 0 or self.kv_cache_bytes < 0:
            raise ValueError(f"max_seq_len and kv_cache_bytes must be >= 0 (0: derived), got {self.max_seq_len} "
                             f"and {self.kv_cache_bytes}")
