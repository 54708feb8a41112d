"""``sinklm sweep``: sink-lab models trained over a grid of settings, compared in one table.

The question it answers (the sink lab's missing rows): under which settings does a model come to
depend on its first tokens, measured as StreamingLLM's Table 3 does it: window attention 0+W
against keeping one (1+(W-1)) or four (4+(W-4)) first tokens. A grid file
(``configs/sweeps/*.yaml``) names the settings; each is a set of changes to the lab's configs
(``configs/experiments/FAMILY-VARIANT.yaml`` and its data config) that a user could equally pass
to ``sinklm fit`` and ``sinklm prepare-data``. Every (setting, variant, seed) trains through the
demo's runner (reused when done, resumed when interrupted), every setting is evaluated by
``sinklm compare`` on its held-out split, and the rows go to one table
(``sweep_table.py``). A rerun with the same grid computes only what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sinklm.cli.main import UserError, bundled_file, check_at_least

WINDOWS = ("stream", "documents")
OPTIMIZER_KEYS = ("lr", "weight_decay", "warmup_fraction", "min_lr_ratio")
GRID_FILE = "grid.json"  # marks a sweep folder: the grid (and selection) its table is of


class SweepError(UserError):
    """A grid file or sweep folder that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: changes to the lab's fit and data configs.

    steps:      training steps (None: the config's).
    model:      ``model.model_overrides`` entries (n_layer, n_head, learned_positions, ...),
                merged over the config's own.
    optimizer:  ``model.optimizer`` entries (lr, weight_decay, warmup_fraction, min_lr_ratio).
    source:     the data config's ``source`` entries (doc_tokens, triggers, ...): another
                packed folder, shared by every setting with the same data.
    windows:    ``data.windows``: ``stream`` (a fixed grid, mid-document) or ``documents``
                (windows start at document starts, with the end-of-document id first); a
                ``documents`` setting streams its evaluation documents with that id first too.
    variants:   the variants this setting trains (None: the grid's), e.g. only vanilla where
                the question is vanilla's alone and runs are long.
    seeds:      its seeds (None: the grid's), e.g. one seed to screen a long setting.
    """

    name: str
    about: str = ""
    variants: tuple[str, ...] | None = None
    seeds: tuple[int, ...] | None = None
    steps: int | None = None
    model: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    windows: str = "stream"

    @property
    def eod_first(self) -> bool:
        return self.windows == "documents"


@dataclass(frozen=True)
class Grid:
    """A sweep: the lab's configs (``family``, ``data``), what to train, how to evaluate."""

    settings: tuple[Setting, ...]
    family: str = "bb"
    data: str = "data/bigram_backcopy.yaml"
    variants: tuple[str, ...] = ("vanilla", "zero_sink", "sink_token")
    seeds: tuple[int, ...] = (1234, 1, 2)
    window: int = 64  # W of the caches 0+W, 1+(W-1), 4+(W-4)
    max_tokens: int = 16384  # held-out tokens streamed per model

    def variants_of(self, setting: Setting) -> tuple[str, ...]:
        return setting.variants or self.variants

    def seeds_of(self, setting: Setting) -> tuple[int, ...]:
        return setting.seeds or self.seeds

    def caches(self) -> list[str]:
        return [f"{x}+{self.window - x}" for x in (0, 1, 4)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_grid(path: Path, only: list[str] | None = None, seeds: list[int] | None = None) -> Grid:
    """The grid file at ``path``, checked whole before anything runs; ``only`` keeps the named
    settings, ``seeds`` replaces the file's seeds (the grid's and every setting's)."""
    from sinklm.data.keys import reject_unknown_keys
    from sinklm.models.config import VARIANTS

    if not path.is_file():
        raise SweepError(f"--grid {path}: no such file (the lab's grid is "
                         "configs/sweeps/bb-first-token.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise SweepError(f"--grid {path}: not valid YAML ({error})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("settings"), list):
        raise SweepError(f"--grid {path}: expected a mapping with a list of settings")
    reject_unknown_keys(raw, Grid, f"keys in {path}", SweepError)
    settings = []
    for item in raw["settings"]:
        if not isinstance(item, dict) or "name" not in item:
            raise SweepError(f"--grid {path}: every setting needs a name; got {item!r}")
        reject_unknown_keys(item, Setting, f"keys of setting {item['name']!r}", SweepError)
        for key in ("variants", "seeds"):
            if item.get(key) is not None:
                item = {**item, key: tuple(item[key])}
        settings.append(Setting(**item))
    if seeds:
        settings = [Setting(**{**asdict(s), "seeds": None}) for s in settings]
    grid = Grid(**{**raw, "settings": tuple(settings),
                   "variants": tuple(raw.get("variants", Grid.variants)),
                   "seeds": tuple(seeds or raw.get("seeds", Grid.seeds))})
    names = [s.name for s in grid.settings]
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SweepError(f"--only {','.join(unknown)}: not in {path}; settings: {names}")
        grid = Grid(**{**asdict(grid), "settings": tuple(s for s in grid.settings
                                                          if s.name in only)})
    for key in ("window", "max_tokens"):
        value = getattr(grid, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise SweepError(f"--grid {path}: {key}={value!r}; give an integer >= 2")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SweepError(f"--grid {path}: setting names repeat: {repeated}")
    for name in names:
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise SweepError(f"setting {name!r}: use letters, digits, '-', '_' and '.' only "
                             "(it names folders)")
    for variants in (grid.variants, *(s.variants for s in grid.settings if s.variants)):
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown or not variants:
            raise SweepError(f"variants {list(variants)}: allowed {sorted(VARIANTS)}")
    for seeds in (grid.seeds, *(s.seeds for s in grid.settings if s.seeds is not None)):
        if not seeds or not all(isinstance(seed, int) for seed in seeds):
            raise SweepError(f"seeds {list(seeds)}: give one or more integers")
    base = {v: _fit_config(grid.family, v)
            for v in {*grid.variants, *(v for s in grid.settings for v in s.variants or ())}}
    for setting in grid.settings:
        _check_setting(setting, grid, base)
    return grid


def _check_setting(setting: Setting, grid: Grid, base: dict[str, dict[str, Any]]) -> None:
    """Everything a setting could get wrong, before the first run trains: its model is built
    by the function ``sinklm fit`` builds it with, its data spec parsed as prepare-data does."""
    from sinklm.data.synthetic import BigramBackcopySpec
    from sinklm.train.module import model_config

    where = f"setting {setting.name!r}"
    if setting.steps is not None and (not isinstance(setting.steps, int) or setting.steps < 1):
        raise SweepError(f"{where}: steps={setting.steps!r}; give an integer >= 1")
    if setting.windows not in WINDOWS:
        raise SweepError(f"{where}: windows={setting.windows!r}; allowed {list(WINDOWS)}")
    unknown = sorted(set(setting.optimizer) - set(OPTIMIZER_KEYS))
    if unknown:
        raise SweepError(f"{where}: optimizer keys {unknown}; allowed {list(OPTIMIZER_KEYS)}")
    data = _data_config(grid.data, setting)
    try:
        BigramBackcopySpec.from_dict(data["source"])
    except UserError as error:
        raise SweepError(f"{where}: source: {error}") from None
    for variant in grid.variants_of(setting):
        config = base[variant]
        model = config["model"]
        try:
            built = model_config(model["preset"], variant,
                                 model_overrides=_model_overrides(config, setting))
        except UserError as error:
            raise SweepError(f"{where}: model: {error}") from None
        if not 4 < grid.window < built.max_seq_len:
            raise SweepError(f"window {grid.window}: the caches need 4 < W < the trained "
                             f"context {built.max_seq_len}")


def _fit_config(family: str, variant: str) -> dict[str, Any]:
    path = bundled_file(f"configs/experiments/{family}-{variant}.yaml")
    if not path.is_file():
        raise SweepError(f"{path}: no such config; family {family!r} and variant {variant!r} "
                         "must name configs/experiments/FAMILY-VARIANT.yaml")
    return yaml.safe_load(path.read_text())


def _model_overrides(config: dict[str, Any], setting: Setting) -> dict[str, Any]:
    return {**(config["model"].get("model_overrides") or {}), **setting.model}


def _data_config(name: str, setting: Setting) -> dict[str, Any]:
    path = bundled_file(f"configs/{name}")
    if not path.is_file():
        raise SweepError(f"data config {path}: no such file")
    config = yaml.safe_load(path.read_text())
    return {**config, "source": {**config["source"], **setting.source}}


def fit_arguments(config: dict[str, Any], setting: Setting, seed: int) -> list[str]:
    """The ``sinklm fit`` arguments that turn the lab config into this setting's run."""
    args = ["--seed_everything", str(seed)]
    overrides = _model_overrides(config, setting)
    if overrides:
        args += ["--model.model_overrides", json.dumps(overrides, sort_keys=True)]
    for key, value in sorted(setting.optimizer.items()):
        args += [f"--model.optimizer.{key}", str(value)]
    if setting.windows != "stream":
        args += ["--data.windows", setting.windows]
    return args


def define_sweep(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train the sink lab's models over a grid of settings (configs/sweeps/*.yaml: layers "
        "and heads, steps, learning rate and weight decay, document-aligned windows, document "
        "length, trigger count, learned absolute positions) for each variant and seed, compare "
        "each setting's models on its held-out split with caches 0+W, 1+(W-1) and 4+(W-4), "
        "and write one table: DIR/sweep.md, sweep.json, sweep.csv (a row per run) and "
        "sweep.png. Runs and reports are reused on a rerun of the same grid.")
    parser.epilog = (
        "example: sinklm sweep --grid configs/sweeps/bb-first-token.yaml --output runs/bb-sweep\n"
        "         sinklm sweep --grid configs/sweeps/bb-first-token.yaml --only base,learned-pos "
        "--seeds 1234 --output runs/bb-sweep-screen")
    parser.add_argument("--grid", type=Path, required=True, metavar="FILE",
                        help="the grid (e.g. configs/sweeps/bb-first-token.yaml)")
    parser.add_argument("--output", type=Path, required=True, metavar="DIR",
                        help="runs, data, reports and the table go here")
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="run only these settings of the grid")
    parser.add_argument("--seeds", metavar="S[,S]", help="seeds instead of the grid's")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="train N runs at once, each on cores/N threads (small models use "
                        "two cores better as two runs than as one)")
    parser.add_argument("--overwrite", action="store_true",
                        help="use a folder made from another grid: runs whose settings changed "
                        "are deleted and retrained, reports replaced")
    parser.set_defaults(func=run_sweep)


def run_sweep(args: argparse.Namespace) -> int:
    check_at_least(("--jobs", args.jobs, 1))
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise SweepError(f"--seeds {args.seeds}: give comma-separated integers") from None
    grid = read_grid(args.grid, only, seeds)
    out = check_output(args.output, grid, args.overwrite)
    from sinklm.cli.sweep_table import write_table

    runs = [Run(setting, variant, seed) for setting in grid.settings
            for variant in grid.variants_of(setting) for seed in grid.seeds_of(setting)]
    data = {setting.name: _prepare(grid, setting, out) for setting in grid.settings}
    _train_all(runs, grid, data, out, args.jobs, args.overwrite)
    rows = []
    for setting in grid.settings:
        rows += _compare(grid, setting, [r for r in runs if r.setting is setting], data, out,
                         args.overwrite)
    files = write_table(rows, grid, out)
    print(Path(files["markdown"]).read_text())
    print(f"sweep: {', '.join(files.values())}", file=sys.stderr)
    return 0


def check_output(output: Path, grid: Grid, overwrite: bool) -> Path:
    """The sweep folder: new or empty, or made from this very grid (a rerun, which reuses every
    run and result); a folder of another grid (or selection) only with ``overwrite``, where
    unchanged runs and cached results are still reused."""
    from sinklm.cli.outputs import guard_writable, write_atomic

    if output.exists() and not output.is_dir():
        raise SweepError(f"--output {output}: exists and is not a folder")
    marker = output / GRID_FILE
    if not overwrite and output.is_dir() and any(output.iterdir()):
        if not marker.is_file():
            raise SweepError(f"--output {output}: holds files but no {GRID_FILE}, so it is not a "
                             "sweep folder; choose another or pass --overwrite (they stay)")
        if json.loads(marker.read_text()) != json.loads(json.dumps(grid.to_json())):
            raise SweepError(f"--output {output} holds a sweep of another grid or selection "
                             "(--only, --seeds): pass --overwrite to redo its table (unchanged "
                             "runs are reused, changed ones retrained), or choose another folder")
    guard_writable([output])
    output.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, json.dumps(grid.to_json(), indent=2) + "\n")
    return output


def _say(message: str) -> None:
    print(f"sinklm sweep: {message}", file=sys.stderr, flush=True)


def _prepare(grid: Grid, setting: Setting, out: Path) -> tuple[Path, dict[str, Any]]:
    """The setting's packed data, shared by every setting with the same source."""
    from sinklm.data import PrepareConfig, prepare_data
    from sinklm.data.errors import DataError

    config = _data_config(grid.data, setting)
    key = hashlib.sha256(json.dumps(config["source"], sort_keys=True).encode()).hexdigest()[:10]
    folder = out / "data" / key
    config["output"] = str(folder)
    try:
        meta = prepare_data(PrepareConfig.from_dict(config), log=None)
    except DataError as error:
        raise SweepError(f"setting {setting.name!r} data: {error}") from None
    return folder, meta


@dataclass(frozen=True)
class Run:
    """One model of the sweep: a setting's variant at a seed."""

    setting: Setting
    variant: str
    seed: int

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.setting.name / f"{self.variant}-seed{self.seed}"


def _train(run: Run, grid: Grid, packed: Path, meta: dict[str, Any], out: Path,
           overwrite: bool, threads: int | None = None) -> Path:
    """Train (or reuse) one run; ``threads`` caps torch's threads in a worker process."""
    from sinklm.cli.demo_runs import train

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    args = fit_arguments(_fit_config(grid.family, run.variant), run.setting, run.seed)
    try:
        return train(grid.family, run.variant, run.folder(out), packed, meta,
                     run.setting.steps, args, log=_say, replace=overwrite)
    except UserError as error:
        raise SweepError(f"setting {run.setting.name!r}, {run.variant} seed {run.seed}: "
                         f"{error}") from None


def _train_all(runs: list[Run], grid: Grid, data: dict[str, tuple[Path, dict[str, Any]]],
               out: Path, jobs: int, overwrite: bool) -> None:
    """Every run, ``jobs`` at a time (worker processes sharing the cores), in grid order."""
    if jobs == 1:
        for k, run in enumerate(runs, 1):
            _say(f"run {k}/{len(runs)}: {run.setting.name} {run.variant} seed {run.seed}")
            _train(run, grid, *data[run.setting.name], out, overwrite)
        return
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // jobs)
    _say(f"{len(runs)} runs, {jobs} at a time ({threads} thread(s) each)")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_train, run, grid, *data[run.setting.name], out, overwrite,
                               threads) for run in runs]
        for future in futures:
            future.result()  # the first failure stops the sweep with its message


