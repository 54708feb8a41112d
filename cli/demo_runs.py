"""The demo's training runs, shared by the sink lab and the natural-text part.

A run is ``sinklm fit`` of a config installed with sinklm (``configs/experiments/``) in its own
folder, which records the settings it was trained with: a rerun reuses a finished run, resumes
an interrupted one, and refuses a folder that holds a run of other settings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from sinklm.cli.main import UserError, bundled_file

VARIANTS = ("vanilla", "zero_sink", "sink_token")


class DemoError(UserError):
    """A demo step cannot run; the message says what to do."""


def say(message: str) -> None:
    print(f"sinklm demo: {message}", file=sys.stderr, flush=True)


def config_file(name: str) -> Path:
    """A config the demo runs, e.g. ``data/bigram_backcopy.yaml``, installed with sinklm."""
    path = bundled_file(f"configs/{name}")
    if not path.is_file():
        raise DemoError(f"{path} not found: this sinklm install lacks its configs; reinstall it")
    return path


def read_config(name: str) -> dict[str, Any]:
    return yaml.safe_load(config_file(name).read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(family: str, variant: str, run_dir: Path, packed: Path, meta: dict[str, Any],
          steps: int | None, fit_args: list[str], log: Callable[[str], None] = say,
          replace: bool = False) -> Path:
    """``sinklm fit`` of ``configs/experiments/FAMILY-VARIANT.yaml`` into ``run_dir``; resumed
    if interrupted, skipped if done; if ``run_dir`` holds a run of other settings, refused, or
    with ``replace`` deleted and trained anew."""

    from sinklm.models.checkpoint import global_step
    from sinklm.train.fit import newest_checkpoint, run_fit

    config_path = config_file(f"experiments/{family}-{variant}.yaml")
    config = yaml.safe_load(config_path.read_text())
    steps = steps or config["trainer"]["max_steps"]
    settings = {"config": _sha256(config_path), "steps": steps, "fit_args": fit_args,
                "tokenizer_hash": meta["tokenizer_hash"],
                "source_fingerprint": meta["source_fingerprint"]}
    record = run_dir / "demo.json"
    if record.is_file() and json.loads(record.read_text()) != settings and replace:
        log(f"{run_dir} holds a run of other settings: deleting it (--overwrite)")
        shutil.rmtree(run_dir)
    if record.is_file() and json.loads(record.read_text()) != settings:
        raise DemoError(f"{run_dir} holds a run with other settings (config, steps, fit "
                        "arguments or data): remove it or pass another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=2) + "\n")

    def trained() -> int:
        newest = newest_checkpoint(run_dir / "checkpoints", run_dir)
        if newest is None:
            return 0
        return global_step(newest)

    done = trained()
    if done == steps:
        log(f"reusing {run_dir}: {variant} trained for {steps} steps")
        return run_dir / "checkpoints" / "last.ckpt"
    log(f"training {family} {variant} for {steps} steps into {run_dir}"
        + (f" (resuming at step {done})" if done else ""))
    argv = [
        "--config", str(config_path),
        "--trainer.max_steps", str(steps),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.logger.init_args.save_dir", str(run_dir),
        "--data.path", str(packed),
        "--ckpt_path", "auto",
        *fit_args,
    ]
    try:
        code = run_fit(argv)
    except SystemExit as error:  # LightningCLI exits on a config it cannot parse
        code = error.code
    if code:
        raise DemoError(f"training {variant} failed (sinklm fit {' '.join(argv)})")
    if trained() != steps:
        raise DemoError(f"training {variant} ended without a checkpoint at step {steps}")
    return run_dir / "checkpoints" / "last.ckpt"
