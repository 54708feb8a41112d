"""``sinklm slurm-submit``: a training config as a SLURM job, printed (``--dry-run``) or submitted.

``train/slurm.py`` renders the job and submits it; this module reads the flags and refuses,
before anything is rendered or submitted, what the job could not run: the config and the
``sinklm fit`` arguments after ``--`` get every check ``sinklm fit`` makes before it builds
anything (a typo would otherwise fail the job only after it waited in the queue).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from sinklm.cli.main import UserError
from sinklm.train.fit import check_fit_arguments
from sinklm.train.slurm import render, submit


def define_slurm_submit(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Render slurm/job.sbatch for CONFIG on N nodes x G GPUs (one task per GPU, "
        "SIGUSR1 requeue) and submit it with sbatch, or print it with --dry-run.")
    parser.epilog = (
        "example: sinklm slurm-submit --config configs/experiments/pythia-160m-sink_token"
        ".yaml --nodes 1 --gpus-per-node 8 --partition gpu --dry-run")
    parser.add_argument("--config", type=Path, required=True, help="a `sinklm fit` YAML config")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")
    parser.add_argument("--cpus-per-task", type=int, default=8)
    parser.add_argument("--job-name")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the script; submit and write nothing (not even the log "
                        "folder that a submission creates)")
    parser.add_argument(
        "fit_args", nargs=argparse.REMAINDER,
        help="after --: extra `sinklm fit` arguments, e.g. -- --trainer.max_steps=10",
    )
    parser.set_defaults(func=run_slurm_submit)
    _point_fit_arguments_after_dashes(parser)


def _point_fit_arguments_after_dashes(parser: argparse.ArgumentParser) -> None:
    """Refuse options this command does not know saying that ``sinklm fit``'s go after ``--``.

    argparse hands a command's unknown options to the top-level parser, whose error ("sinklm:
    error: unrecognized arguments") no command can add to, so they are caught here, where the
    command's parser returns them.
    """
    parse_known_args = parser.parse_known_args

    def with_hint(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list]:
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}; `sinklm fit` arguments "
                         f"go after --, e.g. sinklm slurm-submit --config FILE ... -- "
                         f"{' '.join(extras)}")
        return namespace, extras

    parser.parse_known_args = with_hint  # type: ignore[method-assign]


def run_slurm_submit(args: argparse.Namespace) -> int:
    if not args.config.is_file():
        raise UserError(f"config {args.config} does not exist")
    fit_args = [a for a in args.fit_args if a != "--"]
    check_fit_arguments(["--config", str(args.config), *fit_args])
    try:
        job = render(
            args.config, args.nodes, args.gpus_per_node, partition=args.partition,
            account=args.account, time=args.time, cpus_per_task=args.cpus_per_task,
            job_name=args.job_name, fit_args=fit_args,
        )
    except (yaml.YAMLError, KeyError, ValueError) as error:  # YAML that does not parse, too
        raise UserError(error) from None
    if job.batch:
        print(f"sinklm slurm-submit: {job.batch}", file=sys.stderr)
    if args.dry_run:
        print(job.script)
        return 0
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH (not a SLURM login node?); use --dry-run to "
                        "see the script")
    result = submit(job)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode
