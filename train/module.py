"""The LightningModule: next-token loss, Pythia's AdamW groups, warmup + cosine schedule.

Everything about *what* is trained lives in ``ModelConfig`` (models/); this module adds only
how it is optimised, and guards against non-finite losses so good weights are never replaced
by poisoned ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.config import VARIANTS, ConfigError

from .parallel import shard_model, total_norm

# Where a checkpoint records the model it holds, so a resume into another model is refused.
CHECKPOINT_KEY = "sinklm_model_config"
# Where it records the tokenizer (with its sink tokens) and the sink ids, for evaluation.
TOKENIZER_KEY = "sinklm_tokenizer"
SINK_IDS_KEY = "sinklm_sink_token_ids"


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
        if variant is not None and variant not in VARIANTS:
            raise ConfigError(f"model.variant={variant!r}: allowed {sorted(VARIANTS)}")
        config = ModelConfig.from_preset(preset, variant=variant, **(model_overrides or {}))
        changes: dict[str, Any] = {"attention": {"backend": backend}}
        if softmax is not None:
            changes["attention"]["softmax"] = softmax
        if sink_tokens is not None:
            changes["sink_tokens"] = sink_tokens
        self.config = config.replace(**changes)
        self.optim = optimizer or OptimizerConfig()
        self.on_nonfinite = on_nonfinite
        self.model = CausalLM(self.config)
        self.compile_model = compile
        self.skipped_batches = 0

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

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        loss = self.loss(batch)
        if not self._all_finite(loss.detach()):
            return self._handle_nonfinite(f"loss is {loss.item()} at step {self.global_step}")
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=False)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:  # the batch was skipped (on_nonfinite=skip): nothing to check
            return
        norm = total_norm(grads)
        if not self._all_finite(norm):
            if self.on_nonfinite == "stop":
                raise NonFiniteLossError(self._nonfinite_message(f"gradient norm is {norm}"))
            for grad in grads:  # skip: no gradient this step (AdamW moments still decay)
                grad.zero_()
            self.skipped_batches += 1
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

    def _handle_nonfinite(self, what: str) -> None:
        if self.on_nonfinite == "stop":
            raise NonFiniteLossError(self._nonfinite_message(what))
        self.skipped_batches += 1
        self.log("train/skipped_batches", float(self.skipped_batches))
        return None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.config.to_dict()
        data = getattr(self.trainer, "datamodule", None)
        if getattr(data, "tokenizer", None) is not None:
            checkpoint[TOKENIZER_KEY] = data.tokenizer.to_str()
            checkpoint[SINK_IDS_KEY] = list(data.sink_ids)

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
