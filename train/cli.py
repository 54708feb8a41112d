"""The ``sinklm`` console script: one entry point, a subcommand per job.

Each package owns its subcommands in its own ``cli.py``-like module with a
``register(subparsers)`` function; this module collects them, so a user never needs to know
module paths. ``main`` reports a command's ``CommandError`` (``data/errors.py``) as one line;
``bundled_file`` finds the configs and SLURM template installed with sinklm.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from importlib import resources
from pathlib import Path

from sinklm.data.errors import CommandError

# Packages whose cli.py registers subcommands, in the order --help lists them.
COMMAND_MODULES = (
    "sinklm.models.cli",
    "sinklm.data.cli",
    "sinklm.train.fit_cli",
    "sinklm.eval.cli",
    "sinklm.eval.hub_cli",
    "sinklm.eval.compare_cli",
    "sinklm.train.slurm",
    "sinklm.train.demo",
)
# Subcommands that parse their own arguments (LightningCLI): argv goes to them untouched.
PASSTHROUGH = {"fit": "sinklm.train.fit:run_fit"}


def bundled_file(path: str) -> Path:
    """``configs/...`` or ``slurm/...`` of the source tree, wherever sinklm is installed.

    pyproject installs those top-level folders as the packages ``sinklm.configs`` and
    ``sinklm.slurm``, so importlib finds them in a checkout (editable install) and in
    site-packages (a wheel) alike; ``Path(__file__).parents[1]`` finds only the checkout.
    """
    folder, _, name = path.partition("/")
    # pip unpacks wheels into folders, so a package's resource is a plain file with a path.
    return Path(str(resources.files(f"sinklm.{folder}").joinpath(name)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sinklm",
        description="Pretrain and evaluate Pythia-style models with attention sinks.",
        epilog="Run `sinklm COMMAND --help` for a command's options and an example.",
    )
    # Each command's epilog is a hand-laid example, printed as written.
    command_parser = functools.partial(argparse.ArgumentParser,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=command_parser)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a ``CommandError`` it raises becomes one line and the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        module, function = PASSTHROUGH[argv[0]].split(":")
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"sinklm {args.command}: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":
    sys.exit(main())
