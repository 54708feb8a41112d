"""``sinklm fit --config FILE [--section.key value ...]``: training from a YAML config through
LightningCLI (``train/fit_cli.py``).

This module imports neither torch nor Lightning, which take seconds to load: ``--help`` and the
checks that need no model answer at once. Those checks: each ``--config`` is a YAML file of
settings by section; every setting the files and the command line name exists (with "did you
mean"), its section's names read from the source of the class that takes them, Lightning's
included, without importing it; ``model.preset`` and ``model.variant`` are known names;
``trainer.max_steps`` is positive; ``trainer.default_root_dir`` can be written. LightningCLI
then parses everything again, types and all, and refuses what is left before any compute.
Every refusal is one line and exit code 2.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from sinklm.cli.fit import help_text
from sinklm.cli.main import UserError
from sinklm.cli.outputs import guard_writable
from sinklm.models.config import PRESETS, VARIANTS, ConfigError, ModelConfig

# LightningCLI options (removed here) that would replace the recipe's optimizer and schedule.
LIGHTNING_OPTIMIZER_OPTIONS = ("optimizer", "lr_scheduler")
# The settings of each section: the keywords of a class, as (package, file in it, class).
SECTIONS = {
    "trainer": ("lightning", "pytorch/trainer/trainer.py", "Trainer"),
    "model": ("sinklm.train", "module.py", "SinkLMModule"),
    "model.optimizer": ("sinklm.train", "module.py", "OptimizerConfig"),
    "data": ("sinklm.train", "data_module.py", "SinkLMDataModule"),
    # StepCheckpoint takes ModelCheckpoint's keywords.
    "checkpoint": ("lightning", "pytorch/callbacks/model_checkpoint.py", "ModelCheckpoint"),
    "throughput": ("sinklm.train", "callbacks.py", "Throughput"),
    "sink_probe": ("sinklm.train", "callbacks.py", "SinkProbe"),
}
# Trainer.fit's parameters become top-level settings, less those LightningCLI fills itself.
FIT_FILLED = ("model", "train_dataloaders", "val_dataloaders", "datamodule")


def newest_checkpoint(checkpoint_dir: Path, root_dir: Path) -> Path | None:
    """The most recently completed checkpoint: ModelCheckpoint's files or SLURM hpc ones.

    Lightning's own ``ckpt_path="last"`` ignores hpc checkpoints, and its hpc rule ignores
    ``last``; after a preemption either may be newer, so we take the newest by completion
    time (saves are atomic: a file appears only once fully written).
    """
    candidates = [*checkpoint_dir.glob("*.ckpt"), *root_dir.glob("hpc_ckpt_*.ckpt")]
    return max(candidates, key=lambda p: p.stat().st_mtime_ns, default=None)


def check_max_steps(max_steps: object) -> None:
    """Refuse a max_steps the schedule cannot use (the Trainer would end a negative one in a
    traceback)."""
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ConfigError(
            f"trainer.max_steps={max_steps}: must be a positive number of optimizer steps "
            "(the warmup + cosine schedule is defined over it), e.g. --trainer.max_steps 1000"
        )


def _class_parameters(class_path: str) -> list[str]:
    """The keyword names a ``class_path`` accepts, for "did you mean" (none if not importable)."""
    module, _, name = class_path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
        if dataclasses.is_dataclass(target):
            return [field.name for field in dataclasses.fields(target)]
        return list(inspect.signature(target).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def _closest(word: str, choices: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _unknown_key(key: str, known: list[str]) -> str:
    """``key`` named where it first leaves the known settings, with the closest known one."""
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        level = sorted({".".join(k.split(".")[:depth]) for k in known
                        if k.split(".")[: depth - 1] == parts[: depth - 1]})
        if prefix not in level:
            break
    if prefix in LIGHTNING_OPTIMIZER_OPTIONS:
        return (f"{prefix}: not a setting of sinklm fit; the recipe's AdamW and warmup + cosine "
                "schedule are set under model.optimizer (e.g. --model.optimizer.lr 3e-4)")
    guess = _closest(prefix, level)
    hint = f"did you mean {guess}? " if guess else ""
    return f"{prefix}: no such setting; {hint}(`sinklm fit --help-all` lists every setting)"


def argument_error_line(message: str, known: list[str]) -> str:
    """jsonargparse's (often multi-line) parse error as one line, with a "did you mean"."""
    patterns = (r"does not accept option '([^']+)'", r"unrecognized arguments: --?([^\s=]+)")
    for pattern in patterns:
        if match := re.search(pattern, message):
            return _unknown_key(match.group(1), known)
    key = re.search(r'Parser key "([^"]+)"', message)
    option = re.search(r"class_path '([^']+)':\s+Option '([^']+)' is not accepted", message)
    if key and option:
        choices = _class_parameters(option.group(1))
        guess = _closest(option.group(2), choices)
        hint = f"did you mean {key.group(1)}.{guess}? " if guess else ""
        return (f"{key.group(1)}.{option.group(2)}: no such setting of {option.group(1)}; "
                f"{hint}(`sinklm fit --help-all` lists every setting)")
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return re.sub(r'^Parser key "([^"]+)":', r"\1:", line)


