"""Write configs/experiments/*.yaml: one full `sinklm fit` config per (size, variant).

    python configs/make_experiments.py            # rewrites the YAML files from the tables below
    python configs/make_experiments.py --check    # exit 1 if any file differs from them

Each YAML is complete on its own (no includes), so a run's config is readable in one place;
this script keeps the family consistent. tests/test_train_configs.py checks that the files
match it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).parent / "experiments"

# Pythia's recipe (Biderman et al. 2023) as the StreamingLLM paper used it for 160M: seq 2048,
# global batch 256, 143k steps, AdamW (0.9, 0.95, eps 1e-8), warmup 1%, cosine to 10%,
# clipping 1.0, bf16. Peak learning rates are Pythia's per size.
PYTHIA = {
    # preset: (peak lr, micro-batch per GPU, accumulation on 8 GPUs) -> 8 x micro x acc = 256
    "pythia-14m": (1.0e-3, 32, 1),
    "pythia-70m": (1.0e-3, 32, 1),
    "pythia-160m": (6.0e-4, 32, 1),
    "pythia-410m": (3.0e-4, 16, 2),
}
PAPER_VARIANTS = ("vanilla", "zero_sink", "sink_token")
NEW_VARIANTS = ("sink_logit", "gated", "two_sink_tokens")


def pythia_config(preset: str, variant: str) -> dict[str, Any]:
    lr, micro, accumulate = PYTHIA[preset]
    name = f"{preset}-{variant}"
    return {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "gpu",
            "devices": 8,
            "num_nodes": 1,
            "strategy": "ddp",
            "precision": "bf16-mixed",
            "max_steps": 143_000,
            "accumulate_grad_batches": accumulate,
            "gradient_clip_val": 1.0,
            "log_every_n_steps": 10,
            "val_check_interval": 1000,
            "limit_val_batches": 20,
            "check_val_every_n_epoch": None,
            "default_root_dir": f"runs/{name}",
            "logger": {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {"project": "sinklm", "name": name, "offline": True,
                              "save_dir": f"runs/{name}"},
            },
        },
        "model": {
            "preset": preset,
            "variant": variant,
            "backend": "sdpa",
            "optimizer": {"lr": lr, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1,
                          "warmup_fraction": 0.01, "min_lr_ratio": 0.1},
        },
        "data": {
            # Pythia's pre-tokenized, pre-shuffled deduplicated Pile (download
            # EleutherAI/pile-deduped-pythia-preshuffled and merge its shards, as the Pythia
            # README says): read in order, so step s sees the rows Pythia saw at step s.
            # Or pack the Pile yourself: `sinklm prepare-data --config
            # configs/data/pile_deduped.yaml` and set data.path: packed/pile_deduped instead.
            "megatron_path": "data/pile-deduped-pythia-preshuffled/document",
            "seq_len": 2048,
            "micro_batch_size": micro,
            "global_batch_size": 256,  # = micro x 8 GPUs x accumulate_grad_batches
            "num_workers": 4,
        },
        "checkpoint": {"every_n_train_steps": 1000},
        "sink_probe": {"every_n_steps": 500},
        "ckpt_path": "auto",
    }


def cpu_trainer(name: str, steps: int, val_every: int, val_batches: int) -> dict[str, Any]:
    """The trainer section of a CPU config: fp32, clipping 1.0, CSV logs in runs/NAME."""
    return {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "max_steps": steps,
        "gradient_clip_val": 1.0,
        "log_every_n_steps": 10,
        "val_check_interval": val_every,
        "limit_val_batches": val_batches,
        "check_val_every_n_epoch": None,
        "default_root_dir": f"runs/{name}",
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": f"runs/{name}", "name": "logs"},
        },
    }


def tiny_config(variant: str) -> dict[str, Any]:
    """tiny-5m on the local public-domain corpus: about 1.5 minutes per model on 2 CPU cores.

    Sized for ``sinklm demo``, whose sink lab runs first: three of these plus their evaluation
    take about 5.5 minutes at the ~3.7k tokens/s of 2 idle cores. 150 steps of 4 x 512 tokens
    (307k tokens) per model: far too few tokens for a first-token sink to form on natural text
    (the probes saw none at 3.7M-21.5M tokens); the demo shows the path and measures what these
    models do, whatever it is.
    """
    name = f"tiny-{variant}"
    return {
        "seed_everything": 1234,
        "trainer": cpu_trainer(name, steps=150, val_every=75, val_batches=8),
        "model": {
            "preset": "tiny-5m",
            "variant": variant,
            "backend": "sdpa",
            "optimizer": {"lr": 2.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8,
                          "weight_decay": 0.1, "warmup_fraction": 0.05, "min_lr_ratio": 0.1},
        },
        "data": {
            "path": "packed/english_pd_mix-bpe4k",
            "seq_len": 512,
            "micro_batch_size": 4,
            "num_workers": 0,
        },
        "checkpoint": {"every_n_train_steps": 75},
        "sink_probe": {"every_n_steps": 25},
        "ckpt_path": "auto",
    }


# The sink lab: Bigram-Backcopy (configs/data/bigram_backcopy.yaml) in a model small enough to
# form its sink in about half a minute on 2 CPU cores. Every variant that runs on it.
LAB_VARIANTS = ("vanilla", "zero_sink", "sink_token", "sink_logit", "gated", "two_sink_tokens")


def lab_config(variant: str) -> dict[str, Any]:
    """lab-1l (1 layer, 1 head, d 128, context 128) on Bigram-Backcopy: 300 steps of 64 x 128
    tokens (2.5M), lr 3e-3.

    The one departure from Pythia is ``use_parallel_residual: false`` (GPT-2's sequential
    block, which GPTNeoXConfig expresses, so the models still export as plain GPTNeoX). Measured
    in the sink lab (README): with Pythia's parallel block the sink-token model parks up to 0.99
    of its non-trigger attention on the sink id, yet window-only attention costs under 1%,
    because nothing but the unembedding reads the head's output; with the sequential block the
    MLP reads it, and dropping the sink raises perplexity 8-17x over three seeds.
    """
    name = f"bb-{variant}"
    return {
        "seed_everything": 1234,
        "trainer": cpu_trainer(name, steps=300, val_every=100, val_batches=4),
        "model": {
            "preset": "lab-1l",
            "variant": variant,
            "backend": "sdpa",
            "model_overrides": {"use_parallel_residual": False},
            "optimizer": {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8,
                          "weight_decay": 0.1, "warmup_fraction": 0.1, "min_lr_ratio": 0.1},
        },
        "data": {
            "path": "packed/bigram_backcopy",
            "seq_len": 128,
            "micro_batch_size": 64,
            "num_workers": 0,
        },
        "checkpoint": {"every_n_train_steps": 100},
        "sink_probe": {"every_n_steps": 25},
        "ckpt_path": "auto",
    }


LAB_SETUP = "Data first (once): sinklm prepare-data --config configs/data/bigram_backcopy.yaml"
DOCS_SETUP = ("Data first (once): sinklm prepare-data --config "
              "configs/data/bigram_backcopy_docs.yaml")
# The variants of the document-aligned lab: the paper's three rows.
DOCS_VARIANTS = PAPER_VARIANTS


def lab_docs_config(variant: str) -> dict[str, Any]:
    """The sink lab with document-aligned windows over documents of 127 tokens
    (configs/data/bigram_backcopy_docs.yaml): every training window is one document led by the
    end-of-document id that closed the one before, as in packed pretraining with separators
    and document-aligned windows. Vanilla then sees a fixed first token in every window, as
    the sink-token model sees its sink id, and comes to depend on it (the sweep's doc127-aligned
    setting, README). Evaluate with ``--eod-first``."""
    name = f"bb-docs-{variant}"
    config = lab_config(variant)
    config["trainer"] = cpu_trainer(name, steps=300, val_every=100, val_batches=4)
    config["data"] = {**config["data"], "path": "packed/bigram_backcopy_docs",
                      "windows": "documents"}
    return config


TINY_SETUP = (
    "Data first (once): sinklm train-tokenizer --source "
    "../shared/data/corpus/english_pd_mix.jsonl.gz --reflow --vocab-size 4088 --output "
    "tokenizers/english_pd_4k && sinklm prepare-data --config "
    "configs/data/local_corpus_bpe4k.yaml"
)


HEADER = """\
# {name}: {what}
# Written by configs/make_experiments.py; edit the script, not this file.
#   sinklm fit --config configs/experiments/{name}.yaml
# {batch}
"""


def render(name: str, config: dict[str, Any], what: str, batch: str) -> str:
    text = HEADER.format(name=name, what=what, batch=batch)
    return text + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def write(name: str, config: dict[str, Any], what: str, batch: str) -> None:
    (OUT / f"{name}.yaml").write_text(render(name, config, what, batch))


def experiments() -> dict[str, tuple[dict[str, Any], str, str]]:
    """Every experiment config: name -> (config, one-line description, batch note)."""
    found: dict[str, tuple[dict[str, Any], str, str]] = {}
    for preset, (_, micro, accumulate) in PYTHIA.items():
        variants = PAPER_VARIANTS + (NEW_VARIANTS if preset == "pythia-160m" else ())
        for variant in variants:
            batch = (f"Global batch 256 = micro-batch {micro} x 8 GPUs x {accumulate} "
                     "accumulation; `sinklm slurm-submit` derives micro-batch and accumulation "
                     "for other GPU counts (sinklm fit checks the product before training).")
            found[f"{preset}-{variant}"] = (
                pythia_config(preset, variant),
                f"{preset} {variant}, Pythia's recipe on the deduplicated Pile (StreamingLLM "
                "sec. 4.2 for 160m)",
                batch,
            )
    for variant in PAPER_VARIANTS:
        found[f"tiny-{variant}"] = (
            tiny_config(variant),
            f"tiny-5m {variant} on the local corpus, a few minutes on 2 CPU cores",
            TINY_SETUP,
        )
    for variant in LAB_VARIANTS:
        found[f"bb-{variant}"] = (
            lab_config(variant),
            f"lab-1l {variant} on Bigram-Backcopy (the sink lab), about a minute on 2 CPU cores",
            LAB_SETUP,
        )
    for variant in DOCS_VARIANTS:
        found[f"bb-docs-{variant}"] = (
            lab_docs_config(variant),
            f"lab-1l {variant} on Bigram-Backcopy, windows aligned to documents of 127 tokens "
            "(the sink lab's document-aligned rows), about a minute on 2 CPU cores",
            DOCS_SETUP,
        )
    return found


def stale() -> list[str]:
    """The YAML files in OUT that differ from the tables, are missing, or no table writes."""
    expected = {f"{name}.yaml": render(name, *entry) for name, entry in experiments().items()}
    shipped = {path.name: path.read_text() for path in OUT.glob("*.yaml")}
    return sorted(name for name in expected.keys() | shipped.keys()
                  if expected.get(name) != shipped.get(name))


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        description="Write one complete `sinklm fit` config per (size, variant) to "
        "configs/experiments/.",
        epilog="example: python configs/make_experiments.py --check",
    )
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and name the files that are out of date")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        if differ:
            print(f"{len(differ)} config(s) out of date in {OUT}: {', '.join(differ)}; run "
                  "`python configs/make_experiments.py` (and delete files no table writes)",
                  file=sys.stderr)
            return 1
        print(f"all {len(experiments())} configs in {OUT} are up to date")
        return 0
    OUT.mkdir(exist_ok=True)
    for name, (config, what, batch) in experiments().items():
        write(name, config, what, batch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
