"""Text sources for the evaluators and their token streams.

A document is tokenized as one string without special tokens (as StreamingLLM does with a PG19
book); its stream carries the model's sink prefix, which the evaluator puts in front. Local
files and Hub datasets take the same path after loading, so a test on a local book exercises
what a PG19 run does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from sinklm.cli.main import UserError
from sinklm.data.errors import DataError
from sinklm.data.packing import SPLITS, read_meta, read_split
from sinklm.data.sinks import SinkPrefix
from sinklm.data.tokenizer import tokenizer_hash


class TextSourceError(UserError, ValueError):
    """A text source cannot be read; the message names it."""


@dataclass
class Stream:
    """One document: its text token ids and the sink ids the model reads before them."""

    name: str
    text: Tensor  # int64 [text tokens]
    sinks: SinkPrefix

    @property
    def text_tokens(self) -> int:
        return len(self.text)

    @property
    def tokens(self) -> int:
        """The stream's length as the model reads it: sink ids, then the text."""
        return len(self.sinks) + len(self.text)


def split_dataset_spec(spec: str) -> tuple[str, str]:
    """``HUB_ID[:split]`` as (id, split); the split defaults to ``test``."""
    name, sep, split = spec.rpartition(":")
    if sep and name and split and "/" not in split:
        return name, split
    return spec, "test"


def check_files(paths: list[str | Path]) -> None:
    """Fail on a missing file before anything slow (loading a model) happens."""
    for path in paths:
        if not Path(path).expanduser().is_file():
            raise TextSourceError(f"text file {path} does not exist")


def read_files(paths: list[str | Path]) -> Iterator[tuple[str, str]]:
    """(name, text) of each UTF-8 file, in the order given."""
    check_files(paths)
    for path in paths:
        file = Path(path).expanduser()
        try:
            yield file.name, file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise TextSourceError(f"text file {file} is not UTF-8 text ({error})") from error


def read_dataset(spec: str, column: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) of each row of a Hub dataset (or local dataset folder), streamed lazily."""
    import datasets

    name, split = split_dataset_spec(spec)
    try:
        rows = datasets.load_dataset(name, split=split, streaming=True)
        for i, row in enumerate(rows):
            if column not in row:
                raise TextSourceError(
                    f"dataset {name} has no column {column!r} (columns: {sorted(row)})"
                )
            yield f"{name}:{split}[{i}]", str(row[column])
    except TextSourceError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as error:
        raise TextSourceError(f"cannot load dataset {spec!r} ({error})") from error


def encode_streams(
    documents: Iterator[tuple[str, str]],
    tokenizer: Tokenizer,
    sinks: SinkPrefix,
    max_tokens: int | None = None,
) -> list[Stream]:
    """Streams of the documents, stopping once ``max_tokens`` text tokens are taken in all.

    Documents with fewer than two tokens are skipped: they have no scored target.
    """
    encoded = (
        (name, tokenizer.encode(text, add_special_tokens=False).ids) for name, text in documents
    )
    return _streams(encoded, sinks, max_tokens)


def _streams(
    documents: Iterable[tuple[str, Sequence[int]]], sinks: SinkPrefix, max_tokens: int | None
) -> list[Stream]:
    streams: list[Stream] = []
    budget = max_tokens
    for name, ids in documents:
        if budget is not None and budget <= 0:
            break
        if budget is not None:
            ids = ids[:budget]
            budget -= len(ids)
        if len(ids) < 2:
            continue
        streams.append(Stream(name, torch.as_tensor(np.asarray(ids), dtype=torch.long), sinks))
    if not streams:
        raise TextSourceError("no document with at least two tokens to evaluate")
    return streams


def split_packed_spec(spec: str) -> tuple[Path, str]:
    """``DIR[:split]`` as (folder, split); the split defaults to ``validation`` (held out)."""
    folder, sep, split = spec.rpartition(":")
    if sep and folder and split in SPLITS:
        return Path(folder).expanduser(), split
    return Path(spec).expanduser(), "validation"


def check_packed(spec: str) -> dict[str, Any]:
    """The meta.json of a ``--packed DIR[:split]`` source, checked before a model is loaded."""
    folder, split = split_packed_spec(spec)
    try:
        meta = read_meta(folder)
    except DataError as error:
        raise TextSourceError(f"--packed {spec}: {error}") from None
    if not meta["splits"].get(split, {}).get("tokens"):
        raise TextSourceError(
            f"--packed {spec}: the {split} split is empty; pack with a validation fraction > 0 "
            "(`sinklm prepare-data --val-fraction 0.05 ...`) or name the train split (DIR:train)"
        )
    return meta


def packed_streams(
    spec: str, tokenizer: Tokenizer, sinks: SinkPrefix, max_tokens: int | None = None
) -> list[Stream]:
    """Streams of the documents of a packed split (the ids as packed, split at end-of-document),
    for a model whose tokenizer is the one the folder was packed with."""
    meta = check_packed(spec)
    if tokenizer_hash(tokenizer) != meta["tokenizer_hash"]:
        raise TextSourceError(
            f"--packed {spec} was packed with another tokenizer ({meta['tokenizer']}) than the "
            "model's: evaluate on text (--text) or on data packed with the model's tokenizer"
        )
    folder, split = split_packed_spec(spec)
    # A document needs at most max_tokens + its end-of-document id; read no more than that.
    reach = None if max_tokens is None else max_tokens + meta["splits"][split]["documents"]
    tokens = read_split(folder, split, reach)
    # Piece i > 0 starts with the end-of-document id that closed document i - 1.
    pieces = np.split(tokens, np.flatnonzero(tokens == meta["eod_id"]))
    documents = ((f"{folder.name}:{split}[{i}]", piece[1:] if i else piece)
                 for i, piece in enumerate(pieces))
    return _streams(documents, sinks, max_tokens)
