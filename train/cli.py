"""The ``sinklm`` console script: one entry point, a subcommand per job.

Each package owns its subcommands in its own ``cli.py`` with a ``register(subparsers)``
function; this module only collects them, so a user never needs to know module paths.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Packages whose cli.py registers subcommands, in the order --help lists them.
COMMAND_MODULES = ("sinklm.models.cli",)


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
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
