"""``sinklm fit --config FILE [--section.key value ...]``: LightningCLI over our module and data.

On top of LightningCLI this adds what a long pretraining run needs before any compute starts:
the global batch is checked against devices x nodes x accumulation, the data's sink count is
linked to the model's, checkpoints go to a fixed folder (``{default_root_dir}/checkpoints``)
and ``--ckpt_path auto`` resumes from the newest checkpoint there or from a SLURM hpc
checkpoint, refusing one written by another model or variant.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, Strategy

from sinklm.data.errors import DataError
from sinklm.models.config import VARIANTS, ConfigError, ModelConfig

from .batching import check_global_batch
from .callbacks import SinkProbe, StepCheckpoint, Throughput
from .data_module import SinkLMDataModule
from .module import CHECKPOINT_KEY, SinkLMModule


def resolve_sink_tokens(variant: str | None, sink_tokens: int | None) -> int:
    """The sink count the model will have: explicit, else the variant's, else 0."""
    if sink_tokens is not None:
        return sink_tokens
    return VARIANTS[variant][1] if variant in VARIANTS else 0


def newest_checkpoint(checkpoint_dir: Path, root_dir: Path) -> Path | None:
    """The most recently completed checkpoint: ModelCheckpoint's files or SLURM hpc ones.

    Lightning's own ``ckpt_path="last"`` ignores hpc checkpoints, and its hpc rule ignores
    ``last``; after a preemption either may be newer, so we take the newest by completion
    time (saves are atomic: a file appears only once fully written).
    """
    candidates = [*checkpoint_dir.glob("*.ckpt"), *root_dir.glob("hpc_ckpt_*.ckpt")]
    return max(candidates, key=lambda p: p.stat().st_mtime_ns, default=None)


def check_strategy(strategy: Strategy) -> None:
    """Refuse Lightning's FSDP1 strategy: it flattens parameters, which our weight-decay groups
    and checkpoint layout were not built for and which no test covers; FSDP2 is."""
    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "trainer.strategy=fsdp (Lightning's FSDP1) is not supported; for sharded training use "
            "--trainer.strategy sinklm.train.parallel.FullyShardedStrategy (FSDP2, one unit per "
            "block, full-state checkpoints)"
        )


def check_resume_compatible(path: Path, config: ModelConfig) -> None:
    """Refuse a checkpoint whose model differs from the configured one."""
    if not path.is_file():
        raise ConfigError(f"ckpt_path={path}: no such checkpoint file")
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        raise ConfigError(f"ckpt_path={path} was not written by `sinklm fit` (no model config)")
    current = config.to_dict()
    # The kernel is not part of the model: resuming an sdpa run with flash is fine.
    saved["attention"].pop("backend", None)
    current["attention"].pop("backend", None)
    diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"ckpt_path={path} holds another model ({details}); point --ckpt_path at a "
            "checkpoint of this model, or change the config to match it"
        )


class SinkLMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": -1,
            "checkpoint.every_n_train_steps": 1000,
            "checkpoint.filename": "step{step:08d}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(SinkProbe, "sink_probe")
        parser.link_arguments(
            ("model.variant", "model.sink_tokens"), "data.sink_tokens",
            compute_fn=resolve_sink_tokens,
        )
        parser.link_arguments(
            ("model.preset", "model.model_overrides"), "data.vocab_size",
            compute_fn=lambda preset, overrides: ModelConfig.from_preset(
                preset, **(overrides or {})
            ).vocab_size,
        )

    def before_fit(self) -> None:
        trainer, model, data = self.trainer, self.model, self.datamodule
        check_strategy(trainer.strategy)
        if data.global_batch_size is not None:
            check_global_batch(
                data.global_batch_size, data.micro_batch_size, devices=trainer.num_devices,
                nodes=trainer.num_nodes, accumulate=trainer.accumulate_grad_batches,
            )
        if data.seq_len > model.config.max_seq_len:
            raise ConfigError(
                f"data.seq_len={data.seq_len} exceeds the model's max_seq_len="
                f"{model.config.max_seq_len}; lower data.seq_len or set "
                "model.model_overrides.max_seq_len"
            )
        data.check_vocabulary(model.config.vocab_size)
        root = Path(trainer.default_root_dir)
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, StepCheckpoint) and checkpoint.dirpath is None:
            checkpoint.dirpath = str(root / "checkpoints")
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "auto":
            found = newest_checkpoint(Path(checkpoint.dirpath), root)
            config["ckpt_path"] = str(found) if found else None
            print(f"sinklm fit: resuming from {found}" if found else
                  "sinklm fit: no checkpoint yet, starting from scratch", file=sys.stderr)
        if config.get("ckpt_path"):
            check_resume_compatible(Path(config["ckpt_path"]), model.config)


def run_fit(argv: list[str]) -> int:
    # We hand LightningCLI our argv on purpose (`sinklm fit ...` is not its own script).
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        SinkLMCLI(
            SinkLMModule, SinkLMDataModule, args=["fit", *argv],
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"fit": {"default_env": False}},
        )
    except (ConfigError, DataError) as error:
        print(f"sinklm fit: {error}", file=sys.stderr)
        return 2
    return 0
