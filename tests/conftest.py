"""Shared fixtures. Each group prefixes its fixtures with its package name (data_, ...)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Fixtures kept in their own modules (tests/helpers is on sys.path: tests has no __init__).
pytest_plugins = ["helpers.train_data"]


def _shared_data() -> Path:
    """../shared/data next to the repo (as in CI), or $SINKLM_SHARED_DATA."""
    override = os.environ.get("SINKLM_SHARED_DATA")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def data_shared() -> Path:
    """The real data folder (tokenizer, books, corpus); tests skip, saying why, without it."""
    root = _shared_data()
    if not (root / "tokenizers" / "gpt-neox-20b" / "tokenizer.json").is_file():
        pytest.skip(f"shared data not found at {root} (set SINKLM_SHARED_DATA to its folder)")
    return root


@pytest.fixture(scope="session")
def data_neox_path(data_shared: Path) -> Path:
    """The GPT-NeoX-20B / Pythia tokenizer.json."""
    return data_shared / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
