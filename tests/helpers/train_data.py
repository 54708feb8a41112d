"""Tiny real training data for the training tests, built once per test session.

A 600-id byte-level BPE trained on one shared book, and the three shared books packed with it
(two for training, one for validation): small enough to train a few steps in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sinklm.data import PrepareConfig, prepare_data, save_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent  # holds train_probes.py for subprocess class paths


@dataclass
class TinyData:
    packed: Path
    tokenizer: Path


@pytest.fixture(scope="session")
def train_data(data_shared: Path, tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    root = tmp_path_factory.mktemp("train_data")
    book = (data_shared / "books" / "frankenstein_shelley_pg84.txt").read_text()
    (root / "book.txt").write_text(book[:20_000])  # a short stream for evaluation tests
    tokenizer_path = save_tokenizer(train_tokenizer([book], vocab_size=600), root / "tokenizer")
    packed = root / "packed"
    prepare_data(
        PrepareConfig(source={"path": str(data_shared / "books")}, output=str(packed),
                      tokenizer=str(tokenizer_path), val_fraction=0.3),
        log=None,
    )
    return TinyData(packed=packed, tokenizer=tokenizer_path)


def tiny_config(data: TinyData, root: Path, *, variant: str = "sink_token", steps: int = 8,
                checkpoint_every: int = 4, callbacks: list[dict] | None = None,
                extra_trainer: dict | None = None) -> dict:
    """A complete `sinklm fit` config for a ~0.1M-parameter model on the tiny data."""
    return {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": steps,
            "precision": "32-true",
            "log_every_n_steps": 1,
            "val_check_interval": 1000,
            "limit_val_batches": 1,
            "num_sanity_val_steps": 0,
            "gradient_clip_val": 1.0,
            "default_root_dir": str(root),
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(root), "name": "logs",
                              "flush_logs_every_n_steps": 1},
            },
            "callbacks": callbacks or [],
            **(extra_trainer or {}),
        },
        "model": {
            "preset": "tiny-1m",
            "variant": variant,
            "model_overrides": {"vocab_size": 640, "d_model": 32, "n_head": 2, "n_layer": 2,
                                "max_seq_len": 64},
            "optimizer": {"lr": 3.0e-3},
        },
        "data": {"path": str(data.packed), "seq_len": 64, "micro_batch_size": 4,
                 "num_workers": 0},
        "checkpoint": {"every_n_train_steps": checkpoint_every},
        "sink_probe": {"every_n_steps": 0},
        "ckpt_path": "auto",
    }


def run_fit(config_path: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`sinklm fit --config FILE ARGS` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "PYTHONPATH": str(PROBES), "WANDB_MODE": "offline",
                **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "sinklm.cli.main", "fit", "--config", str(config_path), *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO,
    )
