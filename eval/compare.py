"""Several checkpoints side by side in one report (``sinklm compare``), with cached results.

For each checkpoint: streaming perplexity under each KV cache (``streaming.evaluate``), where
attention goes (``sinks.measure_sinks``) and, when tasks are named, lm-eval zero-shot scores
(``zeroshot.evaluate``). The report holds StreamingLLM's Table 3 (perplexity: a row per model,
a column per cache) and Table 4 (zero-shot acc / acc_norm: a row per model, a column per task)
as Markdown, CSV and JSON, and plots.

Results are cached in ``DIR/cache/<checkpoint>/``, one file per (checkpoint identity, setting):
a checkpoint is identified by its resolved path and the size and modification time of its
weight, config and tokenizer files (a Hub id by the id), a text by its contents. A retrained
checkpoint is therefore evaluated anew, and a rerun with another cache or task computes only
what is missing.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sinklm.cli.main import UserError
from sinklm.cli.outputs import write_atomic
from sinklm.models.load import DTYPES, HUB_ID, Checkpoint, CheckpointError, load_checkpoint

from .cache import CachePolicy, CacheSpecError, Dense, StartRecent, check_policies, paper_caches
from .plots import figure
from .report import format_ppl, markdown_table, plot_running_ppl
from .sinks import measure_text
from .streaming import CacheResult, evaluate
from .texts import (
    Stream,
    check_files,
    check_packed,
    encode_streams,
    packed_streams,
    read_files,
    split_packed_spec,
)

KIND = "sinklm-compare"
# Everything compare writes in its output folder; anything else there is the user's.
REPORT_FILES = ("report.md", "report.json", "streaming.csv", "zeroshot.csv", "streaming.png",
                "sinks.png", "sinks_training.png")
REPORT_DIRS = ("running", "cache")
# The files of a checkpoint folder that make the model (results files beside it do not).
MODEL_FILES = ("config.json", "tokenizer.json", "*.safetensors", "*.safetensors.index.json",
               "*.bin", "*.bin.index.json", "*.py")
# Sink diagnostics: as `sinklm sinks` by default (windows of min(512, context) tokens).
SINK_WINDOW = 512
SINK_WINDOWS = 4
SINK_FIRST = 4
SINK_EPS = 0.3
# 0+W at least this many times 1+(W-1): the report says the model depends on its first token.
DEPENDENCE_RATIO = 1.1
# What a cached model description holds: its fields and the sink probe's training record.
MODEL_SETTING = {"fields": ["describe", "sink_token_ids", "training_sinks"]}


class CompareError(UserError, ValueError):
    """Bad input to a comparison (output folder, repeated checkpoint); the message says why."""


@dataclass(frozen=True)
class Settings:
    """What a comparison measures: streams of ``texts`` (files) or of a ``packed`` split.
    ``caches`` None: the paper's grid for half the shortest trained context of the
    checkpoints; ``tasks`` empty: no zero-shot."""

    texts: tuple[Path, ...]
    caches: tuple[CachePolicy, ...] | None = None
    packed: str | None = None  # DIR[:split] of packed token ids, instead of texts
    max_tokens: int | None = None
    tasks: tuple[str, ...] = ()
    data_dir: Path | None = None
    limit: int | None = None
    batch_size: int = 16
    bootstrap_iters: int = 100_000
    device: str = "cpu"
    dtype: str = "float32"


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
    computed: int
    reused: int

    def provenance(self) -> str:
        """One line saying which numbers were measured now."""
        if not self.reused:
            return f"all {self.computed} results measured in this run"
        return (f"{self.computed} results measured in this run, {self.reused} reused from the "
                f"cache of an earlier run ({self.output / 'cache'})")


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_identity(spec: str) -> dict[str, Any]:
    """What a checkpoint's results are keyed by: its path and the size and mtime of its model
    files (reading gigabytes to hash them would cost more than some evaluations)."""
    path = Path(spec).expanduser()
    if path.is_file():
        files, root = [path], path.parent
    elif path.is_dir():
        root = path
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and any(fnmatch(p.name, pattern) for pattern in MODEL_FILES))
    elif HUB_ID.fullmatch(spec):
        return {"hub": spec}
    else:
        raise CheckpointError(f"{spec}: no such file or folder, and not a Hub id like org/name")
    stats = [(p.relative_to(root).as_posix(), p.stat()) for p in files]
    return {"path": str(path.resolve()),
            "files": [[name, s.st_size, s.st_mtime_ns] for name, s in stats]}


def text_identity(settings: Settings) -> list[dict[str, str]]:
    """Each text by name and content hash (a moved copy of a book keeps its results), or the
    packed split by its source fingerprint and tokenizer."""
    if settings.packed is not None:
        meta = check_packed(settings.packed)
        folder, split = split_packed_spec(settings.packed)
        return [{"packed": folder.name, "split": split, "source": meta["source_fingerprint"],
                 "tokenizer": meta["tokenizer_hash"]}]
    return [{"file": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in settings.texts]


def text_names(text: list[dict[str, str]]) -> str:
    """The texts as a reader knows them: file names, or DIR:split."""
    return ", ".join(t["file"] if "file" in t else f"{t['packed']}:{t['split']}" for t in text)


def check_output(output: Path, overwrite: bool) -> Path:
    """The output folder, refused if it holds anything but an earlier report (unless
    ``overwrite``: then the report's files are replaced and the others stay)."""
    out = output.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise CompareError(f"--output {out} is a file; give a folder")
    ours = set(REPORT_FILES) | set(REPORT_DIRS)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours) if out.is_dir() else []
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise CompareError(
            f"--output {out} holds {len(foreign)} entries that are not a sinklm compare report "
            f"({shown}): pass --overwrite to write the report there anyway (those stay), or "
            "pick another folder"
        )
    return out


