"""Text sources for the evaluators and their token streams.

A document is tokenized as one string without special tokens (as StreamingLLM does with a PG19
book); its stream carries the model's sink prefix, which the evaluator puts in front. Local
files and Hub datasets take the same path after loading, so a test on a local book exercises
what a PG19 run does.

A text the model's tokenizer cannot represent is refused before evaluation: more than
``MAX_UNKNOWN_SHARE`` of its tokens the tokenizer's unknown token (a natural-language book
through the sink lab's symbol vocabulary is all unknown), or a tokenizer that fails on it.
Perplexities of such a stream would measure nothing. torch loads only when streams are built,
so commands check their sources at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from sinklm.cli.main import UserError
from sinklm.data.errors import DataError
from sinklm.data.packing import SPLITS, read_meta, read_split
from sinklm.data.tokenizer import tokenizer_hash

if TYPE_CHECKING:
    from torch import Tensor

    from sinklm.data.sinks import SinkPrefix

# The share of a text's tokens that may be the tokenizer's unknown token: a few symbols outside
# the vocabulary are harmless, a text in another vocabulary is refused.
MAX_UNKNOWN_SHARE = 0.01
# What to do instead, in every refusal of a text the tokenizer cannot represent.
OTHER_TEXT_HINT = ("evaluate on data packed with the model's tokenizer (--packed DIR) or on "
                   "another text")


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
    """Fail on a missing file or a folder before anything slow (loading a model) happens."""
    for path in paths:
        if Path(path).expanduser().is_dir():
            raise TextSourceError(f"text file {path} is a folder: name each file (one stream "
                                  "per file), e.g. --text DIR/a.txt --text DIR/b.txt")
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

    Documents with fewer than two tokens are skipped: they have no scored target. Refused when
    the tokenizer cannot represent the text (see the module's docstring).
    """
    streams = _streams(((name, _encode(tokenizer, name, text)) for name, text in documents),
                       sinks, max_tokens)
    check_coverage(streams, tokenizer)
    return streams


