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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def check_task_names(names: Sequence[str], known: Iterable[str]) -> None:
    """Refuse names lm-eval does not know, listing the closest ones it does."""
    known = list(known)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ZeroshotError(f"lm-eval has no task {name!r}{hint}")


def task_specs(names: Sequence[str], data_dir: str | Path | None = None) -> list[str | dict]:
    """What ``lm_eval.simple_evaluate(tasks=...)`` takes: stock names, or local configs."""
    manager = task_manager()
    check_task_names(names, manager.all_tasks)
    if data_dir is None:
        return list(names)
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise ZeroshotError(f"--data-dir {folder}: no such folder")
    missing = [name for name in names if name not in local_tasks()]
    if missing:
        raise ZeroshotError(
            f"no local definition for {missing}: tasks that run from --data-dir are "
            f"{local_tasks()} (drop --data-dir to use the Hub datasets)"
        )
    return [local_task_config(name, manager, folder) for name in names]


def local_task_config(name: str, manager: TaskManager, data_dir: Path) -> dict[str, Any]:
    """lm-eval's config of ``name`` with its data read from ``data_dir`` (see module doc)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    stock_path = manager.task_index[name].yaml_path
    if stock_path is None:
        raise ZeroshotError(f"lm-eval's {name!r} has no YAML definition to run from local files")
    config = load_yaml(stock_path) | load_yaml(LOCAL_TASKS_DIR / f"{name}.yaml")
    kwargs = dict(config["dataset_kwargs"])
    for key in FILE_KEYS:
        if key in kwargs:
            kwargs[key] = {
                split: _glob(data_dir, pattern, name) for split, pattern in kwargs[key].items()
            }
    config["dataset_kwargs"] = kwargs
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