@functools.cache
def _classes(path: Path) -> dict[str, ast.ClassDef]:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def source_parameters(package: str, file: str, class_name: str,
                      method: str = "__init__") -> list[str] | None:
    """The keyword names of ``class_name.method`` (or, without one, a dataclass's fields) as
    written in ``file`` of ``package``, which is not imported. None where the source does not
    say for sure (no such file, class or method; ``**kwargs``): nothing is refused on a guess."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    node = _classes(Path(next(iter(spec.submodule_search_locations))) / file).get(class_name)
    if node is None:
        return None
    function = next((item for item in node.body if isinstance(item, ast.FunctionDef)
                     and item.name == method), None)
    if function is None:
        fields = [item.target.id for item in node.body
                  if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
        return fields if method == "__init__" and fields else None
    args = function.args
    if args.vararg or args.kwarg:
        return None
    return [arg.arg for arg in [*args.posonlyargs, *args.args][1:] + args.kwonlyargs]


@functools.cache
def known_settings() -> dict[str, list[str]]:
    """The names each level of the fit parser takes: "" (the top) and every section whose
    names are sure (see ``source_parameters``), e.g. ``model.optimizer``."""
    fit = source_parameters(*SECTIONS["trainer"], method="fit")
    known = {
        "model.model_overrides": [field.name for field in dataclasses.fields(ModelConfig)],
        **{section: names for section, source in SECTIONS.items()
           if (names := source_parameters(*source)) is not None},
    }
    if fit is not None:
        top = ["config", "print_config", "seed_everything",
               *(section for section in SECTIONS if "." not in section),
               *(name for name in fit if name not in FIT_FILLED)]
        known[""] = top
    return known


def _check_names(settings: dict[Any, Any], prefix: str = "") -> None:
    """Refuse a name ``settings`` holds at a level whose names are known."""
    known = known_settings()
    names = known.get(prefix)
    # class_path/init_args: a class chosen by name, its keywords not known here.
    if names is None or {"class_path", "init_args"} & set(settings):
        return
    for key, value in settings.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            flat = [f"{level}.{child}" if level else child
                    for level, children in known.items() for child in children]
            raise ConfigError(_unknown_key(name, flat))
        if isinstance(value, dict):
            _check_names(value, name)


def _config_file(value: str) -> dict[Any, Any]:
    """What ``--config VALUE`` sets: a YAML file's settings (or, as jsonargparse takes it too,
    settings written inline)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as file:
                settings = yaml.safe_load(file)
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            problem = " ".join(str(error).split())
            raise ConfigError(f"--config {value}: not valid YAML ({problem}); fix the file, or "
                              "write a fresh one with `sinklm fit --print_config`") from None
    else:
        try:
            settings = yaml.safe_load(value)
        except yaml.YAMLError:
            settings = None
        if not isinstance(settings, dict):
            raise ConfigError(f"--config {value}: no such file; give a `sinklm fit` YAML "
                              "config, e.g. configs/experiments/tiny-sink_token.yaml")
    if not isinstance(settings, dict | None):
        raise ConfigError(f"--config {value}: holds a YAML {type(settings).__name__}, not "
                          "settings by section (trainer:, model:, data:, ...)")
    return settings or {}


