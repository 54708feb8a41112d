"""How ``sinklm fit`` appears in ``sinklm --help``, and the text that opens ``sinklm fit --help``.

``sinklm.cli.main.main`` hands fit's arguments to LightningCLI (``train/fit.py``) untouched,
so the parser registered here is never run; it only lists the command. The usage and
description live here, without torch or Lightning imports, and LightningCLI shows the same.
"""

from __future__ import annotations

import argparse

USAGE = "sinklm fit --config FILE [--SECTION.KEY VALUE ...] [--ckpt_path auto|PATH]"
DESCRIPTION = """\
Train a model from a YAML config (LightningCLI). Every key listed below can be
set in the YAML or as --SECTION.KEY VALUE, which wins over the file. Sections:
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


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "fit",
        help="train a model from a YAML config (LightningCLI)",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
