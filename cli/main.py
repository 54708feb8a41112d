"""The ``sinklm`` console script: the subcommand table, ``main`` and the one error type.

Each module of ``cli/`` registers a group of subcommands (``register(subparsers)``); the table
below lists them, so a user never needs to know module paths. Every error a user can act on
derives from :class:`UserError`, wherever it is raised; ``main`` prints it as one line. This
module imports nothing of sinklm at import time, so every package may derive its errors from
``UserError`` and ``sinklm --help`` stays fast. ``bundled_file`` finds the configs and SLURM
template installed with sinklm.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from importlib import resources
from pathlib import Path


class UserError(Exception):
    """A refusal the user can act on: the message names the file, field or setting at fault and
    the fix. ``main`` prints ``sinklm COMMAND: message`` to stderr, with no traceback, and exits
    with ``code``: 2 for bad input, 1 where a service (the Hub, the network) failed."""

    code = 2

    def __init__(self, message: object, code: int | None = None) -> None:
        super().__init__(str(message))
        if code is not None:
            self.code = code


def check_at_least(*limits: tuple[str, int | None, int]) -> None:
    """Refuse a numeric flag below its floor; each limit is (flag, value or None, floor)."""
    for flag, value, low in limits:
        if value is not None and value < low:
            raise UserError(f"{flag} {value}: must be at least {low}")

# Packages whose cli.py registers subcommands, in the order --help lists them.
COMMAND_MODULES = (
    "sinklm.cli.info",
    "sinklm.cli.data",
    "sinklm.cli.fit",
    "sinklm.cli.evaluate",
    "sinklm.cli.hub",
    "sinklm.cli.compare",
    "sinklm.train.slurm",
    "sinklm.cli.demo",
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
    """Run one command; a ``UserError`` it raises becomes one line and the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        module, function = PASSTHROUGH[argv[0]].split(":")
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as error:
        print(f"sinklm {args.command}: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":
    sys.exit(main())
