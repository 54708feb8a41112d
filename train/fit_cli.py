"""How ``sinklm fit`` appears in ``sinklm --help``. ``sinklm.train.cli.main`` hands its
arguments to LightningCLI (``train/fit.py``) untouched, so this parser is never run."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "fit",
        help="train a model from a YAML config (LightningCLI)",
        description="Train with LightningCLI: `sinklm fit --config FILE [--section.key value]`. "
        "Sections: trainer, model, data, checkpoint, throughput, sink_probe; "
        "`sinklm fit --help` via LightningCLI lists every key. `--ckpt_path auto` resumes from "
        "the newest checkpoint (ModelCheckpoint's or SLURM's hpc one).",
        epilog="example: sinklm fit --config configs/experiments/tiny-sink_token.yaml "
        "--trainer.max_steps 200",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
