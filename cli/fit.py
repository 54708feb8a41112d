"""The text of ``sinklm fit --help`` and of LightningCLI's ``sinklm fit --help-all``.

``sinklm.cli.main.main`` hands fit's arguments to ``train/fit.py`` untouched. ``--help`` prints
``help_text()`` without importing torch or Lightning, as every other command's help does; it
names the settings most runs change. LightningCLI's full help, every setting with its type and
default, takes seconds to build and is ``--help-all``; it opens with the same usage and
description.
"""

from __future__ import annotations

import textwrap

from sinklm.models.config import PRESETS, VARIANTS

USAGE = "sinklm fit --config FILE [--SECTION.KEY VALUE ...] [--ckpt_path auto|PATH]"
DESCRIPTION = """\
Train a model from a YAML config (LightningCLI). Every setting can be given in
the YAML or as --SECTION.KEY VALUE, which wins over the file. Sections:
trainer, model, data, checkpoint, throughput, sink_probe. The optimizer and its
warmup + cosine schedule are model.optimizer. --ckpt_path auto resumes from the
newest checkpoint in {trainer.default_root_dir}/checkpoints (or a SLURM hpc
one), or starts from scratch when there is none; --ckpt_path PATH resumes from
that file. Either way the checkpoint must hold the configured model, sink ids,
tokenizer and data, or the run is refused before any compute.

example: sinklm fit --config configs/experiments/tiny-sink_token.yaml
resume where it stopped (or extend it to more steps):
  sinklm fit --config configs/experiments/tiny-sink_token.yaml \\
      --trainer.max_steps 400 --ckpt_path auto
every setting in one file, to edit and pass back with --config:
  sinklm fit --config configs/experiments/pythia-160m-vanilla.yaml \\
      --print_config > run.yaml"""
# The settings most runs change, by section, as (option, what it sets).
COMMON_SETTINGS = {
    "trainer (Lightning's Trainer)": (
        ("--trainer.max_steps N", "optimizer steps; the schedule spans them"),
        ("--trainer.accelerator cpu|gpu", "with --trainer.devices N, --trainer.num_nodes N"),
        ("--trainer.precision P", "32-true, bf16-mixed, ..."),
        ("--trainer.default_root_dir DIR", "logs, and checkpoints in DIR/checkpoints"),
        ("--trainer.log_every_n_steps N", "tokens/s, MFU and a progress line every N steps"),
        ("--trainer.val_check_interval N", "validation loss every N batches"),
    ),
    "model": (
        ("--model.preset NAME", ", ".join(sorted(PRESETS))),
        ("--model.variant NAME", ", ".join(sorted(VARIANTS))),
        ("--model.model_overrides '{K: V}'", "ModelConfig fields over the preset's"),
        ("--model.optimizer.lr LR", "and betas, weight_decay, warmup_fraction, min_lr_ratio"),
    ),
    "data": (
        ("--data.path DIR", "token shards from `sinklm prepare-data`"),
        ("--data.seq_len N", "tokens per training sequence"),
        ("--data.micro_batch_size N", "sequences per device and forward"),
        ("--data.global_batch_size N", "sequences per optimizer step, over all devices"),
    ),
    "checkpoint": (("--checkpoint.every_n_train_steps N", "a checkpoint every N steps"),),
    "throughput": (("--throughput.peak_flops F", "a device's peak FLOP/s, for MFU"),),
    "sink_probe": (("--sink_probe.every_n_steps N", "attention-sink statistics every N steps"),),
}


def help_text() -> str:
    """``sinklm fit --help``: usage, description, the common settings, where the rest are."""
    lines = [f"usage: {USAGE}", "", DESCRIPTION, "", "common settings:"]
    for section, settings in COMMON_SETTINGS.items():
        lines.append(f"  {section}")
        lines += [textwrap.fill(what, 80, initial_indent=f"    {option:35} ",
                                subsequent_indent=" " * 40) for option, what in settings]
    lines += [
        "",
        "options:",
        f"  {'-h, --help':37} this help",
        f"  {'--help-all':37} every setting, with its type and default (takes seconds)",
        f"  {'--print_config':37} print the merged config and exit",
    ]
    return "\n".join(lines)
