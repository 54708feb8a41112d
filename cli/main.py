"""The ``sinklm`` console script: the subcommand table, ``main`` and the one error type.

``COMMANDS`` lists every subcommand, so a user never needs to know module paths. Every error a
user can act on derives from :class:`UserError`, wherever it is raised; a command raises it and
``main`` prints it as one line. This module imports nothing of sinklm at import time, so every
package may derive its errors from ``UserError`` and ``sinklm --help`` stays fast.
``bundled_file`` finds the configs and SLURM template installed with sinklm.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


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


@dataclass(frozen=True)
class Command:
    """One subcommand as ``sinklm --help`` lists it.

    ``target`` is ``module:function``, imported only when needed: the function that fills in the
    command's parser (description, example, arguments, and ``func``, which runs it), or, for a
    ``passthrough`` command, the one that parses its own arguments and runs (fit: LightningCLI).
    ``main`` hands the latter argv untouched; its bare parser exists only so that ``--help`` and
    argparse's "invalid choice" message list it.
    """

    name: str
    target: str
    help: str
    passthrough: bool = False

    def function(self) -> Callable[..., Any]:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


# Every subcommand, in the order --help lists them.
COMMANDS = (
    Command("info", "sinklm.cli.info:define_info",
            "print a model preset's parameter count and config as JSON"),
    Command("prepare-data", "sinklm.cli.data:define_prepare_data",
            "tokenize a corpus into packed token shards (reused when inputs are unchanged)"),
    Command("train-tokenizer", "sinklm.cli.data:define_train_tokenizer",
            "train a byte-level BPE tokenizer (GPT-NeoX style) on a corpus"),
    Command("fit", "sinklm.train.fit:run_fit",
            "train a model from a YAML config (LightningCLI)", passthrough=True),
    Command("stream-eval", "sinklm.cli.evaluate:define_stream_eval",
            "streaming perplexity with StreamingLLM KV caches (x initial + y recent tokens)"),
    Command("generate", "sinklm.cli.generate:define_generate",
            "generate text past the trained context through a start+recent KV cache"),
    Command("sinks", "sinklm.cli.evaluate:define_sinks",
            "attention-sink diagnostics: attention on the first positions per layer and head"),
    Command("export", "sinklm.cli.hub:define_export",
            "write a checkpoint as a Hugging Face folder (and push it to the Hub)"),
    Command("zeroshot", "sinklm.cli.hub:define_zeroshot",
            "zero-shot benchmarks through lm-eval, sink ids in front of every request"),
    Command("compare", "sinklm.cli.compare:define_compare",
            "compare checkpoints: streaming perplexity, sinks and zero-shot in one report"),
    Command("sweep", "sinklm.cli.sweep:define_sweep",
            "train sink-lab models over a grid of settings and tabulate first-token dependence"),
    Command("slurm-submit", "sinklm.cli.slurm:define_slurm_submit",
            "render an sbatch script for a training config and submit it"),
    Command("demo", "sinklm.cli.demo:define_demo",
            "the whole path on a CPU: the sink lab, then three tiny models on natural text"),
)


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
    parser_class = functools.partial(argparse.ArgumentParser,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=parser_class)
    for command in COMMANDS:
        command_parser = subparsers.add_parser(command.name, help=command.help)
        if not command.passthrough:
            command.function()(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a ``UserError`` it raises becomes one line and the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    passthrough = {command.name: command for command in COMMANDS if command.passthrough}
    if argv and argv[0] in passthrough:
        return int(passthrough[argv[0]].function()(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as error:
        print(f"sinklm {args.command}: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":
    sys.exit(main())
