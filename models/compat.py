"""Every use of a private torch or Lightning API, in one place.

Upstream may rename or re-sign a private name in any release. tests/test_compat.py checks each
one here against the installed torch and Lightning, so an upgrade that breaks one fails there,
by name, instead of deep inside a training run. Private hooks that sinklm's subclasses override
(a method of the same name, not a call) are listed in ``OVERRIDDEN_HOOKS`` for the same check.

attention.py imports this module, so it ships in exported folders, where transformers requires
every package a shipped file imports: it imports torch alone, and Lightning objects come in as
arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Private methods that sinklm's subclasses override, by the upstream class that calls them.
OVERRIDDEN_HOOKS: dict[str, tuple[str, ...]] = {
    # SinkLMCLI: keep the config as given, not the checkpoint's hyperparameters.
    "lightning.pytorch.cli.LightningCLI": ("_parse_ckpt_path",),
    # StepProgressBar: no negative epoch total when max_steps bounds the run.
    "lightning.pytorch.callbacks.RichProgressBar": ("_get_train_description",),
}

# SDPA's fused kernels, called directly because only they return each row's log-sum-exp, which
# the sink variants need (models/attention.py). No dropout: sinklm trains without it.


def cpu_flash_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """SDPA's CPU flash kernel: (out, lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def cpu_flash_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
    mask: Tensor | None, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def cuda_flash_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """torch's FlashAttention-2: (out, lse, and the seed and offset its backward takes)."""
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale
    )
    return out, lse, seed, offset


def cuda_flash_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
    offset: Tensor, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(  # dense: no cum. lengths
        grad, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, is_causal, seed,
        offset, scale=scale,
    )


def efficient_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The memory-efficient kernel: (out, lse padded along T, seed, offset)."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )


def efficient_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
    seed: Tensor, offset: Tensor, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], is_causal,
        scale=scale,
    )
    return dq, dk, dv


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """What ``get_last_lr()`` reports and the scheduler's state saves, after its lrs were set
    by hand (torch offers no public setter; ``step()`` would also advance the schedule)."""
    scheduler._last_lr = list(lrs)


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """A ModelParallelStrategy's data-parallel size, before ``setup_environment`` reads it
    (its ``"auto"`` means one per node; only then are the devices and nodes known)."""
    strategy._data_parallel_size = size


def last_saved_step(callback: Any) -> int:
    """The global step of the newest checkpoint a ModelCheckpoint wrote (0 before any)."""
    return callback._last_global_step_saved


def save_last(callback: Any, trainer: Any) -> None:
    """Have a ModelCheckpoint write its ``last`` checkpoint now, as at its intervals."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
