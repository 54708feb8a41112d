"""Callbacks that `sinklm fit` subprocesses in the training tests load by class path.

They only observe or end a run (SIGKILL at a step, batches and weights written to files), so
the code under test is the real CLI path.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch


class KillAtStep(L.Callback):
    """SIGKILL this process once ``step`` optimizer steps are done: a crash, not a shutdown."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            for logger in trainer.loggers:
                logger.save()
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(L.Callback):
    """Send ``signum`` to this process once at ``step`` (what SLURM does before the limit)."""

    def __init__(self, step: int, signum: int = int(signal.SIGUSR1)) -> None:
        self.step, self.signum, self.sent = step, signum, False

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


class RecordRun(L.Callback):
    """Write each rank's batches (input_ids) and final weights to ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append(batch["input_ids"].clone())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"batches": self.batches, "weights": module.model.state_dict()},
            self.directory / f"rank{trainer.global_rank}.pt",
        )
