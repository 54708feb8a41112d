"""The text that opens ``sinklm fit --help``.

``sinklm.cli.main.main`` hands fit's arguments to LightningCLI (``train/fit.py``) untouched;
LightningCLI shows this usage and description. They live with the command line, away from
torch and Lightning, as every other command's help does.
"""

from __future__ import annotations

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

