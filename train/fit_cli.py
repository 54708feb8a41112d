"""The LightningCLI behind ``sinklm fit``: our module, data, callbacks, links and checks.

``train/fit.py`` runs what needs no torch (help, the checks on the command line and the config
files) and imports this module only once they pass. On top of LightningCLI this adds what a
long pretraining run needs before any compute starts: the global batch is checked against
devices x nodes x accumulation, the data's sink count is linked to the model's, checkpoints go
to a fixed folder (``{default_root_dir}/checkpoints``) and ``--ckpt_path auto`` resumes from the
newest checkpoint there or from a SLURM hpc checkpoint. Any checkpoint to resume from, found or
named, must hold the configured model, sink ids, tokenizer and data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, Strategy

from sinklm.cli.fit import DESCRIPTION, USAGE
from sinklm.models.checkpoint import (
    CHECKPOINT_KEY,
    DATA_KEY,
    SINK_IDS_KEY,
    CheckpointFormatError,
    read_checkpoint,
)
from sinklm.models.config import ConfigError, ModelConfig, variant_name

from .batching import check_global_batch
from .callbacks import SinkProbe, StepCheckpoint, Throughput, progress_display
from .data_module import SinkLMDataModule
from .fit import argument_error_line, check_max_steps, newest_checkpoint
from .module import OptimizerConfig, SinkLMModule, model_config, resolve_sink_tokens


def check_strategy(strategy: Strategy) -> None:
    """Refuse Lightning's FSDP1 strategy: it flattens parameters, which our weight-decay groups
    and checkpoint layout were not built for and which no test covers; FSDP2 is."""
    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "trainer.strategy=fsdp (Lightning's FSDP1) is not supported; for sharded training use "
            "--trainer.strategy sinklm.train.parallel.FullyShardedStrategy (FSDP2, one unit per "
            "block, full-state checkpoints)"
        )


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _short(value: str | None) -> str:
    return "none" if value is None else value[:12]


def resume_differences(checkpoint: dict[str, Any], config: ModelConfig,
                       data: SinkLMDataModule) -> list[str]:
    """What differs between a checkpoint and this run, as ``what: checkpoint X vs config Y``."""
    # Read back through the dataclass, so that a field added since the checkpoint was written
    # compares at its default (what the checkpoint's network was).
    saved = _flatten(ModelConfig.from_dict(checkpoint[CHECKPOINT_KEY]).to_dict())
    current = _flatten(config.to_dict())
    # The kernel is not part of the model: resuming an sdpa run with flash is fine; nor is the
    # name, which says what the network is (older checkpoints of a changed preset lack that).
    differing = [key for key in current if key not in ("attention.backend", "name")
                 and saved.get(key) != current[key]]
    found = []
    if {"attention.softmax", "sink_tokens"} & set(differing):
        was = config.replace(attention={"softmax": saved.get("attention.softmax")},
                             sink_tokens=saved.get("sink_tokens"))
        found.append(f"variant: checkpoint {variant_name(was)} vs config {variant_name(config)}")
    found += [f"model {key}: checkpoint {saved.get(key)!r} vs config {current[key]!r}"
              for key in differing]
    saved_sinks = checkpoint.get(SINK_IDS_KEY)
    if saved_sinks is not None and list(saved_sinks) != data.sink_ids:
        found.append(f"sink ids: checkpoint {list(saved_sinks)} vs data {data.sink_ids}")
    saved_data = checkpoint.get(DATA_KEY)
    if saved_data is not None:
        saved_data = data.recorded_identity(saved_data)  # older checkpoints: stream windows
        for key, value in data.identity().items():
            if saved_data.get(key) != value:
                what = key.replace("_", " ")
                found.append(f"{what}: checkpoint {_short(saved_data.get(key))} vs data "
                             f"{_short(value)}")
    return found


def check_resume_compatible(path: Path, config: ModelConfig,
                            data: SinkLMDataModule) -> str | None:
    """Refuse a checkpoint of another model, sink ids, tokenizer or data, in one line naming
    each difference; return a note when the checkpoint predates recording its data."""
    try:
        checkpoint = read_checkpoint(path)
    except CheckpointFormatError as error:  # its message starts with the path
        raise ConfigError(
            f"ckpt_path={error}; point --ckpt_path at a .ckpt written by `sinklm fit`, or use "
            "--ckpt_path auto"
        ) from None
    differences = resume_differences(checkpoint, config, data)
    if differences:
        raise ConfigError(
            f"ckpt_path={path} holds another model or data than this config "
            f"({'; '.join(differences)}); resume it with the config and data it was trained "
            "with, or give this config its own checkpoint (another --ckpt_path, or a new "
            "trainer.default_root_dir with --ckpt_path auto)"
        )
    if DATA_KEY not in checkpoint:
        return (f"ckpt_path={path} was written before checkpoints recorded their data, so its "
                "tokenizer and data cannot be checked against this config's; resuming anyway")
    return None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, keeping the description's line breaks (its examples)."""


