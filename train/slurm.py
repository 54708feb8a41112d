"""``sinklm slurm-submit``: render slurm/job.sbatch from a training config and submit it.

The job runs the same ``sinklm fit --config FILE`` a laptop runs, one task per GPU, with
SIGUSR1 90 s before the time limit so Lightning saves an hpc checkpoint and requeues.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template
from typing import Any

import yaml

from sinklm.models.config import ConfigError

from .batching import check_global_batch

# The template lives in the source tree's slurm/ folder (sinklm installs editable from it).
TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "job.sbatch"


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
) -> str:
    """The sbatch script for ``config`` on ``nodes`` x ``gpus_per_node`` GPUs.

    Refuses (ConfigError) a config whose global batch those GPUs cannot reach, before anything
    is submitted.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes={nodes} --gpus-per-node={gpus_per_node}: both must be >= 1")
    settings = yaml.safe_load(config.read_text()) or {}
    trainer: dict[str, Any] = settings.get("trainer") or {}
    data: dict[str, Any] = (settings.get("data") or {}).get("init_args", settings.get("data")) or {}
    if data.get("global_batch_size") is not None:
        check_global_batch(
            int(data["global_batch_size"]), int(data.get("micro_batch_size", 1)),
            devices=gpus_per_node, nodes=nodes,
            accumulate=int(trainer.get("accumulate_grad_batches", 1)),
        )
    root_dir = Path(trainer.get("default_root_dir") or f"runs/{config.stem}")
    directives = [f"#SBATCH --partition={partition}"] if partition else []
    if account:
        directives.append(f"#SBATCH --account={account}")
    sinklm = shutil.which("sinklm") or f"{sys.executable} -m sinklm.train.cli"
    return Template(TEMPLATE.read_text()).substitute(
        job_name=job_name or f"sinklm-{config.stem}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        time=time,
        log_dir=shlex.quote(str(root_dir / "slurm")),
        extra_directives="\n".join(directives),
        sinklm=sinklm,
        config=shlex.quote(str(config.resolve())),
        root_dir=shlex.quote(str(root_dir.resolve())),
        fit_args="".join(f" {shlex.quote(arg)}" for arg in fit_args or []),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "slurm-submit",
        help="render an sbatch script for a training config and submit it",
        description="Render slurm/job.sbatch for CONFIG on N nodes x G GPUs (one task per GPU, "
        "SIGUSR1 requeue) and submit it with sbatch, or print it with --dry-run.",
        epilog="example: sinklm slurm-submit --config configs/experiments/pythia-160m-sink_token"
        ".yaml --nodes 1 --gpus-per-node 8 --partition gpu --dry-run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, required=True, help="a `sinklm fit` YAML config")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")
    parser.add_argument("--cpus-per-task", type=int, default=8)
    parser.add_argument("--job-name")
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument(
        "fit_args", nargs=argparse.REMAINDER,
        help="after --: extra `sinklm fit` arguments, e.g. -- --trainer.max_steps=10",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.config.is_file():
        print(f"sinklm slurm-submit: config {args.config} does not exist", file=sys.stderr)
        return 2
    fit_args = [a for a in args.fit_args if a != "--"]
    try:
        script = render(
            args.config, args.nodes, args.gpus_per_node, partition=args.partition,
            account=args.account, time=args.time, cpus_per_task=args.cpus_per_task,
            job_name=args.job_name, fit_args=fit_args,
        )
    except (ConfigError, yaml.YAMLError, KeyError, ValueError) as error:
        print(f"sinklm slurm-submit: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script)
        return 0
    if shutil.which("sbatch") is None:
        print("sinklm slurm-submit: sbatch is not on PATH (not a SLURM login node?); "
              "use --dry-run to see the script", file=sys.stderr)
        return 2
    result = subprocess.run(["sbatch"], input=script, text=True, capture_output=True)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode
