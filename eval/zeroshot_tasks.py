"""lm-eval tasks by name, from the Hub or from local files, with lm-eval's own definitions.

Without a data folder a task is lm-eval's stock task (its Hub dataset). With one, the task is
lm-eval's stock config (prompt, choices, target, metrics; read from lm-eval's own YAML at run
time, never copied) overlaid by ``eval/tasks/<task>.yaml``, which changes only where the data
comes from: ``dataset_path: json`` with ``data_files`` globbed inside the data folder, plus an
adapter where the local files do not have the Hub schema lm-eval's definition reads.

Local layout (``../shared/data/benchmarks`` has it): ``<dir>/<task>/*.jsonl``, and for PIQA its
labels file ``<dir>/piqa/*.lst``. The adapters map, record by record:

- ARC (original jsonl): ``question.stem`` / ``question.choices[]`` -> ``question`` and
  ``choices {text, label}``, as in ``allenai/ai2_arc``.
- OpenBookQA (MosaicML ICL ``query, choices, gold``) -> ``question_stem``,
  ``choices {text, label A-D}``, ``answerKey``, as in ``allenai/openbookqa``.
- WinoGrande (MosaicML ICL ``context_options[2], continuation, gold``) -> ``sentence, option1,
  option2, answer``: the options' common prefix plus ``_`` and the continuation. lm-eval's
  choices (``sentence[:blank] + option``) are then exactly the two context options and its
  target exactly the continuation, wherever the prefix is cut.
- PIQA (original ``goal, sol1, sol2`` jsonl and a labels file, one 0/1 per line) -> ``label``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sinklm.cli.main import UserError

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from lm_eval.tasks import TaskManager

# The paper's Table 4.
PAPER_TASKS = (
    "arc_easy", "arc_challenge", "hellaswag", "lambada_openai", "openbookqa", "piqa", "winogrande",
)
# Precisions a checkpoint is evaluated in.
LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# Keys of an overlay's dataset_kwargs whose values are {split: glob inside the data folder}.
FILE_KEYS = ("data_files", "labels_files")


class ZeroshotError(UserError, ValueError):
    """Bad input to a zero-shot run (task name, data folder, setting); the message says what
    to pass instead."""


@functools.cache
def task_manager() -> TaskManager:
    """lm-eval's task index (it scans every task YAML once: ~10 s, so it is shared)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def local_tasks() -> list[str]:
    """Tasks that run from local files (``--data-dir``)."""
    return sorted(path.stem for path in LOCAL_TASKS_DIR.glob("*.yaml"))


# A top-level task, group, tag or include line of a task YAML (the key may be quoted), and
# the "- item" lines of a block list after it.
_NAME_ENTRY = re.compile(
    r"""^(["']?)(task|group|tag|include)\1[ \t]*:([^\n]*)((?:\n[ \t]*-[^\n]*)*)""", re.M
)


def _scalar(text: str) -> str:
    return text.split(" #")[0].strip().strip("'\"")


def _entry_values(inline: str, block: str) -> list[str]:
    """The names one entry gives: ``key: a``, ``key: [a, b]`` or a block list. Items that are
    mappings (a group's inline task definitions) are skipped."""
    inline = inline.split(" #")[0].strip()
    if inline.startswith("["):
        items = inline.strip("[]").split(",")
    elif inline:
        items = [inline]
    else:
        items = [line.split("-", 1)[1] for line in block.splitlines() if line.strip()]
    return [name for name in map(_scalar, items) if name and ": " not in name]


@functools.cache
def _yaml_names(path: str) -> dict[str, list[str]]:
    """A task YAML's task, group and tag names, those of its includes where it sets none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except OSError:
        return {}
    own = {key: _entry_values(inline, block)
           for _, key, inline, block in _NAME_ENTRY.findall(text)}
    names: dict[str, list[str]] = {}
    for include in own.pop("include", []):
        names |= _yaml_names(os.path.normpath(os.path.join(os.path.dirname(path), include)))
    return names | own


@functools.cache
def lm_eval_task_names() -> frozenset[str]:
    """Every task, group and tag name lm-eval's own task YAMLs define, read as text without
    importing lm-eval: 0.5 s where its TaskManager takes ~10 s. A superset of the manager's
    names (a test checks it), so a name missing here is surely unknown to lm-eval."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    names: set[str] = set()
    root = os.path.join(next(iter(spec.submodule_search_locations)), "tasks")
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders
                         if name not in ("__pycache__", ".ipynb_checkpoints")]
        for file in files:
            if file.endswith(".yaml"):
                found = _yaml_names(os.path.join(folder, file))
                names.update(*(found.get(key, ()) for key in ("task", "group", "tag")))
    return frozenset(names)


def check_task_names(names: Sequence[str], known: Iterable[str]) -> None:
    """Refuse names lm-eval does not know, listing the closest ones it does."""
    known = list(known)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ZeroshotError(f"lm-eval has no task {name!r}{hint}")


def check_tasks(names: Sequence[str], data_dir: str | Path | None = None) -> None:
    """Refuse, without importing torch or lm-eval, task names lm-eval does not define, and with
    ``data_dir`` tasks without a local definition or without their files there."""
    check_task_names(names, sorted(lm_eval_task_names()))
    if data_dir is None:
        return
    for name in names:
        local_files(name, data_dir)


