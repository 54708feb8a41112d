"""The ``sinklm`` console script: one entry point, a subcommand per job.

Each package owns its subcommands in its own ``cli.py`` with a ``register(subparsers)``
function; this module only collects them, so a user never needs to know module paths.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sinklm",
        description="Pretrain and evaluate Pythia-style models with attention sinks.",
        epilog="Run `sinklm COMMAND --help` for a command's options and an example.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        module, function = PASSTHROUGH[argv[0]].split(":")
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
