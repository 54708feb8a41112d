"""Several checkpoints side by side in one report (``sinklm compare``), with cached results.

For each checkpoint: streaming perplexity under each KV cache (``streaming.evaluate``), where
attention goes (``sinks.measure_text``) and, when tasks are named, lm-eval zero-shot scores
(``zeroshot.evaluate``). This module decides what runs in which order: it checks the input
(the output folder, and a report already there of other inputs, before any model loads; then
every checkpoint's tokenizer against the text, before any is evaluated), asks the cache
(``compare_cache``) what is missing, computes only that, one checkpoint in memory at a time,
and hands every result to the report (``compare_report``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sinklm.cli.main import UserError
from sinklm.cli.outputs import guard_writable
from sinklm.data.sinks import SinkPrefix
from sinklm.models.load import DTYPES, Checkpoint, load_checkpoint, load_tokenizer

from .cache import CachePolicy, CacheSpecError, check_policies, paper_caches
from .compare_cache import (
    CACHE_DIR,
    SINK_EPS,
    SINK_FIRST,
    SINK_WINDOWS,
    Missing,
    ModelCache,
    Text,
    text_identity,
)
from .compare_report import (
    REPORT_DIRS,
    REPORT_FILES,
    Measured,
    Report,
    changed_inputs,
    report_inputs,
    write_report,
)
from .report import format_ppl
from .sinks import SinkReport, measure_text
from .streaming import CacheResult, evaluate
from .texts import (
    Stream,
    TextSourceError,
    check_files,
    check_packed_tokenizer,
    encode_streams,
    eod_first_note,
    packed_streams,
    read_files,
)


class CompareError(UserError, ValueError):
    """Bad input to a comparison (output folder, repeated checkpoint); the message says why."""


@dataclass(frozen=True)
class Settings:
    """What a comparison measures: streams of ``texts`` (files) or of a ``packed`` split
    (with ``eod_first``, each document led by its end-of-document id, as models trained with
    ``data.windows: documents`` saw them). ``caches`` None: the paper's grid for half the
    shortest trained context of the checkpoints; ``tasks`` empty: no zero-shot."""

    texts: tuple[Path, ...]
    caches: tuple[CachePolicy, ...] | None = None
    packed: str | None = None  # DIR[:split] of packed token ids, instead of texts
    eod_first: bool = False  # packed documents keep the end-of-document id in front
    max_tokens: int | None = None
    tasks: tuple[str, ...] = ()
    data_dir: Path | None = None
    limit: int | None = None
    batch_size: int = 16
    bootstrap_iters: int = 100_000
    device: str = "cpu"
    dtype: str = "float32"


def check_output(output: Path, overwrite: bool) -> Path:
    """The output folder, refused if it holds anything but an earlier report (unless
    ``overwrite``: then the report's files are replaced and the others stay) or cannot be
    written."""
    out = output.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise CompareError(f"--output {out} is a file; give a folder")
    guard_writable([out])
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


def _warn(message: str) -> None:
    tqdm.write(f"sinklm compare: warning: {message}", file=sys.stderr)


def _note(message: str) -> None:
    tqdm.write(f"sinklm compare: note: {message}", file=sys.stderr)


def _load(spec: str, settings: Settings) -> Checkpoint:
    return load_checkpoint(spec, device=settings.device, dtype=DTYPES[settings.dtype])


def _describe(spec: str, settings: Settings) -> dict[str, Any]:
    """What the report says about a model; the checkpoint is dropped at once and loaded again
    only if a result is missing."""
    checkpoint = _load(spec, settings)
    return {**checkpoint.describe(), "sink_token_ids": checkpoint.sink_token_ids,
            "training_sinks": checkpoint.training_sinks}


def _streams(checkpoint: Checkpoint, settings: Settings, sinks: SinkPrefix,
             max_tokens: int | None) -> list[Stream]:
    """The evaluation streams in this checkpoint's tokens, ``sinks`` in front."""
    if settings.packed is not None:
        return packed_streams(settings.packed, checkpoint.tokenizer, sinks, max_tokens,
                              eod_first=settings.eod_first)
    return encode_streams(read_files(list(settings.texts)), checkpoint.tokenizer, sinks,
                          max_tokens)


def _stream(model: ModelCache, checkpoint: Checkpoint, policies: Sequence[CachePolicy],
            text: Text, on_result: Callable[[CacheResult], None]) -> None:
    """Evaluate ``policies`` on the texts and cache each result as it comes."""
    settings = model.settings
    sinks = SinkPrefix(checkpoint.sink_token_ids)
    streams = _streams(checkpoint, settings, sinks, settings.max_tokens)
    longest = max(s.tokens for s in streams)
    try:
        config = checkpoint.model.config
        warnings = check_policies(list(policies), longest, config.max_seq_len, len(sinks),
                                  learned_positions=config.learned_positions)
    except CacheSpecError as error:
        raise CompareError(f"{model.spec}: {error}") from error
    for warning in warnings:
        _warn(f"{model.meta['name']}: {warning}")

    def store(result: CacheResult) -> None:
        model.put_stream(result, text)
        on_result(result)

    evaluate(checkpoint.model, streams, list(policies), on_result=store)


def _sinks(model: ModelCache, checkpoint: Checkpoint, text: Text) -> SinkReport:
    """measure_text on windows of the texts, as `sinklm sinks` does by default."""
    window = model.sink_window
    budget = SINK_WINDOWS * (window - len(checkpoint.sink_token_ids))
    streams = _streams(checkpoint, model.settings, SinkPrefix(()), budget)
    report = measure_text(checkpoint, torch.cat([s.text for s in streams]), window,
                          SINK_WINDOWS, SINK_FIRST, SINK_EPS)
    model.put_sinks(text, report.to_json())
    return report


def _zeroshot(model: ModelCache, checkpoint: Checkpoint, tasks: Sequence[str],
              specs: Sequence[str | dict[str, Any]]) -> None:
    """Run ``tasks`` (with their lm-eval ``specs``) and cache each task's row."""
    from .zeroshot import SinkLMEval, summarize
    from .zeroshot import evaluate as zeroshot_evaluate

    s = model.settings
    lm = SinkLMEval(checkpoint, s.batch_size)
    raw = zeroshot_evaluate(lm, specs, limit=s.limit, bootstrap_iters=s.bootstrap_iters)
    data_dir = str(s.data_dir.resolve()) if s.data_dir else None
    summary = summarize(raw, lm, {"checkpoint": model.spec, "limit": s.limit,
                                  "data_dir": data_dir})
    for task in tasks:
        model.put_zeroshot(task, {**summary["tasks"][task],
                                  "lm_eval_version": summary["lm_eval_version"],
                                  "date": summary["date"]})


def _measure(model: ModelCache, label: str, todo: Missing, text: Text,
             specs: dict[str, str | dict[str, Any]], bar: tqdm) -> None:
    """Compute what ``model`` lacks. Its checkpoint is loaded once and dropped on return, so
    several large checkpoints never sit in memory together."""
    checkpoint = _load(model.spec, model.settings)
    if todo.caches:
        def done(result: CacheResult) -> None:
            tqdm.write(f"{label}: cache {result.policy.label}: ppl "
                       f"{format_ppl(result.ppl)} over {result.tokens} tokens, "
                       f"{result.tokens_per_second:,.0f} tokens/s", file=sys.stderr)
            for note in result.notes:
                _warn(f"{label}: cache {result.policy.label}: {note}")
            bar.update(1)

        _stream(model, checkpoint, todo.caches, text, done)
    if todo.sinks:
        sinks = _sinks(model, checkpoint, text)
        tqdm.write(f"{label}: sinks: Sink_1^{SINK_EPS:g} = {sinks.sink_rate(1):.3f}",
                   file=sys.stderr)
        bar.update(1)
    if todo.tasks:
        _zeroshot(model, checkpoint, todo.tasks, [specs[t] for t in todo.tasks])
        tqdm.write(f"{label}: zero-shot: {', '.join(todo.tasks)} scored", file=sys.stderr)
        bar.update(len(todo.tasks))


def _check_tokenizer(model: ModelCache) -> None:
    """Refuse a checkpoint whose tokenizer cannot read the text (another packed tokenizer, a
    text outside its vocabulary), reading only the tokenizer: every checkpoint is checked
    before any is evaluated."""
    settings = model.settings
    tokenizer = load_tokenizer(model.spec)
    try:
        if settings.packed is not None:
            check_packed_tokenizer(settings.packed, tokenizer)
        else:
            encode_streams(read_files(list(settings.texts)), tokenizer, SinkPrefix(()),
                           settings.max_tokens)
    except TextSourceError as error:
        raise CompareError(f"{model.spec}: {error}") from None


def compare(checkpoints: Sequence[str], output: Path, settings: Settings,
            overwrite: bool = False) -> Report:
    """Evaluate (or reuse) every checkpoint and write the report to ``output``."""
    if not checkpoints:
        raise CompareError("name at least one checkpoint")
    out = check_output(output, overwrite)
    if (settings.packed is None) == (not settings.texts):
        raise CompareError("give the texts to stream (files) or a packed split, not both")
    if settings.eod_first and settings.packed is None:
        raise CompareError("eod_first keeps the end-of-document ids of packed data in front of "
                           "each document: use it with a packed split (--packed DIR[:split])")
    check_files(list(settings.texts))
    specs: dict[str, str | dict[str, Any]] = {}
    if settings.tasks:
        from .zeroshot_tasks import task_specs

        # Checked before any model loads.
        specs = dict(zip(settings.tasks, task_specs(settings.tasks, settings.data_dir),
                         strict=True))
    models = [ModelCache(spec, out / CACHE_DIR, settings, partial(_describe, spec, settings))
              for spec in checkpoints]
    for i, model in enumerate(models):
        if model.identity in [m.identity for m in models[:i]]:
            raise CompareError(f"checkpoint {checkpoints[i]} is given twice")
    for spec in checkpoints:  # the streams stay as asked: a note, no silent change
        message = eod_first_note(spec, settings.eod_first)
        if message:
            _note(message)
    text = text_identity(settings)
    changed = changed_inputs(out, report_inputs(models, settings, text))
    if changed and not overwrite:
        raise CompareError(
            f"--output {out} holds a report made from other inputs ({', '.join(changed)} "
            "differ): pass --overwrite to replace it (the cached results there are reused), or "
            "choose another folder"
        )
    labels = unique_labels([m.meta["name"] for m in models],
                           [m.meta["source"] for m in models])
    caches = settings.caches or tuple(
        paper_caches(min(m.meta["max_seq_len"] for m in models) // 2)
    )

    missing = [m.missing(caches, text) for m in models]
    for model, todo in zip(models, missing, strict=True):
        if todo.count:
            _check_tokenizer(model)
    total = sum(todo.count for todo in missing)
    # A bar on a terminal only (disable=None); a log file gets the plain line of each result.
    with tqdm(total=total, desc="sinklm compare", unit="result",
              disable=True if total == 0 else None, file=sys.stderr) as bar:
        for model, label, todo in zip(models, labels, missing, strict=True):
            if todo.count:
                _measure(model, label, todo, text, specs, bar)

    streams = {label: [m.stream(p, text) for p in caches]
               for m, label in zip(models, labels, strict=True)}
    sinks = {label: m.sinks(text) for m, label in zip(models, labels, strict=True)}
    zeroshot = {label: {t: m.zeroshot(t) for t in settings.tasks}
                for m, label in zip(models, labels, strict=True)}
    reused = len(models) * (len(caches) + 1 + len(settings.tasks)) - total
    measured = Measured(models, labels, settings, caches, text, streams, sinks, zeroshot)
    return write_report(out, measured, computed=total, reused=reused)
