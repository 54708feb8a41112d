"""The LightningModule: next-token loss, Pythia's AdamW groups, warmup + cosine schedule.

Everything about *what* is trained lives in ``ModelConfig`` (models/), and what its checkpoints
record beside the weights in ``models/checkpoint.py``; this module adds only how it is
optimised, and guards against non-finite losses so good weights are never replaced by poisoned
ones.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.checkpoint import schedule_steps, write_entries, write_schedule
from sinklm.models.compat import set_last_lr
from sinklm.models.config import VARIANTS, ConfigError

from .data_module import SinkLMDataModule
from .parallel import shard_model, total_norm


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or gradients stop being finite and the policy is ``stop``."""


@dataclass
class OptimizerConfig:
    """AdamW as GPT-NeoX trained Pythia (lr 6e-4 is Pythia-160M's)."""

    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_fraction: float = 0.01  # of trainer.max_steps, linear from 0
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of lr


def optimizer_settings(optimizer: OptimizerConfig | dict[str, Any] | None) -> dict[str, Any]:
    """``model.optimizer`` as comparable values (None is the defaults, as the module uses)."""
    if optimizer is None:
        optimizer = OptimizerConfig()
    if dataclasses.is_dataclass(optimizer):
        optimizer = dataclasses.asdict(optimizer)
    defaults = dataclasses.asdict(OptimizerConfig())
    settings = {name: optimizer.get(name, default) for name, default in defaults.items()}
    settings["betas"] = tuple(float(beta) for beta in settings["betas"])
    return {name: value if name == "betas" else float(value) for name, value in settings.items()}


