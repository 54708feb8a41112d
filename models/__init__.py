"""The Pythia-style network, its attention variants and transformers interop.

``CausalLM`` and ``KVCache`` load on first use (PEP 562): importing the config alone, as every
``sinklm`` command's argument parser does, must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sinklm.data.lazy import lazy_exports

from .config import (
    BACKENDS,
    PRESETS,
    SOFTMAX_VARIANTS,
    VARIANTS,
    AttentionConfig,
    ConfigError,
    ModelConfig,
)

if TYPE_CHECKING:
    from .model import CausalLM, KVCache

__getattr__ = lazy_exports(__name__, {"CausalLM": ".model", "KVCache": ".model"})

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