def task_specs(names: Sequence[str], data_dir: str | Path | None = None) -> list[str | dict]:
    """What ``lm_eval.simple_evaluate(tasks=...)`` takes: stock names, or local configs."""
    check_tasks(names, data_dir)
    manager = task_manager()
    check_task_names(names, manager.all_tasks)  # lm-eval's own word, for what text misread
    if data_dir is None:
        return list(names)
    return [local_task_config(name, manager, data_dir) for name in names]


class _OverlayLoader(yaml.SafeLoader):
    """Reads an overlay's ``!function`` references as their text: lm-eval resolves them."""


_OverlayLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def local_files(name: str, data_dir: str | Path) -> dict[str, dict[str, list[str]]]:
    """The files task ``name`` reads from ``data_dir``, by dataset_kwargs key and split."""
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise ZeroshotError(f"--data-dir {folder}: no such folder")
    if name not in local_tasks():
        raise ZeroshotError(
            f"no local definition for {name!r}: tasks that run from --data-dir are "
            f"{local_tasks()} (drop --data-dir to use the Hub datasets)"
        )
    overlay = (LOCAL_TASKS_DIR / f"{name}.yaml").read_text()
    kwargs = yaml.load(overlay, Loader=_OverlayLoader)["dataset_kwargs"]
    return {key: {split: _glob(folder, pattern, name) for split, pattern in kwargs[key].items()}
            for key in FILE_KEYS if key in kwargs}


def local_task_config(name: str, manager: TaskManager, data_dir: str | Path) -> dict[str, Any]:
    """lm-eval's config of ``name`` with its data read from ``data_dir`` (see module doc)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    stock_path = manager.task_index[name].yaml_path
    if stock_path is None:
        raise ZeroshotError(f"lm-eval's {name!r} has no YAML definition to run from local files")
    config = load_yaml(stock_path) | load_yaml(LOCAL_TASKS_DIR / f"{name}.yaml")
    config["dataset_kwargs"] = {**config["dataset_kwargs"], **local_files(name, data_dir)}
    return config


def _glob(data_dir: Path, pattern: str, task: str) -> list[str]:
    files = sorted(str(path.resolve()) for path in data_dir.glob(pattern) if path.is_file())
    if not files:
        raise ZeroshotError(
            f"--data-dir {data_dir} has no {pattern} (needed by {task}); expected the layout "
            "of ../shared/data/benchmarks: <dir>/<task>/*.jsonl"
        )
    return files


def data_source(config: dict[str, Any]) -> str:
    """The local files a task config reads, for the results file."""
    return ", ".join(f for files in config["dataset_kwargs"]["data_files"].values() for f in files)


def arc_docs(dataset: Dataset) -> Dataset:
    """Original ARC records in the Hub schema (``question`` text, ``choices {text, label}``)."""

    def reshape(doc: dict[str, Any]) -> dict[str, Any]:
        choices = doc["question"]["choices"]
        return {
            "question": doc["question"]["stem"],
            "choices": {
                "text": [c["text"] for c in choices],
                "label": [c["label"] for c in choices],
            },
        }

    return dataset.map(reshape)


def openbookqa_docs(dataset: Dataset) -> Dataset:
    """MosaicML OpenBookQA records in the Hub schema of ``allenai/openbookqa``."""

    def reshape(doc: dict[str, Any]) -> dict[str, Any]:
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        return {
            "question_stem": doc["query"],
            "choices": {"text": list(doc["choices"]), "label": labels},
            "answerKey": labels[doc["gold"]],
        }

    return dataset.map(reshape, remove_columns=["query", "gold"])


def winogrande_record(context_options: Sequence[str], continuation: str, gold: int) -> dict:
    """One MosaicML WinoGrande item as ``allenai/winogrande`` (see the module doc)."""
    if len(context_options) != 2:
        raise ZeroshotError(f"a WinoGrande item has 2 context options, not {len(context_options)}")
    first, second = context_options
    shorter = min(len(first), len(second))
    common = next((i for i in range(shorter) if first[i] != second[i]), shorter)
    prefix = first[:common]
    # Cut at a word boundary for readable options; lm-eval's choices come out the same anyway.
    prefix = prefix[: prefix.rfind(" ") + 1]
    if "_" in prefix:
        raise ZeroshotError(f"WinoGrande context {prefix!r} holds '_', which marks the blank")
    return {
        "sentence": f"{prefix}_ {continuation.strip()}",
        "option1": context_options[0][len(prefix):],
        "option2": context_options[1][len(prefix):],
        "answer": str(gold + 1),
    }


def winogrande_docs(dataset: Dataset) -> Dataset:
    """MosaicML WinoGrande records in the Hub schema of ``allenai/winogrande``."""
    return dataset.map(
        lambda doc: winogrande_record(doc["context_options"], doc["continuation"], doc["gold"]),
        remove_columns=["context_options", "continuation", "gold"],
    )


def piqa_dataset(
    data_files: dict[str, list[str]], labels_files: dict[str, list[str]], **_: Any
) -> DatasetDict:
    """Original PIQA (jsonl plus a labels file per split) with the Hub's ``label`` column.

    lm-eval calls a task's ``custom_dataset`` with the task metadata and dataset_kwargs; only
    the files matter here.
    """
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=data_files)
    for split, files in labels_files.items():
        labels = [int(line) for f in files for line in Path(f).read_text().split()]
        if len(labels) != len(dataset[split]):
            raise ZeroshotError(
                f"PIQA {split}: {len(labels)} labels in {files} for {len(dataset[split])} "
                f"questions in {data_files[split]}"
            )
        dataset[split] = dataset[split].add_column("label", labels)
    return dataset