def optimizer_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each setting that differs, as ``name old -> new``."""
    return [f"{name} {saved[name]} -> {value}" for name, value in current.items()
            if saved.get(name) != value]


def resolve_sink_tokens(variant: str | None, sink_tokens: int | None,
                        overrides: dict[str, Any] | None) -> int:
    """The model's sink count: explicit, else ``model_overrides.sink_tokens``, else the
    variant's, else 0. The one rule: the module's config takes it, and `sinklm fit` links it to
    ``data.sink_tokens``, so the collator prepends exactly that many sink ids."""
    if sink_tokens is not None:
        return sink_tokens
    if overrides and "sink_tokens" in overrides:
        return int(overrides["sink_tokens"])
    return VARIANTS[variant][1] if variant in VARIANTS else 0


def model_config(
    preset: str,
    variant: str | None = None,
    softmax: str | None = None,
    sink_tokens: int | None = None,
    backend: str = "sdpa",
    model_overrides: dict[str, Any] | None = None,
) -> ModelConfig:
    """The network :class:`SinkLMModule` trains, from its arguments of the same names (the
    fit command's links read the data's vocabulary size from it too)."""
    if variant is not None and variant not in VARIANTS:
        raise ConfigError(f"model.variant={variant!r}: allowed {sorted(VARIANTS)}")
    config = ModelConfig.from_preset(preset, variant=variant, **(model_overrides or {}))
    sinks = resolve_sink_tokens(variant, sink_tokens, model_overrides)
    changes: dict[str, Any] = {"attention": {"backend": backend}, "sink_tokens": sinks}
    if softmax is not None:
        changes["attention"]["softmax"] = softmax
    return config.replace(**changes)


def lr_multiplier(step: int, total_steps: int, warmup_fraction: float, min_ratio: float) -> float:
    """Linear warmup over ``warmup_fraction`` of the steps, then cosine down to ``min_ratio``."""
    warmup = max(1, round(warmup_fraction * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay weight matrices and embeddings (every parameter with 2+ dims); not biases,
    LayerNorm parameters or per-head sink logits (all 1-D), as GPT-NeoX does."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class SinkLMModule(L.LightningModule):
    """Train a Pythia-style model with one of the attention variants.

    Args:
        preset: a size from ``sinklm info --list`` (pythia-14m ... pythia-410m, tiny-*).
        variant: a named point on the two axes (vanilla, zero_sink, sink_token, sink_logit,
            gated, two_sink_tokens); ``softmax`` and ``sink_tokens`` override it.
        softmax: attention.softmax (softmax, softmax1, sink_logit, gated).
        sink_tokens: sink ids the collator prepends (the data module reads this value).
        backend: attention kernel (eager, sdpa, flex, flash).
        model_overrides: any other ModelConfig field, e.g. ``{vocab_size: 4096}``.
        optimizer: AdamW and schedule settings.
        on_nonfinite: ``stop`` raises before the step (the last checkpoint stays the newest
            good state); ``skip`` drops the batch and goes on. Decided jointly by all ranks.
        compile: ``torch.compile`` the network (in place, so checkpoint keys do not change).
    """

    def __init__(
        self,
        preset: str = "pythia-160m",
        variant: str | None = None,
        softmax: str | None = None,
        sink_tokens: int | None = None,
        backend: str = "sdpa",
        model_overrides: dict[str, Any] | None = None,
        optimizer: OptimizerConfig | None = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Plain values, not the dataclass: unpickling a checkpoint then needs no sinklm.train
        # class, so evaluation reads it without importing Lightning.
        self.hparams["optimizer"] = optimizer_settings(optimizer)
        self.config = model_config(preset, variant, softmax, sink_tokens, backend,
                                   model_overrides)
        self.optim = optimizer or OptimizerConfig()
        self.on_nonfinite = on_nonfinite
        self.model = CausalLM(self.config)
        self.compile_model = compile
        self.skipped_batches = 0
        self._step_losses: list[Tensor] = []  # this optimizer step's micro-batch losses
        # Set when a checkpoint is loaded: the model.optimizer it was trained with (None when
        # it does not say), so a resume applies this run's settings and names the changes.
        self._resumed = False
        self._saved_optimizer: dict[str, Any] | None = None
        self._saved_max_steps: int | None = None

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # FullyShardedStrategy: FSDP2 over its mesh
            shard_model(self.model, self.device_mesh["data_parallel"], self.compile_model)
        elif self.compile_model:
            self.model.compile()

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        # Checked with the gradients before the optimizer step (one host sync per step, and no
        # None return, which Lightning refuses under DDP and which would still apply the
        # earlier micro-batches' gradients under accumulation).
        self._step_losses.append(loss.detach())
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=False)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the step's losses and gradient norm together: one host sync, all ranks agree.

        Runs after backward, before clipping and the update. ``skip`` drops every gradient
        (None, not zero): AdamW passes over parameters without one, so weights and optimizer
        state (moments, step counts) stay bit-identical, where zeroed gradients would still
        decay the moments, move the weights by momentum and apply weight decay. Lightning
        still counts the step and advances the LR schedule: a skipped batch uses up one of
        ``trainer.max_steps`` and one schedule step, so ``global_step`` and the schedule stay
        in step (also across a resume), and the run ends at the planned final lr.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = total_norm([p.grad for p in params])
        losses, self._step_losses = self._step_losses, []
        if not self._all_finite(torch.stack([norm.float(), *(x.float() for x in losses)])):
            if self.on_nonfinite == "stop":
                what = self._nonfinite_what(norm, losses)
                raise NonFiniteLossError(self._nonfinite_message(what))
            for param in params:
                param.grad = None
            self.skipped_batches += 1
            self.log("train/skipped_batches", float(self.skipped_batches))
        self.log("train/grad_norm", norm)

    def _all_finite(self, value: Tensor) -> bool:
        """True when ``value`` is finite on every rank, so all ranks take the same branch."""
        bad = (~torch.isfinite(value)).any().float()
        return bool(self.trainer.strategy.reduce(bad, reduce_op="max") == 0)

    def _nonfinite_message(self, what: str) -> str:
        return (
            f"non-finite training: {what}. The weights were not updated with it; the newest "
            "checkpoint on disk is the last good state. Resume from it with a lower "
            "optimizer.lr or stronger clipping (trainer.gradient_clip_val), or set "
            "model.on_nonfinite=skip to drop such batches."
        )

    def _nonfinite_what(self, norm: Tensor, losses: list[Tensor]) -> str:
        """What was not finite, for the message (only on this path do values reach the host)."""
        bad_loss = next((v for v in (x.item() for x in losses) if not math.isfinite(v)), None)
        if bad_loss is not None:
            what = f"loss is {bad_loss}"
        elif not math.isfinite(norm.item()):
            what = f"gradient norm is {norm.item()}"
        else:
            what = "the loss or gradients are not finite on another rank"
        return f"{what} at step {self.global_step}"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the model and the length of its schedule, and let the data module record its
        own entries: Lightning hands a data module no checkpoint to write into (its
        ``state_dict`` is kept apart, under its class name)."""
        write_entries(checkpoint, self.config)
        data = self.trainer.datamodule
        if isinstance(data, SinkLMDataModule):
            data.on_save_checkpoint(checkpoint)
        write_schedule(checkpoint, self.trainer.max_steps)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Note what the checkpoint was trained with; ``on_train_start`` applies this run's."""
        self._resumed = True
        saved = checkpoint.get("hyper_parameters")
        self._saved_optimizer = (optimizer_settings(saved.get("optimizer"))
                                 if isinstance(saved, dict) else None)
        self._saved_max_steps = schedule_steps(checkpoint)

    def on_train_start(self) -> None:
        """On a resume, the configured ``model.optimizer`` wins over the checkpoint's.

        Lightning restores the optimizer's param groups (lr, betas, eps, weight decay) and the
        scheduler's ``base_lrs`` from the checkpoint (with every strategy, FSDP2 included, this
        is done by now), so a changed ``--model.optimizer.lr`` would be silently ignored. Here
        they are set from the config; the Adam moments and step counts, and the schedule's
        step, stay restored. The schedule's lambda is not saved in checkpoints: it is this
        run's (warmup_fraction, min_lr_ratio, trainer.max_steps), so the current lr is
        recomputed from it too. Any change is named in one line, and so is a changed
        ``trainer.max_steps``: it reshapes the schedule from the resumed step on.
        """
        if not self._resumed:
            return
        self._resumed = False
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        # parameter_groups' order: decayed, then not decayed (always 0).
        decays = (self.optim.weight_decay, 0.0)
        for group, decay in zip(optimizer.param_groups, decays, strict=True):
            group.update(betas=tuple(self.optim.betas), eps=self.optim.eps, weight_decay=decay,
                         initial_lr=self.optim.lr)
        scheduler.base_lrs = [self.optim.lr] * len(optimizer.param_groups)
        for group, lmbda, base_lr in zip(optimizer.param_groups, scheduler.lr_lambdas,
                                         scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * lmbda(scheduler.last_epoch)  # as LambdaLR.get_lr
        set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])
        changes = (optimizer_changes(self._saved_optimizer, optimizer_settings(self.optim))
                   if self._saved_optimizer is not None else [])
        if changes and self.trainer.is_global_zero:
            print(f"sinklm fit: resuming with changed optimizer settings: {', '.join(changes)}",
                  file=sys.stderr)
        saved_total, total = self._saved_max_steps, self.trainer.max_steps
        if saved_total is not None and saved_total != total and self.trainer.is_global_zero:
            step = scheduler.last_epoch
            before = self.optim.lr * lr_multiplier(step, saved_total, self.optim.warmup_fraction,
                                                   self.optim.min_lr_ratio)
            print(f"sinklm fit: resuming with trainer.max_steps {saved_total} -> {total}: the "
                  f"warmup + cosine schedule now spans {total} steps (lr at step {step}: "
                  f"{before:.3g} -> {optimizer.param_groups[0]['lr']:.3g})", file=sys.stderr)

    def configure_optimizers(self) -> dict[str, Any]:
        total = self.trainer.max_steps
        if total is None or total <= 0:
            raise ConfigError(
                "trainer.max_steps must be set (the warmup + cosine schedule is defined over it)"
            )
        fused = self.device.type == "cuda"
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model, self.optim.weight_decay),
            lr=self.optim.lr, betas=tuple(self.optim.betas), eps=self.optim.eps, fused=fused,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_multiplier(
                step, total, self.optim.warmup_fraction, self.optim.min_lr_ratio
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
