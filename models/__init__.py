"""The Pythia-style network, its attention variants and transformers interop."""

from .config import (
    BACKENDS,
    PRESETS,
    SOFTMAX_VARIANTS,
    VARIANTS,
    AttentionConfig,
    ConfigError,
    ModelConfig,
)
from .model import CausalLM, KVCache

__all__ = [
    "BACKENDS",
    "PRESETS",
    "SOFTMAX_VARIANTS",
    "VARIANTS",
    "AttentionConfig",
    "CausalLM",
    "ConfigError",
    "KVCache",
    "ModelConfig",
]
