"""The report of ``sinklm compare``: StreamingLLM's Table 3 (perplexity: a row per model, a
column per cache) and Table 4 (zero-shot acc / acc_norm: a row per model, a column per task),
the sink tables, as report.md, report.json and CSV, and the plots.
"""

from __future__ import annotations

import csv
import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinklm.cli.outputs import write_atomic

from .cache import CachePolicy
from .compare_cache import CACHE_DIR, SINK_EPS, SINK_WINDOW, SINK_WINDOWS, ModelCache, Text, slug
from .compare_tables import (
    model_findings,
    non_trigger_first,
    sinks_markdown,
    strongest_non_trigger,
    training_sinks_markdown,
    zeroshot_markdown,
)
from .plots import figure
from .report import markdown_table, plot_running_ppl
from .streaming import CacheResult

if TYPE_CHECKING:
    from .compare import Settings

KIND = "sinklm-compare"
# Everything compare writes in its output folder; anything else there is the user's.
REPORT_FILES = ("report.md", "report.json", "streaming.csv", "zeroshot.csv", "streaming.png",
                "sinks.png", "sinks_training.png")
REPORT_DIRS = ("running", CACHE_DIR)


@dataclass
class Report:
    """What a comparison wrote: the folder, its Markdown tables, the files, and how many
    results this run computed and how many it took from the cache of an earlier run."""

    output: Path
    streaming_table: str
    zeroshot_table: str | None
    sinks_table: str
    training_sinks_table: str | None  # when checkpoints carry the sink probe's record
    findings: list[str]  # measured sentences on what the streaming table shows
    files: dict[str, str]
    sinks: dict[str, dict[str, Any]]  # each model's whole sink measurement, by label
    computed: int
    reused: int

    def provenance(self) -> str:
        """One line saying which numbers were measured now."""
        if not self.reused:
            return f"all {self.computed} results measured in this run"
        return (f"{self.computed} results measured in this run, {self.reused} reused from the "
                f"cache of an earlier run ({self.output / CACHE_DIR})")


@dataclass(frozen=True)
class Measured:
    """What a report shows: the checkpoints compared, what they were measured on, and each
    model's results by label (streaming per cache, sinks, zero-shot per task)."""

    models: Sequence[ModelCache]
    labels: Sequence[str]
    settings: Settings
    caches: Sequence[CachePolicy]
    text: Text
    streams: dict[str, list[CacheResult]]
    sinks: dict[str, dict[str, Any]]
    zeroshot: dict[str, dict[str, dict[str, Any]]]

    @property
    def labelled(self) -> list[tuple[str, ModelCache]]:
        """(label, model) pairs, in the order the checkpoints were given."""
        return list(zip(self.labels, self.models, strict=True))

    @property
    def rows(self) -> dict[str, list[dict[str, Any]]]:
        """The streaming results as report.json rows, per model."""
        return {label: [r.to_json() for r in results] for label, results in self.streams.items()}

    @property
    def training(self) -> dict[str, list[dict[str, Any]]]:
        """The sink probe's record, for the models whose checkpoints carry one."""
        return {label: m.meta["training_sinks"] for label, m in self.labelled
                if m.meta["training_sinks"]}


def report_inputs(models: Sequence[ModelCache], settings: Settings, text: Text) -> dict[str, Any]:
    """What a report is made from: the checkpoints (their cache identities, in order), the text
    and every setting its numbers depend on. report.json records it, so a rerun into the same
    folder rewrites a report of the same inputs and refuses to replace one of others."""
    return {
        "checkpoints": [m.identity for m in models],
        "text": text,
        "caches": None if settings.caches is None else [p.label for p in settings.caches],
        "max_tokens": settings.max_tokens,
        "dtype": settings.dtype,
        "tasks": list(settings.tasks),
        "data_dir": str(settings.data_dir.resolve()) if settings.data_dir else None,
        "limit": settings.limit,
        "bootstrap_iters": settings.bootstrap_iters,
    }


