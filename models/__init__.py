"""The Pythia-style network, its attention variants and transformers interop.

``CausalLM`` and ``KVCache`` load on first use (PEP 562): importing the config alone, as every
``sinklm`` command's argument parser does, must not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_LAZY = {"CausalLM": ".model", "KVCache": ".model"}

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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
