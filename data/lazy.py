"""Package attributes imported on first use (PEP 562).

The argument parser of every ``sinklm`` command imports ``sinklm.data`` and ``sinklm.models``;
their torch-based parts must not load until a command actually needs them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``modules[name]``.

    ``modules`` maps each lazy name to its module, relative to ``package`` (``.windows``). The
    value is stored on the package, so the import happens once.
    """

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
