"""`val/loss` scores the same windows at every check and after a resume, so curves across
steps, resumes and variants compare like with like."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.train_data import TinyData
from lightning.pytorch.loggers import CSVLogger

from sinklm.train.callbacks import StepCheckpoint
from sinklm.train.data_module import SinkLMDataModule
from sinklm.train.module import OptimizerConfig, SinkLMModule

VAL_BATCHES = 3


def frozen_run(train_data: TinyData, root: Path, steps: int) -> tuple[SinkLMModule,
                                                                       SinkLMDataModule,
                                                                       L.Trainer]:
    """A run with lr 0: the weights never change, so every check must log the same loss."""
    torch.manual_seed(0)
    module = SinkLMModule(
        preset="tiny-1m", variant="sink_token", optimizer=OptimizerConfig(lr=0.0),
        model_overrides={"vocab_size": 640, "d_model": 32, "n_head": 2, "max_seq_len": 64},
    )
    data = SinkLMDataModule(path=str(train_data.packed), seq_len=64, sink_tokens=1,
                            vocab_size=640, micro_batch_size=4, num_workers=0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, val_check_interval=1,
        limit_val_batches=VAL_BATCHES, num_sanity_val_steps=2,
        logger=CSVLogger(root, name="logs"), log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[StepCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2,
                                  save_top_k=-1, filename="step{step}",
                                  auto_insert_metric_name=False)],
    )
    return module, data, trainer


def logged_val_losses(root: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["val/loss"])
            for log in sorted(root.glob("logs/version_*/metrics.csv"))
            for row in csv.DictReader(log.open()) if row.get("val/loss")}


def test_every_check_scores_the_first_batches_of_the_split(train_data: TinyData,
                                                           tmp_path: Path) -> None:
    module, data, trainer = frozen_run(train_data, tmp_path, steps=3)
    trainer.fit(module, data)
    resumed_module, resumed_data, resumed = frozen_run(train_data, tmp_path, steps=5)
    resumed.fit(resumed_module, resumed_data,
                ckpt_path=tmp_path / "checkpoints" / "step2.ckpt", weights_only=False)

    logged = logged_val_losses(tmp_path)
    assert sorted(logged) == [0, 1, 2, 3, 4]  # after steps 1-3, and 3-5 resumed from step 2
    assert len(set(logged.values())) == 1, logged  # same weights, same windows, same loss
    # ... and those windows are the first VAL_BATCHES batches of the split, in order.
    module.eval()
    with torch.no_grad():
        expected = torch.stack([module.loss(batch) for batch in
                                itertools.islice(data.val_dataloader(), VAL_BATCHES)]).mean()
    assert logged[0] == pytest.approx(expected.item(), rel=1e-6)
