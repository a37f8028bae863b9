"""The embedded default: a small Qwen2 model, a character tokenizer and a cached warm start."""

from meshrl.embedded.model import EmbeddedModelConfig, build_model_config
from meshrl.embedded.tokenizer import build_char_tokenizer
from meshrl.embedded.warmstart import WarmStartConfig, WarmStartStopped, default_cache_dir, warm_start

__all__ = [
    "EmbeddedModelConfig",
    "WarmStartConfig",
    "WarmStartStopped",
    "build_char_tokenizer",
    "build_model_config",
    "default_cache_dir",
    "warm_start",
]