def _given_settings(argv: list[str]) -> list[dict[Any, Any]]:
    """What each ``--config FILE`` and ``--section.key value`` of ``argv`` sets, in order, as
    nested mappings (``--a.b 1`` is ``{a: {b: 1}}``); values read as YAML, as LightningCLI does."""
    found = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            continue  # not a setting: LightningCLI says what it is
        key, sep, text = arg.lstrip("-").partition("=")
        key = "config" if key == "c" else key.rstrip("+")  # --a+=b appends to a list
        value: str | None = text
        if not sep:
            value = rest.pop(0) if rest and not rest[0].startswith("--") else None
        if key == "config":
            if value is not None:  # else LightningCLI says what is missing
                found.append(_config_file(value))
            continue
        try:
            setting: Any = None if value is None else yaml.safe_load(value)
        except yaml.YAMLError:
            setting = value
        for part in reversed(key.split(".")):
            setting = {part: setting}
        found.append(setting)
    return found


def _merged(base: dict[Any, Any], update: dict[Any, Any]) -> dict[Any, Any]:
    merged = dict(base)
    for key, value in update.items():
        old = merged.get(key)
        both = isinstance(value, dict) and isinstance(old, dict)
        merged[key] = _merged(old, value) if both else value
    return merged


def _check_choice(key: str, value: object, allowed: Iterable[str]) -> None:
    allowed = sorted(allowed)
    if value is None or value in allowed:
        return
    guess = _closest(str(value), allowed)
    hint = f"did you mean {guess}? " if guess else ""
    raise ConfigError(f"{key}={value!r}: no such {key.rpartition('.')[2]}; {hint}"
                      f"known: {', '.join(allowed)}")


def early_checks(argv: list[str]) -> None:
    """The checks on ``sinklm fit``'s arguments that need neither a model nor Lightning
    (see the module doc); a refusal raises a UserError naming the setting."""
    settings: dict[Any, Any] = {}
    for given in _given_settings(argv):
        _check_names(given)
        settings = _merged(settings, given)
    model = settings.get("model")
    if isinstance(model, dict):
        _check_choice("model.preset", model.get("preset"), PRESETS)
        _check_choice("model.variant", model.get("variant"), VARIANTS)
    trainer = settings.get("trainer")
    trainer = trainer if isinstance(trainer, dict) else {}
    steps = trainer.get("max_steps", 1)
    if steps is None or type(steps) is int:  # any other type: LightningCLI names it
        check_max_steps(steps)
    root = trainer.get("default_root_dir")  # Lightning's default: the working folder
    guard_writable([Path(root if isinstance(root, str) else os.getcwd())],
                   "--trainer.default_root_dir")


def check_fit_arguments(argv: list[str]) -> None:
    """Every check ``sinklm fit`` makes on ``argv`` before it builds anything (``slurm-submit``
    runs them before a job waits in the queue); a refusal raises a UserError."""
    early_checks(argv)
    from .fit_cli import parse_only

    parse_only(argv)


def run_fit(argv: list[str]) -> int:
    """``sinklm fit``: its help, the early checks, then LightningCLI (``--help-all``: its help,
    every setting)."""
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)  # as every command's --help (argparse's) ends
    try:
        if "--help-all" not in argv:
            early_checks(argv)
        from .fit_cli import run

        run(["--help" if arg == "--help-all" else arg for arg in argv])
    except UserError as error:
        print(f"sinklm fit: {error}", file=sys.stderr)
        return error.code
    return 0