def _compare(grid: Grid, setting: Setting, runs: list[Run],
             data: dict[str, tuple[Path, dict[str, Any]]], out: Path,
             overwrite: bool) -> list[dict[str, Any]]:
    """``sinklm compare`` of a setting's runs on its held-out split; their table rows."""
    from sinklm.cli.sweep_table import setting_rows
    from sinklm.eval.cache import parse_caches
    from sinklm.eval.compare import Settings, compare

    packed = data[setting.name][0]
    _say(f"{setting.name}: comparing {len(runs)} models on {packed}:validation")
    settings = Settings(texts=(), packed=f"{packed}:validation", max_tokens=grid.max_tokens,
                        caches=tuple(parse_caches(",".join(grid.caches()))),
                        eod_first=setting.eod_first)
    checkpoints = [str(run.folder(out) / "checkpoints" / "last.ckpt") for run in runs]
    try:
        report = compare(checkpoints, out / "compare" / setting.name, settings,
                         overwrite=overwrite)
    except UserError as error:
        raise SweepError(f"setting {setting.name!r} evaluation: {error}") from None
    document = json.loads(Path(report.files["json"]).read_text())
    described = [{"setting": run.setting.name, "variant": run.variant, "seed": run.seed,
                  "checkpoint": path} for run, path in zip(runs, checkpoints, strict=True)]
    return setting_rows(described, document, report.sinks, grid)