def _encode(tokenizer: Tokenizer, name: str, text: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as error:  # tokenizers raises plain Exception (a WordLevel without unk)
        raise TextSourceError(f"{name}: the model's tokenizer cannot encode this text "
                              f"({error}): {OTHER_TEXT_HINT}") from None


def unknown_id(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer model's unknown token, or None (byte-level BPE has none)."""
    token = getattr(tokenizer.model, "unk_token", None)
    return None if token is None else tokenizer.token_to_id(token)


def check_coverage(streams: Sequence[Stream], tokenizer: Tokenizer) -> None:
    """Refuse streams more than ``MAX_UNKNOWN_SHARE`` of whose tokens are the unknown id."""
    unk = unknown_id(tokenizer)
    if unk is None:
        return
    total = sum(s.text_tokens for s in streams)
    unknown = sum(int((s.text == unk).sum()) for s in streams)
    if unknown > MAX_UNKNOWN_SHARE * total:
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        raise TextSourceError(
            f"{_shown(s.name for s in streams)}: {unknown / total:.1%} of its {total:,} tokens "
            f"are the unknown token {tokenizer.id_to_token(unk)!r} of the model's tokenizer "
            f"({vocab:,} ids), more than the {MAX_UNKNOWN_SHARE:.0%} allowed: the text is not "
            f"in that vocabulary; {OTHER_TEXT_HINT}"
        )


def _shown(names: Iterable[str], most: int = 3) -> str:
    """A few names, for a one-line message."""
    names = list(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")


def _streams(
    documents: Iterable[tuple[str, Sequence[int]]], sinks: SinkPrefix, max_tokens: int | None
) -> list[Stream]:
    import torch

    streams: list[Stream] = []
    short: list[str] = []
    budget = max_tokens
    for name, ids in documents:
        if budget is not None and budget <= 0:
            break
        if budget is not None:
            ids = ids[:budget]
            budget -= len(ids)
        if len(ids) < 2:
            short.append(f"{name} ({len(ids)} token{'' if len(ids) == 1 else 's'})")
            continue
        streams.append(Stream(name, torch.as_tensor(np.asarray(ids), dtype=torch.long), sinks))
    if not streams:
        raise TextSourceError(
            f"no document with at least two tokens to evaluate: {_shown(short) or 'none given'}"
        )
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


def check_packed_tokenizer(spec: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The meta.json of ``--packed spec``, refused unless packed with ``tokenizer``."""
    meta = check_packed(spec)
    if tokenizer_hash(tokenizer) != meta["tokenizer_hash"]:
        raise TextSourceError(
            f"--packed {spec} was packed with another tokenizer ({meta['tokenizer']}) than the "
            "model's: evaluate on text (--text) or on data packed with the model's tokenizer"
        )
    return meta


def packed_streams(
    spec: str, tokenizer: Tokenizer, sinks: SinkPrefix, max_tokens: int | None = None,
    eod_first: bool = False,
) -> list[Stream]:
    """Streams of the documents of a packed split (the ids as packed, split at end-of-document),
    for a model whose tokenizer is the one the folder was packed with.

    ``eod_first`` keeps the end-of-document id that precedes each document as its first token
    (the first document, which has none in the split, gets one too), as a model trained with
    ``data.windows: documents`` saw documents start; else the ids are dropped.
    """
    meta = check_packed_tokenizer(spec, tokenizer)
    folder, split = split_packed_spec(spec)
    # A document needs at most max_tokens + its end-of-document id; read no more than that.
    reach = None if max_tokens is None else max_tokens + meta["splits"][split]["documents"]
    tokens = read_split(folder, split, reach)
    eod = meta["eod_id"]
    if eod_first:  # document 0 starts like the others
        tokens = np.concatenate([np.array([eod], tokens.dtype), tokens])
    # Piece i > 0 starts with the end-of-document id that closed document i - 1 (with
    # eod_first, piece 0 is empty and piece i is document i - 1 with that id in front).
    pieces = np.split(tokens, np.flatnonzero(tokens == eod))
    if eod_first:
        # The piece after the split's last id (a lone id) holds no document.
        documents = ((f"{folder.name}:{split}[{i}]", piece)
                     for i, piece in enumerate(pieces[1:]) if len(piece) > 1)
    else:
        documents = ((f"{folder.name}:{split}[{i}]", piece[1:] if i else piece)
                     for i, piece in enumerate(pieces))
    return _streams(documents, sinks, max_tokens)


def trained_windows(spec: str) -> str | None:
    """The ``data.windows`` a `sinklm fit` checkpoint (.ckpt) was trained with: recorded in its
    data identity and hyperparameters; None for other checkpoints (folders, Hub ids)."""
    from sinklm.models.checkpoint import DATA_KEY, CheckpointFormatError, read_checkpoint
    from sinklm.models.load import CheckpointError, locate

    try:
        where = locate(spec)
        if where.kind != "ckpt":
            return None
        checkpoint = read_checkpoint(where.path)
    except (CheckpointError, CheckpointFormatError):
        return None  # loading the model says what is wrong with it
    for record in (checkpoint.get(DATA_KEY), checkpoint.get("datamodule_hyper_parameters")):
        if isinstance(record, dict) and record.get("windows") is not None:
            return str(record["windows"])
    return None


def eod_first_note(spec: str, eod_first: bool) -> str | None:
    """A note when ``spec`` was trained with windows starting at documents but its streams
    will not start with the end-of-document id (no ``--eod-first``); else None."""
    if eod_first or trained_windows(spec) != "documents":
        return None
    return (f"{spec} was trained with data.windows: documents (every window starting with "
            "the end-of-document id); pass --packed DIR --eod-first to evaluate documents as "
            "it saw them")