class SinkLMCLI(LightningCLI):
    """LightningCLI with sinklm's callbacks, links and checks, refusing before any compute."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only fit (evaluation has its own commands), so its parser is the one built."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.fit_parser = parser  # its keys are the candidates for "did you mean"
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
            ("model.variant", "model.sink_tokens", "model.model_overrides"), "data.sink_tokens",
            compute_fn=resolve_sink_tokens,
        )
        parser.link_arguments(
            ("model.preset", "model.model_overrides"), "data.vocab_size",
            compute_fn=lambda preset, overrides: model_config(
                preset, model_overrides=overrides
            ).vocab_size,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, turning jsonargparse's error (usage dump and all) into one ConfigError line."""
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            known = [*self.fit_parser.get_defaults().keys(),
                     *(f"model.optimizer.{f.name}" for f in dataclasses.fields(OptimizerConfig))]
            raise ConfigError(argument_error_line(str(error), known)) from None

    def _parse_ckpt_path(self) -> None:
        """Keep the config as given. LightningCLI would replace the model section with the
        checkpoint's hyperparameters, so a zero_sink config resumed from a sink_token checkpoint
        silently trained sink_token; ``before_fit`` checks the checkpoint against the config.
        (A private hook: ``models.compat.OVERRIDDEN_HOOKS`` lists it for the upstream check.)"""

    def before_instantiate_classes(self) -> None:
        """Refuse a max_steps the schedule cannot use before the Trainer, which would end a
        negative one in a traceback, is built."""
        check_max_steps(self.config[self.subcommand]["trainer"]["max_steps"])

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with our progress display unless the config disables or chooses one."""
        settings = self.config_init[self.subcommand]["trainer"]
        callbacks = settings.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if settings.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            kwargs["callbacks"] = [*callbacks, progress_display(sys.stdout)]
        return super().instantiate_trainer(**kwargs)

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
        if data.sink_tokens != model.config.sink_tokens:  # the link above makes them agree
            raise ConfigError(
                f"the model has sink_tokens={model.config.sink_tokens} but the data prepends "
                f"{data.sink_tokens} sink ids; set the count once, with model.sink_tokens"
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
            note = check_resume_compatible(Path(config["ckpt_path"]), model.config, data)
            if note:
                print(f"sinklm fit: {note}", file=sys.stderr)
        if trainer.is_global_zero:  # instead of Lightning's summary, whose FLOPs read 0
            parameters = sum(p.numel() for p in model.parameters())
            print(f"sinklm fit: {model.hparams.preset} {variant_name(model.config)}, "
                  f"{parameters:,} parameters", file=sys.stderr)


class _Parsed(Exception):
    """Ends an argument check once the arguments parsed: nothing is built."""


class _ArgumentCheck(SinkLMCLI):
    """Parses and checks as ``sinklm fit`` does, then stops before the model, data and trainer
    are built (or the seed is set)."""

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        check_max_steps(self.config["fit"]["trainer"]["max_steps"])
        raise _Parsed


class _NoAdverts(logging.Filter):
    """Drop Lightning's "💡 Tip: try installing litlogger/litmodels" lines: adverts, not news
    about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


_NO_ADVERTS = _NoAdverts()


def _lightning_cli(cli: type[SinkLMCLI], argv: list[str]) -> None:
    # We hand LightningCLI our argv on purpose (`sinklm fit ...` is not its own script).
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    # Lightning's own call into torch's pytree API; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NO_ADVERTS)
    # Errors raise (one line below) instead of printing the whole usage; no abbreviations, so
    # a typo'd --trainer.max_step is refused instead of silently meaning max_steps. The fit
    # parser takes these from the main one.
    main = {"exit_on_error": False, "allow_abbrev": False, "formatter_class": _HelpFormatter}
    cli(
        SinkLMModule, SinkLMDataModule, args=["fit", *argv],
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"enable_model_summary": False},
        # The recipe's optimizer and schedule are model.optimizer; LightningCLI's
        # --optimizer/--lr_scheduler would silently replace them.
        auto_configure_optimizers=False,
        parser_kwargs={**main, "fit": {"default_env": False, "usage": USAGE,
                                       "description": DESCRIPTION}},
    )


def run(argv: list[str]) -> None:
    """Train as ``argv`` (``sinklm fit``'s arguments) says; a refusal raises ConfigError."""
    _lightning_cli(SinkLMCLI, argv)


def parse_only(argv: list[str]) -> None:
    """Every check ``run`` makes on ``argv`` before it builds anything, and nothing else."""
    with contextlib.suppress(_Parsed):
        _lightning_cli(_ArgumentCheck, argv)
