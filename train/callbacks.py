"""What a run shows while it trains: tokens/s and MFU, and how attention sinks form."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar

from sinklm.data.synthetic import trigger_token_ids
from sinklm.eval.sinks import classify_positions, measure_sinks
from sinklm.models.checkpoint import PROBE_STATE_KEY
from sinklm.models.compat import last_saved_step, save_last


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also keeps the final state when training ends between intervals.

    Lightning's ``save_last`` writes ``last`` at the end only if it never wrote one before, so a
    run of 150 steps checkpointed every 100 would end with ``last`` at step 100.
    """

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.save_last and last_saved_step(self) != trainer.global_step:
            save_last(self, trainer)
        super().on_train_end(trainer, module)


class Throughput(L.Callback):
    """Logs tokens/s (all ranks together) and MFU every ``log_every_n_steps`` optimizer steps.

    MFU = achieved training FLOPs per device / peak FLOPs per device. Training FLOPs per token
    come from ``ModelConfig.training_flops_per_token`` (6 per matmul weight + attention);
    peak FLOPs from Lightning's GPU table (H100, H200, A100, ...) for the run's precision, or
    ``peak_flops`` when given (e.g. for a GPU the table lacks, or a CPU).
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak_flops = peak_flops
        self._start: float | None = None
        self._tokens = 0
        self._last_logged_step = -1

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._tokens += batch["input_ids"].numel()
        step, every = trainer.global_step, trainer.log_every_n_steps
        if self._start is None or every < 1 or step % every or step == self._last_logged_step:
            return
        self._last_logged_step = step
        if module.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._start
        per_device = self._tokens / elapsed
        tokens_per_s = per_device * trainer.world_size
        module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True, rank_zero_only=True)
        peak = self.peak_flops or self._table_peak(trainer, module)
        if peak:
            seq_len = batch["input_ids"].shape[1]
            flops = module.config.training_flops_per_token(seq_len)
            module.log("perf/mfu", per_device * flops / peak, prog_bar=True, rank_zero_only=True)
        self._start, self._tokens = time.perf_counter(), 0

    @staticmethod
    def _table_peak(trainer: L.Trainer, module: L.LightningModule) -> float | None:
        if module.device.type != "cuda":
            return None
        precision = str(trainer.precision)
        dtype = torch.bfloat16 if "bf16" in precision else (
            torch.float16 if "16" in precision else torch.float32
        )
        return get_available_flops(module.device, dtype)


# Logged metric -> its label in the progress display.
PROGRESS_LABELS = {"train/loss": "loss", "val/loss": "val_loss", "perf/tokens_per_s": "tok/s",
                   "perf/mfu": "mfu"}


def progress_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Lightning's progress-bar metrics with short labels, tokens/s as ``12,345``, and without
    ``v_num`` (the logger's version folder, not a measurement)."""
    metrics = dict(metrics)
    metrics.pop("v_num", None)
    if "perf/tokens_per_s" in metrics:
        metrics["perf/tokens_per_s"] = f"{float(metrics['perf/tokens_per_s']):,.0f}"
    return {PROGRESS_LABELS.get(name, name): value for name, value in metrics.items()}


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar with short metric labels and no negative epoch total.

    The logged names (``perf/tokens_per_s``) were cut off on an 80-column terminal, and a run
    bounded by ``max_steps`` (Lightning's ``max_epochs=-1``) read ``Epoch 0/-2``.
    """

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        return progress_metrics(super().get_metrics(trainer, module))

    def _get_train_description(self, current_epoch: int) -> str:
        """The bar's label (a private hook: ``models.compat.OVERRIDDEN_HOOKS`` lists it)."""
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:  # bounded by max_steps: no epoch total
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


class StepLines(ProgressBar):
    """Progress where no terminal shows a bar (a log file, a pipe): one line on stderr every
    ``log_every_n_steps`` optimizer steps and at the end, e.g. ``sinklm fit: step 20/150:
    loss 4.213, tok/s 12,345``.

    A line is written when the next step starts: Lightning gathers a step's logged values
    (Throughput's tokens/s among them) only after every callback's ``on_train_batch_end``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._written = -1

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._written = trainer.global_step  # a resumed run's first step has nothing to say

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        every = trainer.log_every_n_steps
        if every > 0 and trainer.global_step % every == 0:
            self._write(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._write(trainer, module)

    def _write(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._written:
            return
        self._written = step
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        metrics = progress_metrics(self.get_metrics(trainer, module))
        shown = ", ".join(f"{name} {value:.4g}" if isinstance(value, float) else
                          f"{name} {value}" for name, value in metrics.items())
        print(f"sinklm fit: step {step}{total}: {shown}", file=sys.stderr, flush=True)


def progress_display(stream: TextIO) -> ProgressBar:
    """The rich bar where ``stream`` (the one rich draws on) is a terminal; elsewhere a bar's
    redraws would fill a log file, so plain lines instead."""
    return StepProgressBar() if stream.isatty() else StepLines()


class SinkProbe(L.Callback):
    """Every ``every_n_steps``, attention statistics of the model on a fixed probe batch.

    The probe is the first batch of validation data (the same tokens for the whole run), so
    the curves show when and how a first-token sink forms: per layer, the attention mass on
    the first position, and Sink_1^eps, the share of heads whose mean attention to the first
    position exceeds ``eps`` (Gu et al., default 0.3); on Bigram-Backcopy data also, per layer
    and head, the attention of non-trigger queries to position 0. Computed by
    ``sinklm.eval.sinks``, the code behind ``sinklm sinks``.
    """

    def __init__(self, every_n_steps: int = 200, eps: float = 0.3, max_rows: int = 4) -> None:
        self.every_n_steps = every_n_steps
        self.eps = eps
        self.max_rows = max_rows
        self.history: list[dict[str, Any]] = []
        self._probe: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None

    def probe(self, trainer: L.Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Probe windows, their token classes and the tokenizer's trigger ids, built once."""
        if self._probe is None:
            data = trainer.datamodule
            rows = next(iter(data.probe_dataloader()))["input_ids"][: self.max_rows]
            tokenizer = data.load_tokenizer()
            windows = list(rows)
            classes = [classify_positions(tokenizer, row, data.sink_tokens) for row in windows]
            self._probe = (windows, classes, trigger_token_ids(tokenizer))
        return self._probe

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # Every rank probes (sharded weights are gathered collectively); rank 0 logs.
        if self.every_n_steps < 1 or step % self.every_n_steps:
            return
        if self.history and self.history[-1]["step"] == step:
            return  # gradient accumulation: several micro-batches end on the same step
        windows, classes, triggers = self.probe(trainer)
        was_training = module.training
        module.eval()
        try:
            report = measure_sinks(module.model, windows, classes, first=1, eps=self.eps,
                                   trigger_ids=triggers)
        finally:
            module.train(was_training)
        tokens_per_step = (
            batch["input_ids"].numel() * trainer.world_size * trainer.accumulate_grad_batches
        )
        row = {
            "step": step,
            "tokens": step * tokens_per_step,
            "sink_rate": report.sink_rate(1),
            "first_mass": report.to_position[:, :, 0].mean(1).tolist(),
        }
        metrics = {f"sinks/first_mass_layer{i}": m for i, m in enumerate(row["first_mass"])}
        non_trigger = report.non_trigger_first()
        if non_trigger is not None:  # Bigram-Backcopy: per layer and head
            row["non_trigger_first"] = non_trigger.tolist()
            metrics |= {f"sinks/non_trigger_first_layer{i}": float(m.max())
                        for i, m in enumerate(non_trigger)}
        self.history.append(row)
        metrics[f"sinks/sink_rate_eps{self.eps}"] = row["sink_rate"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @property
    def state_key(self) -> str:
        """Where checkpoints keep the history: the key ``probe_history`` reads, fixed."""
        return PROBE_STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
