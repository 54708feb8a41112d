"""A training config as a SLURM job: slurm/job.sbatch rendered for a cluster shape, submitted.

The job runs the same ``sinklm fit --config FILE`` a laptop runs, one task per GPU, with
SIGUSR1 90 s before the time limit so Lightning saves an hpc checkpoint and requeues. The
``sinklm fit`` arguments after ``--`` are applied before the global batch is checked, and the
gradient accumulation for the job's GPU count is derived from ``data.global_batch_size`` and
passed to ``sinklm fit`` explicitly, so one config submits unchanged on any cluster shape.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import yaml

from sinklm.cli.main import bundled_file
from sinklm.models.config import ConfigError

from .batching import check_global_batch, plan_batch

# `sinklm fit` settings the script depends on, read from the arguments after `--` as well.
OVERRIDDEN = ("data.micro_batch_size", "data.global_batch_size",
              "trainer.accumulate_grad_batches", "trainer.default_root_dir")
# Settings the job's shape fixes: given after `--`, they would contradict the SBATCH lines.
SHAPE = {"trainer.devices": "--gpus-per-node", "trainer.num_nodes": "--nodes"}


@dataclass(frozen=True)
class Job:
    """A rendered sbatch script, the folder its log goes to, and how its batch is made up."""

    script: str
    log_dir: Path
    batch: str | None  # None when the config sets no data.global_batch_size


def fit_overrides(fit_args: list[str]) -> dict[str, Any]:
    """The OVERRIDDEN keys set by ``--key=value`` or ``--key value`` among ``fit_args``, with
    values read as YAML (as LightningCLI reads them); the last one wins, as in ``sinklm fit``."""
    found: dict[str, Any] = {}
    for i, arg in enumerate(fit_args):
        key, sep, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in (*OVERRIDDEN, *SHAPE):
            continue
        if key in SHAPE:
            raise ConfigError(f"--{key} after --: the job's shape sets it; use {SHAPE[key]}")
        if not sep:
            if i + 1 == len(fit_args):
                raise ConfigError(f"--{key} after -- has no value")
            value = fit_args[i + 1]
        found[key] = yaml.safe_load(value)
    return found


def _integer(settings: dict[str, Any], key: str) -> int | None:
    value = settings.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}={value!r}: must be a whole number")


def render(
    config: Path,
    nodes: int,
    gpus_per_node: int,
    *,
    partition: str | None = None,
    account: str | None = None,
    time: str = "24:00:00",
    cpus_per_task: int = 8,
    job_name: str | None = None,
    fit_args: list[str] | None = None,
) -> Job:
    """The sbatch job for ``config`` (with ``fit_args`` applied) on ``nodes`` x
    ``gpus_per_node`` GPUs.

    With ``data.global_batch_size`` set, the micro-batch and accumulation that reach it on
    these GPUs are derived (``plan_batch``) unless ``--trainer.accumulate_grad_batches`` is
    given after ``--``, which is then checked as ``sinklm fit`` checks it. Refuses
    (ConfigError) what cannot reach the global batch, before anything is submitted.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes={nodes} --gpus-per-node={gpus_per_node}: both must be >= 1")
    fit_args = fit_args or []
    settings = yaml.safe_load(config.read_text()) or {}
    trainer: dict[str, Any] = settings.get("trainer") or {}
    data: dict[str, Any] = (settings.get("data") or {}).get("init_args", settings.get("data")) or {}
    overrides = fit_overrides(fit_args)
    merged = {
        **{f"data.{key}": value for key, value in data.items()},
        **{f"trainer.{key}": value for key, value in trainer.items()},
        **overrides,
    }
    world = nodes * gpus_per_node
    global_batch = _integer(merged, "data.global_batch_size")
    micro = _integer(merged, "data.micro_batch_size")
    explicit = _integer(overrides, "trainer.accumulate_grad_batches")
    batch_args, batch = "", None
    if global_batch is not None:
        if micro is None:
            raise ConfigError("data.global_batch_size is set but data.micro_batch_size is not: "
                              "set the sequences one GPU holds, in the config or after --")
        if explicit is not None:  # the user's own, already on the command line: check it
            check_global_batch(global_batch, micro, devices=gpus_per_node, nodes=nodes,
                               accumulate=explicit)
            planned, accumulate = micro, explicit
        else:
            planned, accumulate = plan_batch(global_batch, micro, world)
            if planned != micro and "data.micro_batch_size" in overrides:
                raise ConfigError(
                    f"--data.micro_batch_size={micro} after -- is more than each GPU's share of "
                    f"the global batch ({global_batch} / {world} GPUs); "
                    f"--data.micro_batch_size={planned} would"
                )
            batch_args = (f" --data.micro_batch_size={planned}"
                          f" --trainer.accumulate_grad_batches={accumulate}")
        batch = (f"global batch {global_batch} = micro-batch {planned} x {world} GPUs x "
                 f"{accumulate} accumulation")
        if planned != micro:
            batch += f" (micro-batch {micro} lowered to each GPU's share)"
    root_dir = Path(merged.get("trainer.default_root_dir") or f"runs/{config.stem}").resolve()
    log_dir = root_dir / "slurm"
    directives = [f"#SBATCH --partition={partition}"] if partition else []
    if account:
        directives.append(f"#SBATCH --account={account}")
    sinklm = shutil.which("sinklm") or f"{sys.executable} -m sinklm.cli.main"
    script = Template(bundled_file("slurm/job.sbatch").read_text()).substitute(
        job_name=job_name or f"sinklm-{config.stem}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        time=time,
        log_dir=shlex.quote(str(log_dir)),
        extra_directives="\n".join(directives),
        sinklm=sinklm,
        config=shlex.quote(str(config.resolve())),
        root_dir=shlex.quote(str(root_dir)),
        batch_args=batch_args,
        fit_args="".join(f" {shlex.quote(arg)}" for arg in fit_args),
    )
    return Job(script, log_dir, batch)


def submit(job: Job) -> subprocess.CompletedProcess[str]:
    """Hand ``job`` to ``sbatch``, its answer captured for the caller to show."""
    # SLURM opens --output before the job starts and does not create its folder: without it
    # the job fails with no log at all.
    job.log_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["sbatch"], input=job.script, text=True, capture_output=True)