def unique_labels(names: Sequence[str], sources: Sequence[str]) -> list[str]:
    """Each checkpoint's name, with the shortest distinguishing tail of its path when several
    share a name (``tiny-5m-vanilla (a/last.ckpt)``)."""
    labels = list(names)
    for name in set(names):
        group = [i for i, n in enumerate(names) if n == name]
        if len(group) == 1:
            continue
        parts = [Path(sources[i]).parts for i in group]
        for depth in range(1, max(len(p) for p in parts) + 1):
            tails = ["/".join(p[-depth:]) for p in parts]
            if len(set(tails)) == len(tails):
                break
        for i, tail in zip(group, tails, strict=True):
            labels[i] = f"{name} ({tail})"
    return labels


class ModelResults:
    """One checkpoint's cache folder: results by kind and setting, and the model loaded only
    when something is missing."""

    def __init__(self, spec: str, root: Path, settings: Settings) -> None:
        self.spec = spec
        self.identity = checkpoint_identity(spec)
        key = _digest(self.identity)[:12]
        tail = "_".join(Path(spec).parts[-3:])
        self.folder = root / f"{_slug(tail)}-{key}"
        self.settings = settings
        self._checkpoint: Checkpoint | None = None
        self.meta = self.get("model", MODEL_SETTING) or self._describe()

    def _path(self, kind: str, setting: dict[str, Any], suffix: str = ".json") -> Path:
        return self.folder / f"{kind}-{_digest(setting)[:12]}{suffix}"

    def get(self, kind: str, setting: dict[str, Any]) -> Any:
        """A cached result, or None; a file from another identity or setting is never used."""
        path = self._path(kind, setting)
        if not path.is_file():
            return None
        document = json.loads(path.read_text())
        if document.get("identity") != self.identity or document.get("setting") != setting:
            return None
        return document["result"]

    def put(self, kind: str, setting: dict[str, Any], result: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        document = {"identity": self.identity, "setting": setting, "result": result}
        write_atomic(self._path(kind, setting), json.dumps(document, indent=1) + "\n")

    @property
    def checkpoint(self) -> Checkpoint:
        if self._checkpoint is None:
            self._checkpoint = load_checkpoint(self.spec, device=self.settings.device,
                                               dtype=DTYPES[self.settings.dtype])
        return self._checkpoint

    def release(self) -> None:
        """Drop the loaded model, so several large checkpoints never sit in memory together."""
        self._checkpoint = None

    def _describe(self) -> dict[str, Any]:
        checkpoint = self.checkpoint
        meta = {**checkpoint.describe(), "sink_token_ids": checkpoint.sink_token_ids,
                "training_sinks": checkpoint.training_sinks}
        self.put("model", MODEL_SETTING, meta)
        self.release()  # loaded again only if a result is missing
        return meta

    def _streams(self, sink_ids: list[int], max_tokens: int | None) -> list[Stream]:
        """The evaluation streams in this checkpoint's tokens, ``sink_ids`` in front."""
        checkpoint, settings = self.checkpoint, self.settings
        if settings.packed is not None:
            return packed_streams(settings.packed, checkpoint.tokenizer, sink_ids, max_tokens)
        return encode_streams(read_files(list(settings.texts)), checkpoint.tokenizer, sink_ids,
                              max_tokens)

    # --- streaming ---------------------------------------------------------------------------

    def stream_setting(self, policy: CachePolicy, text: list[dict[str, str]]) -> dict[str, Any]:
        return {"text": text, "max_tokens": self.settings.max_tokens,
                "dtype": self.settings.dtype, "cache": policy.label}

    def cached_stream(self, policy: CachePolicy, text: list[dict[str, str]]) -> CacheResult | None:
        setting = self.stream_setting(policy, text)
        row = self.get("stream", setting)
        losses = self._path("stream", setting, ".npy")
        if row is None or not losses.is_file():
            return None
        return CacheResult(policy, np.load(losses), row["seconds"], row.get("notes", []),
                           row.get("max_position"))

    def stream(self, policies: Sequence[CachePolicy], text: list[dict[str, str]],
               on_result: Callable[[CacheResult], None]) -> None:
        """Evaluate ``policies`` on the texts and cache each result as it comes."""
        checkpoint = self.checkpoint
        config = checkpoint.model.config
        sink_ids = checkpoint.sink_token_ids
        streams = self._streams(sink_ids, self.settings.max_tokens)
        longest = max(len(s.ids) for s in streams)
        try:
            warnings = check_policies(
                list(policies), longest, config.max_seq_len, len(sink_ids)
            )
        except CacheSpecError as error:
            raise CompareError(f"{self.spec}: {error}") from error
        for warning in warnings:
            _warn(f"{self.meta['name']}: {warning}")

        def store(result: CacheResult) -> None:
            setting = self.stream_setting(result.policy, text)
            np.save(self._path("stream", setting, ".npy"), result.losses)
            self.put("stream", setting, result.to_json())
            on_result(result)

        self.folder.mkdir(parents=True, exist_ok=True)
        device = self.settings.device
        evaluate(checkpoint.model, [s.ids.to(device) for s in streams], list(policies),
                 n_sink_ids=len(sink_ids), on_result=store)

    # --- sinks -------------------------------------------------------------------------------

    def sink_setting(self, text: list[dict[str, str]]) -> dict[str, Any]:
        return {"text": text, "window": min(SINK_WINDOW, self.meta["max_seq_len"]),
                "windows": SINK_WINDOWS, "first": SINK_FIRST, "eps": SINK_EPS,
                "dtype": self.settings.dtype}

    def sinks(self, text: list[dict[str, str]]) -> None:
        """measure_sinks on windows of the texts, as `sinklm sinks` does by default."""
        setting = self.sink_setting(text)
        checkpoint = self.checkpoint
        sink_ids = checkpoint.sink_token_ids
        window = setting["window"]
        budget = SINK_WINDOWS * (window - len(sink_ids))
        streams = self._streams([], budget)
        report = measure_text(checkpoint, torch.cat([s.ids for s in streams]), window,
                              SINK_WINDOWS, SINK_FIRST, SINK_EPS)
        self.put("sinks", setting, report.to_json())

    # --- zero-shot ---------------------------------------------------------------------------

    def zeroshot_setting(self, task: str) -> dict[str, Any]:
        s = self.settings
        return {"task": task, "data_dir": str(s.data_dir.resolve()) if s.data_dir else None,
                "limit": s.limit, "dtype": s.dtype, "bootstrap_iters": s.bootstrap_iters}

    def zeroshot(self, tasks: Sequence[str], specs: Sequence[str | dict[str, Any]]) -> None:
        """Run the missing ``tasks`` (with their lm-eval ``specs``) and cache each task's row."""
        from .zeroshot import SinkLMEval, summarize
        from .zeroshot import evaluate as zeroshot_evaluate

        s = self.settings
        model = SinkLMEval(self.checkpoint, s.batch_size)
        raw = zeroshot_evaluate(model, specs, limit=s.limit, bootstrap_iters=s.bootstrap_iters)
        data_dir = str(s.data_dir.resolve()) if s.data_dir else None
        summary = summarize(raw, model, {"checkpoint": self.spec, "limit": s.limit,
                                         "data_dir": data_dir})
        for task in tasks:
            row = {**summary["tasks"][task], "lm_eval_version": summary["lm_eval_version"],
                   "date": summary["date"]}
            self.put("zeroshot", self.zeroshot_setting(task), row)


def _slug(text: str) -> str:
    """``text`` as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _warn(message: str) -> None:
    tqdm.write(f"sinklm compare: warning: {message}", file=sys.stderr)


def compare(checkpoints: Sequence[str], output: Path, settings: Settings,
            overwrite: bool = False) -> Report:
    """Evaluate (or reuse) every checkpoint and write the report to ``output``."""
    if not checkpoints:
        raise CompareError("name at least one checkpoint")
    out = check_output(output, overwrite)
    if (settings.packed is None) == (not settings.texts):
        raise CompareError("give the texts to stream (files) or a packed split, not both")
    check_files(list(settings.texts))
    specs: list[str | dict[str, Any]] = []
    if settings.tasks:
        from .zeroshot_tasks import task_specs

        specs = task_specs(settings.tasks, settings.data_dir)  # checked before any model loads
    identities = [checkpoint_identity(spec) for spec in checkpoints]
    for i, identity in enumerate(identities):
        if identity in identities[:i]:
            raise CompareError(f"checkpoint {checkpoints[i]} is given twice")
    models = [ModelResults(spec, out / "cache", settings) for spec in checkpoints]
    labels = unique_labels([m.meta["name"] for m in models],
                           [m.meta["source"] for m in models])
    caches = settings.caches or tuple(
        paper_caches(min(m.meta["max_seq_len"] for m in models) // 2)
    )
    text = text_identity(settings)

    # What is missing, so the bar counts real work only.
    stream_todo = [[p for p in caches if m.cached_stream(p, text) is None] for m in models]
    sinks_todo = [m.get("sinks", m.sink_setting(text)) is None for m in models]
    zeroshot_todo = [[t for t in settings.tasks if m.get("zeroshot", m.zeroshot_setting(t))
                      is None] for m in models]
    total = sum(map(len, stream_todo)) + sum(sinks_todo) + sum(map(len, zeroshot_todo))
    with tqdm(total=total, desc="sinklm compare", unit="result", disable=total == 0,
              file=sys.stderr) as bar:
        for model, label, todo, sinks, tasks in zip(models, labels, stream_todo, sinks_todo,
                                                     zeroshot_todo, strict=True):
            if todo:
                def done(result: CacheResult, label: str = label) -> None:
                    tqdm.write(f"{label}: cache {result.policy.label}: ppl "
                               f"{format_ppl(result.ppl)} over {result.tokens} tokens, "
                               f"{result.tokens_per_second:,.0f} tokens/s", file=sys.stderr)
                    for note in result.notes:
                        _warn(f"{label}: cache {result.policy.label}: {note}")
                    bar.update(1)

                model.stream(todo, text, done)
            if sinks:
                model.sinks(text)
                bar.update(1)
            if tasks:
                model.zeroshot(tasks, [specs[settings.tasks.index(t)] for t in tasks])
                bar.update(len(tasks))
            model.release()

    streams = {label: [m.cached_stream(p, text) for p in caches]
               for m, label in zip(models, labels, strict=True)}
    sinks = {label: m.get("sinks", m.sink_setting(text))
             for m, label in zip(models, labels, strict=True)}
    zeroshot = {label: {t: m.get("zeroshot", m.zeroshot_setting(t)) for t in settings.tasks}
                for m, label in zip(models, labels, strict=True)}
    reused = len(models) * (len(caches) + 1 + len(settings.tasks)) - total
    measured = Measured(models, labels, settings, caches, text, streams, sinks, zeroshot)
    return write_report(out, measured, computed=total, reused=reused)


# --- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """What a report shows: the checkpoints compared, what they were measured on, and each
    model's results by label (streaming per cache, sinks, zero-shot per task)."""

    models: Sequence[ModelResults]
    labels: Sequence[str]
    settings: Settings
    caches: Sequence[CachePolicy]
    text: list[dict[str, str]]
    streams: dict[str, list[CacheResult]]
    sinks: dict[str, dict[str, Any]]
    zeroshot: dict[str, dict[str, dict[str, Any]]]

    @property
    def labelled(self) -> list[tuple[str, ModelResults]]:
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


def zeroshot_markdown(results: dict[str, dict[str, dict[str, Any]]], tasks: Sequence[str]) -> str:
    """Table 4's layout: a row per model, a column per task, ``acc / acc_norm`` in percent."""
    lines = ["| Model | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for label, rows in results.items():
        cells = []
        for task in tasks:
            row = rows[task]
            scores = [f"{100 * row[m]:.1f}" for m in ("acc", "acc_norm") if row.get(m) is not None]
            cells.append(" / ".join(scores) or "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def non_trigger_first(report: dict[str, Any]) -> float | None:
    """The strongest head's attention from non-trigger queries to position 0 (Bigram-Backcopy
    only), from a sink report's JSON."""
    group = report.get("targets", {}).get("non_trigger")
    return None if group is None else max(head[0] for layer in group for head in layer)


def sinks_markdown(sinks: dict[str, dict[str, Any]]) -> str:
    """Sink_1^eps and the attention each layer gives position 0 (a sink id if the model has
    them), per model; on Bigram-Backcopy also the non-trigger queries' attention to it."""
    triggers = any(non_trigger_first(report) is not None for report in sinks.values())
    extra = " attention to position 0 from non-trigger queries (strongest head) |"
    lines = [f"| Model | Sink_1^{SINK_EPS:g} | attention to position 0 per layer |"
             + (extra if triggers else ""), "|---|---:|---|" + ("---:|" if triggers else "")]
    for label, report in sinks.items():
        layers = ", ".join(f"{m:.3f}" for m in report["attention_to_first_per_layer"])
        row = f"| {label} | {report['sink_rate']['1']:.3f} | {layers} |"
        if triggers:
            value = non_trigger_first(report)
            row += f" {'-' if value is None else f'{value:.3f}'} |"
        lines.append(row)
    return "\n".join(lines)


def sink_findings(sinks: dict[str, dict[str, Any]]) -> list[str]:
    """One measured sentence per model on whether a first-token sink formed (Gu et al.)."""
    findings = []
    for label, report in sinks.items():
        heads = np.asarray(report["attention_to_position"])[:, :, 0]
        above = int((heads > report["eps"]).sum())
        verdict = (f"{above} of {heads.size} heads give position 0 more than {report['eps']:g} "
                   "of their attention: a first-token sink formed" if above else
                   f"no head gives position 0 more than {report['eps']:g} of its attention "
                   f"(at most {heads.max():.3f}): no first-token sink by this measure")
        findings.append(f"{label}: {verdict}.")
    return findings


def first_token_findings(streams: dict[str, list[CacheResult]],
                         context: dict[str, int]) -> list[str]:
    """One measured sentence per model on what its first tokens do under the paper's caches
    (0+W against 1+(W-1) and 4+(W-4)), and a note when dense runs past the trained context."""
    findings = []
    for label, results in streams.items():
        by_start = {(r.policy.start, r.policy.size): r.ppl for r in results
                    if isinstance(r.policy, StartRecent)}
        for (start, size), window in sorted(by_start.items()):
            one, four = by_start.get((1, size)), by_start.get((4, size))
            if start != 0 or one is None:
                continue
            ratio = window / one
            verdict = ("it depends on its first token: dropping it breaks the model"
                       if ratio >= DEPENDENCE_RATIO else
                       "it does not depend on its first token")
            sentence = (f"{label}: window-only 0+{size} perplexity is {ratio:.2f}x that of "
                        f"1+{size - 1} ({format_ppl(window)} vs {format_ppl(one)}): {verdict}")
            if four is not None:
                change = four / one - 1
                sentence += (f"; 4+{size - 4} is {abs(change):.1%} "
                             f"{'below' if change < 0 else 'above'} 1+{size - 1}")
            findings.append(sentence + ".")
        dense = next((r for r in results if isinstance(r.policy, Dense)), None)
        if dense is not None and (dense.max_position or 0) >= context[label]:
            findings.append(
                f"{label}: dense attention reaches position {dense.max_position:,}, past the "
                f"{context[label]} positions the model was trained on; its perplexity "
                f"({format_ppl(dense.ppl)}) measures length extrapolation, not the cache."
            )
    return findings


def _strongest_non_trigger(row: dict[str, Any]) -> float | None:
    values = row.get("non_trigger_first")
    return None if values is None else max(max(layer) for layer in values)


def training_sinks_markdown(training: dict[str, list[dict[str, Any]]]) -> str:
    """Per model, when the sink probe first saw Sink_1^eps above zero, and its last reading
    (with the non-trigger queries' attention to position 0 on Bigram-Backcopy)."""
    triggers = any(_strongest_non_trigger(h[-1]) is not None for h in training.values())
    lines = ["| Model | probes | tokens trained | Sink_1^0.3 first > 0 at | last Sink_1^0.3 | "
             "last attention to position 0 per layer |"
             + (" last non-trigger attention to position 0 (strongest head) |" if triggers
                else ""),
             "|---|---:|---:|---:|---:|---|" + ("---:|" if triggers else "")]
    for label, history in training.items():
        last = history[-1]
        formed = next((row["tokens"] for row in history if row["sink_rate"] > 0), None)
        layers = ", ".join(f"{m:.3f}" for m in last["first_mass"])
        row = (f"| {label} | {len(history)} | {last['tokens']:,} | "
               f"{'never' if formed is None else f'{formed:,} tokens'} | "
               f"{last['sink_rate']:.3f} | {layers} |")
        if triggers:
            value = _strongest_non_trigger(last)
            row += f" {'-' if value is None else f'{value:.3f}'} |"
        lines.append(row)
    return "\n".join(lines)


def _plot_training_sinks(training: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Sink_1^eps and the strongest layer's attention to position 0 against training tokens."""
    # On Bigram-Backcopy the right panel shows what the mechanism predicts: the attention of
    # non-trigger queries to position 0, in the strongest head.
    triggers = all(_strongest_non_trigger(h[-1]) is not None for h in training.values())
    with figure(path, tight=False, ncols=2, figsize=(11, 4)) as (fig, (rate, mass)):
        for label, history in training.items():
            tokens = [row["tokens"] for row in history]
            rate.plot(tokens, [row["sink_rate"] for row in history], marker="o", label=label)
            attention = [_strongest_non_trigger(row) if triggers else max(row["first_mass"])
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
        name = f"{_slug(label)}.png"
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
        "Running perplexity: " + ", ".join(f"[{label}](running/{_slug(label)}.png)"
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
        "streaming": {"text": measured.text, "max_tokens": settings.max_tokens,
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
        findings=(first_token_findings(measured.streams, context)
                  + sink_findings(measured.sinks)),
        files={}, computed=computed, reused=reused,
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