def changed_inputs(out: Path, inputs: dict[str, Any]) -> list[str]:
    """Which of ``inputs`` differ from those of the report already in ``out`` (none there:
    nothing); a report.json without a record of its inputs (an earlier sinklm) is of others."""
    path = out / "report.json"
    if not path.is_file():
        return []
    try:
        earlier = json.loads(path.read_text()).get("inputs")
    except (json.JSONDecodeError, AttributeError):
        earlier = None
    if not isinstance(earlier, dict):
        earlier = {}
    fresh = json.loads(json.dumps(inputs))  # as report.json holds them: lists, not tuples
    return [key for key, value in fresh.items() if earlier.get(key) != value]


def text_names(text: Text) -> str:
    """The texts as a reader knows them: file names, or DIR:split (noting documents that keep
    the end-of-document id in front)."""
    return ", ".join(t["file"] if "file" in t else
                     f"{t['packed']}:{t['split']}"
                     + (" (each document led by its end-of-document id)" if t.get("eod_first")
                        else "")
                     for t in text)


def _plot_training_sinks(training: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Sink_1^eps and the strongest layer's attention to position 0 against training tokens."""
    # On Bigram-Backcopy the right panel shows what the mechanism predicts: the attention of
    # non-trigger queries to position 0, in the strongest head.
    triggers = all(strongest_non_trigger(h[-1]) is not None for h in training.values())
    with figure(path, tight=False, ncols=2, figsize=(11, 4)) as (fig, (rate, mass)):
        for label, history in training.items():
            tokens = [row["tokens"] for row in history]
            rate.plot(tokens, [row["sink_rate"] for row in history], marker="o", label=label)
            attention = [strongest_non_trigger(row) if triggers else max(row["first_mass"])
                         for row in history]
            mass.plot(tokens, attention, marker="o", label=label)
        # Log tokens: runs of very different lengths share the plot, and sinks form over decades.
        rate.set(xlabel="training tokens", ylabel=f"Sink_1^{SINK_EPS:g} (share of heads)",
                 xscale="log", ylim=(-0.02, 1.02), title="heads with a first-token sink")
        mass.set(xlabel="training tokens",
                 ylabel=("non-trigger attention to pos. 0" if triggers
                         else "attention to position 0 (strongest layer)"),
                 xscale="log", ylim=(0, 1), title="attention on the first token")
        for ax in (rate, mass):
            ax.grid(alpha=0.3)
        # One legend below both panels: many runs' labels would hide the curves.
        handles, labels = rate.get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=8, loc="lower center", ncols=2)
        fig.tight_layout(rect=(0, 0.06 * (1 + len(labels) // 2), 1, 1))


def _plot_streaming(streams: dict[str, list[CacheResult]], path: Path) -> None:
    """Perplexity per cache, a line per model."""
    labels = [r.policy.label for r in next(iter(streams.values()))]
    with figure(path, figsize=(max(6.0, 1.1 * len(labels)), 4)) as (_, ax):
        for label, results in streams.items():
            ax.plot(labels, [r.ppl for r in results], marker="o", label=label)
        ax.set(xlabel="KV cache (x initial + y recent tokens)", ylabel="perplexity",
               yscale="log", title="streaming perplexity per cache")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _plot_sinks(sinks: dict[str, dict[str, Any]], path: Path) -> None:
    """Each layer's mean attention to position 0, a line per model."""
    with figure(path, figsize=(6, 4)) as (_, ax):
        for label, report in sinks.items():
            mass = report["attention_to_first_per_layer"]
            ax.plot(range(len(mass)), mass, marker="o", label=label)
        ax.set_xticks(range(max(len(r["attention_to_first_per_layer"]) for r in sinks.values())))
        ax.set(xlabel="layer", ylabel="mean attention to position 0", ylim=(0, 1),
               title="attention on the first token (a sink id if the model has one)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)


def _remove_stale(path: Path) -> None:
    """Drop a report file an earlier run wrote and this one has nothing for."""
    if path.is_file():
        path.unlink()


def _write_streaming_csv(out: Path, measured: Measured) -> dict[str, str]:
    """Table 3's perplexities at full precision: a row per model, a column per cache."""
    _write_csv(out / "streaming.csv", ["model", *(p.label for p in measured.caches)],
               [[label, *(r["ppl"] for r in results)] for label, results in measured.rows.items()])
    return {"streaming_csv": str(out / "streaming.csv")}


def _write_zeroshot_csv(out: Path, measured: Measured) -> dict[str, str]:
    """A column per task and metric that some model has (acc_norm is not in every task)."""
    path = out / "zeroshot.csv"
    tasks, zeroshot = list(measured.settings.tasks), measured.zeroshot
    if not tasks:
        _remove_stale(path)
        return {}
    metrics = [(t, m) for t in tasks for m in ("acc", "acc_norm")
               if any(rows[t].get(m) is not None for rows in zeroshot.values())]
    _write_csv(path, ["model", *(f"{t}_{m}" for t, m in metrics)],
               [[label, *(zeroshot[label][t].get(m) for t, m in metrics)]
                for label in measured.labels])
    return {"zeroshot_csv": str(path)}


def _write_running_plots(folder: Path, streams: dict[str, list[CacheResult]]) -> dict[str, str]:
    """A running-perplexity plot per model; those of models no longer compared are removed."""
    folder.mkdir(exist_ok=True)
    written = set()
    for label, results in streams.items():
        name = f"{slug(label)}.png"
        plot_running_ppl(results, folder / name, label)
        written.add(name)
    for stale in folder.glob("*.png"):
        if stale.name not in written:
            stale.unlink()
    return {"running_plots": str(folder)}


def _write_plots(out: Path, measured: Measured) -> dict[str, str]:
    """Every plot of the report (the training one only when a checkpoint has a record)."""
    _plot_streaming(measured.streams, out / "streaming.png")
    files = {"streaming_plot": str(out / "streaming.png"),
             **_write_running_plots(out / "running", measured.streams)}
    _plot_sinks(measured.sinks, out / "sinks.png")
    files["sinks_plot"] = str(out / "sinks.png")
    training = measured.training
    if training:
        _plot_training_sinks(training, out / "sinks_training.png")
        files["training_sinks_plot"] = str(out / "sinks_training.png")
    else:
        _remove_stale(out / "sinks_training.png")
    return files


def _models_section(measured: Measured) -> list[str]:
    """What each model is, and how many tokens it was scored on."""
    return [
        "# sinklm compare",
        "",
        "| Model | checkpoint | softmax | sink tokens | context | params | tokens scored |",
        "|---|---|---|---:|---:|---:|---:|",
        *(f"| {label} | `{m.spec}` | {m.meta['softmax']} | {m.meta['sink_tokens']} | "
          f"{m.meta['max_seq_len']} | {m.meta['params']:,} | "
          f"{measured.streams[label][0].tokens:,} |"
          for label, m in measured.labelled),
    ]


def _streaming_section(report: Report, measured: Measured) -> list[str]:
    return [
        "## Streaming perplexity (StreamingLLM's Table 3 layout)",
        "",
        f"Text: {text_names(measured.text)}, tokenized by each model's tokenizer. "
        "Cache x+y keeps the first x tokens and the y most recent, "
        "positions re-assigned inside the cache; dense keeps everything.",
        "",
        report.streaming_table,
        "",
        *(f"- {sentence}" for sentence in report.findings),
        "",
        "![perplexity per cache](streaming.png)",
        "",
        "Running perplexity: " + ", ".join(f"[{label}](running/{slug(label)}.png)"
                                           for label in measured.streams),
    ]


def _sinks_section(report: Report) -> list[str]:
    return [
        "## Attention sinks",
        "",
        f"{SINK_WINDOWS} windows of min({SINK_WINDOW}, context) tokens of the same text, each "
        f"starting with the model's sink ids. Sink_1^{SINK_EPS:g}: share of heads whose mean "
        f"attention to position 0 exceeds {SINK_EPS:g}.",
        "",
        report.sinks_table,
        "",
        "![attention on the first token](sinks.png)",
    ]


def _training_section(table: str) -> list[str]:
    return ["## Sinks during training", "",
            "The sink probe of `sinklm fit` (a fixed validation batch every K steps), "
            "read from the checkpoints.", "", table, "",
            "![sinks against training tokens](sinks_training.png)"]


def _zeroshot_section(table: str, settings: Settings) -> list[str]:
    limit = f"the first {settings.limit} items" if settings.limit else "all items"
    source = f"local files in {settings.data_dir}" if settings.data_dir else "Hub datasets"
    return ["## Zero-shot (the paper's Table 4 layout)", "",
            f"acc / acc_norm in percent, {limit} of each task, {source}.", "", table]


def report_markdown(report: Report, measured: Measured) -> str:
    """report.md: the models, then a section per measurement (training and zero-shot only
    when there is something to show)."""
    sections = [_models_section(measured), _streaming_section(report, measured),
                _sinks_section(report)]
    if report.training_sinks_table is not None:
        sections.append(_training_section(report.training_sinks_table))
    if report.zeroshot_table is not None:
        sections.append(_zeroshot_section(report.zeroshot_table, measured.settings))
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def report_document(report: Report, measured: Measured) -> dict[str, Any]:
    """report.json: every number of the report, where each model's cached results are, and
    the files written."""
    settings, tasks = measured.settings, list(measured.settings.tasks)
    return {
        "kind": KIND,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "models": [
            {"label": label, "checkpoint": m.spec, "model": m.meta, "identity": m.identity,
             "cache": str(m.folder)}
            for label, m in measured.labelled
        ],
        "streaming": {"text": measured.text, "eod_first": settings.eod_first,
                      "max_tokens": settings.max_tokens,
                      "dtype": settings.dtype, "caches": [p.label for p in measured.caches],
                      "results": measured.rows, "findings": report.findings},
        "sinks": {label: {**{k: sinks[k] for k in ("window", "windows", "eps", "sink_rate",
                                                   "attention_to_first_per_layer")},
                          "non_trigger_first": non_trigger_first(sinks)}
                  for label, sinks in measured.sinks.items()},
        "training_sinks": measured.training,
        "zeroshot": None if not tasks else {
            "tasks": tasks, "limit": settings.limit,
            "data_dir": str(settings.data_dir) if settings.data_dir else None,
            "results": measured.zeroshot,
        },
        "results": {"computed": report.computed, "reused": report.reused},
        "files": report.files,
        "inputs": report_inputs(measured.models, settings, measured.text),
    }


def report_tables(out: Path, measured: Measured, computed: int, reused: int) -> Report:
    """The report's tables and findings, before any file is written."""
    tasks = list(measured.settings.tasks)
    context = {label: m.meta["max_seq_len"] for label, m in measured.labelled}
    training = measured.training
    return Report(
        output=out,
        streaming_table=markdown_table(list(measured.rows.items())),
        zeroshot_table=zeroshot_markdown(measured.zeroshot, tasks) if tasks else None,
        sinks_table=sinks_markdown(measured.sinks),
        training_sinks_table=training_sinks_markdown(training) if training else None,
        findings=model_findings(measured.streams, measured.sinks, context),
        files={}, sinks=measured.sinks, computed=computed, reused=reused,
    )


def write_report(out: Path, measured: Measured, computed: int, reused: int) -> Report:
    """report.md / report.json, the CSV tables and the plots; stale report files removed."""
    out.mkdir(parents=True, exist_ok=True)
    report = report_tables(out, measured, computed, reused)
    # In this order: report.json lists the files as they are added here.
    report.files.update(_write_streaming_csv(out, measured))
    report.files.update(_write_plots(out, measured))
    report.files.update(_write_zeroshot_csv(out, measured))
    report.files["markdown"] = str(out / "report.md")
    (out / "report.md").write_text(report_markdown(report, measured))
    report.files["json"] = str(out / "report.json")
    write_atomic(out / "report.json", json.dumps(report_document(report, measured), indent=2)
                 + "\n")
    return report
