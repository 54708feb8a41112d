"""Tokenize documents once and pack them into memory-mapped token shards.

Layout of a packed folder::

    DIR/meta.json              tokenizer hash, source fingerprint, dtype, per-split counts
    DIR/tokenizer.json         the exact tokenizer the ids come from (``packed_tokenizer``)
    DIR/train-00000.bin        raw token ids (uint16 or uint32), documents back to back,
    DIR/validation-00000.bin   each followed by the end-of-document id, as GPT-NeoX packs

Documents go to train or validation by a hash of (seed, document index), so the split is
fixed by the seed and does not depend on batch sizes or core counts. The folder is built
under a temporary name and renamed into place: an interrupted run never leaves a half-written
folder where a good one was. A second run with the same inputs reuses the folder; different
inputs are refused (or, with ``overwrite``, rebuilt), never mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from .errors import DataError
from .keys import reject_unknown_keys
from .sources import Source, SourceSpec
from .synthetic import BigramBackcopySpec, SyntheticSource
from .tokenizer import DEFAULT_TOKENIZER, eod_token_id, load_tokenizer, token_dtype, tokenizer_hash

FORMAT = "sinklm-packed"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "validation")
# Keys of meta.json that must match for a folder to be reused.
_IDENTITY_KEYS = ("tokenizer_hash", "source_fingerprint", "val_fraction", "seed", "max_tokens")


@dataclass
class PrepareConfig:
    """Everything ``prepare-data`` needs; also the shape of configs/data/*.yaml.

    source:       documents (``path: ...``) or a generator (``synthetic: bigram-backcopy``).
    tokenizer:    tokenizer.json, a folder or a Hub id (default Pythia's); a generator brings
                  its own vocabulary, so it takes none.
    val_fraction: share of documents held out for validation (0: none; 1: all, for eval sets).
    max_tokens:   stop after the document that reaches this many tokens (for streamed sets).
    shard_tokens: tokens per shard file (2**30 = 2 GiB of uint16).
    batch_chars:  characters per ``encode_batch`` call: large enough to keep every core busy,
                  small enough to bound memory on book-length documents.
    """

    source: SourceSpec | BigramBackcopySpec
    output: str
    tokenizer: str | None = None
    val_fraction: float = 0.0
    seed: int = 0
    max_tokens: int | None = None
    shard_tokens: int = 1 << 30
    batch_chars: int = 8 << 20
    overwrite: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.source, dict):
            self.source = source_spec(self.source)
        if isinstance(self.source, BigramBackcopySpec) and self.tokenizer is not None:
            raise DataError(
                f"tokenizer={self.tokenizer}: a synthetic source brings its own vocabulary (one "
                "word per symbol); drop the tokenizer setting"
            )
        if not 0.0 <= self.val_fraction <= 1.0:
            raise DataError(f"val_fraction={self.val_fraction}: must lie in [0, 1]")
        for name in ("shard_tokens", "batch_chars"):
            if getattr(self, name) <= 0:
                raise DataError(f"{name}={getattr(self, name)}: must be positive")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise DataError(f"max_tokens={self.max_tokens}: must be positive (or unset)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrepareConfig:
        reject_unknown_keys(data, cls, "data config keys", DataError)
        missing = [key for key in ("source", "output") if data.get(key) is None]
        if missing:
            raise DataError(f"the data config needs {' and '.join(missing)}")
        return cls(**data)


def source_spec(data: dict[str, Any]) -> SourceSpec | BigramBackcopySpec:
    """A data config's ``source:`` mapping: a generator when it names ``synthetic``."""
    if "synthetic" in data:
        return BigramBackcopySpec.from_dict(data)
    return SourceSpec.from_dict(data)


def open_source(spec: SourceSpec | BigramBackcopySpec) -> Source | SyntheticSource:
    """The checked, fingerprinted source of ``spec``."""
    return SyntheticSource(spec) if isinstance(spec, BigramBackcopySpec) else Source(spec)


@dataclass
class _SplitWriter:
    """Appends token arrays to ``{split}-NNNNN.bin`` files of at most ``shard_tokens`` each."""

    directory: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    documents: int = 0
    shards: list[dict[str, Any]] = field(default_factory=list)
    _file: Any = None

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            self._file.write(tokens[:room].tobytes())
            self.shards[-1]["tokens"] += min(room, tokens.size)
            tokens = tokens[room:]

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (closed in close())
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def summary(self) -> dict[str, Any]:
        tokens = sum(shard["tokens"] for shard in self.shards)
        return {"documents": self.documents, "tokens": tokens, "shards": self.shards}


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element (SplitMix64's finaliser); wraps on purpose."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def document_scores(seed: int, indices: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per document index, fixed by the seed."""
    mixed = _splitmix64(indices.astype(np.uint64) ^ _splitmix64(np.array([seed], np.uint64)))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def validation_documents(num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Indices of exactly round(fraction * n) validation documents (at least one if > 0)."""
    if val_fraction == 0.0:
        return np.zeros(0, dtype=np.int64)
    if val_fraction == 1.0:
        return np.arange(num_documents)
    if num_documents < 2:
        raise DataError(
            f"the source has {num_documents} document(s): too few to split by document; set "
            "the validation fraction to 0 (or 1) or add documents"
        )
    count = min(max(round(val_fraction * num_documents), 1), num_documents - 1)
    order = np.argsort(document_scores(seed, np.arange(num_documents)), kind="stable")
    return np.sort(order[:count])


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The meta.json of a packed folder, checked for format and complete shards."""
    directory = Path(directory)
    path = directory / META_FILE
    if not path.is_file():
        raise DataError(
            f"{directory}: no {META_FILE}, so not a packed-data folder; create it with "
            "`sinklm prepare-data --output DIR ...`"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: unreadable ({error}); rebuild with prepare-data") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format {meta.get('format')} v{meta.get('version')}, expected {FORMAT} "
            f"v{FORMAT_VERSION}; rebuild with `sinklm prepare-data ... --overwrite`"
        )
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in meta["splits"].values():
        for shard in split["shards"]:
            file = directory / shard["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != shard["tokens"] * itemsize:
                raise DataError(
                    f"{file}: {'missing' if size is None else f'{size} bytes'}, expected "
                    f"{shard['tokens'] * itemsize}; the folder is damaged, rebuild it with "
                    "`sinklm prepare-data ... --overwrite`"
                )
    return meta


def read_split(directory: str | Path, split: str, max_tokens: int | None = None) -> np.ndarray:
    """The first ``max_tokens`` (default all) tokens of one split, end-of-document ids included."""
    directory = Path(directory)
    meta = read_meta(directory)
    if split not in meta["splits"] or meta["splits"][split]["tokens"] == 0:
        have = [name for name, info in meta["splits"].items() if info["tokens"]]
        raise DataError(f"{directory}: no {split} tokens; splits with tokens: {have}")
    dtype = np.dtype(meta["dtype"])
    pieces, left = [], max_tokens
    for shard in meta["splits"][split]["shards"]:
        if left is not None and left <= 0:
            break
        tokens = np.memmap(directory / shard["file"], dtype=dtype, mode="r")
        pieces.append(np.array(tokens[:left]))
        left = None if left is None else left - len(pieces[-1])
    return np.concatenate(pieces).astype(np.int64)


def packed_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer a packed folder was built with (its own copy, so the folder can move)."""
    meta = read_meta(directory)
    tokenizer = load_tokenizer(Path(directory) / TOKENIZER_FILE)
    if tokenizer_hash(tokenizer) != meta["tokenizer_hash"]:
        raise DataError(
            f"{Path(directory) / TOKENIZER_FILE} does not match the hash in {META_FILE}; the "
            "folder was edited, rebuild it with `sinklm prepare-data ... --overwrite`"
        )
    return tokenizer


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _batches(source: Source | SyntheticSource, batch_chars: int) -> Iterator[list[str]]:
    """Regroup the source's rows into batches of about ``batch_chars`` characters."""
    pending: list[str] = []
    chars = 0
    for texts in source.iter_texts():
        pending.extend(texts)
        chars += sum(len(t) for t in texts)
        if chars >= batch_chars:
            yield pending
            pending, chars = [], 0
    if pending:
        yield pending


def prepare_data(
    config: PrepareConfig,
    tokenizer: Tokenizer | None = None,
    log: Callable[[str], None] | None = _stderr,
) -> dict[str, Any]:
    """Tokenize ``config.source`` into ``config.output`` (or reuse it) and return its meta.

    Every check (output folder, tokenizer, source files, reuse) runs before tokenization.
    ``tokenizer`` overrides ``config.tokenizer`` (a loaded object, e.g. in tests).
    """
    say = log or (lambda _message: None)
    output = Path(config.output).expanduser()
    if output.exists() and not output.is_dir():
        raise DataError(f"{output}: exists and is not a folder; choose another output")
    existing = output / META_FILE
    if output.is_dir() and any(output.iterdir()) and not existing.is_file():
        raise DataError(
            f"{output}: the folder is not empty and has no {META_FILE}; it is not packed data "
            "from sinklm, so it is left alone: choose a new or empty output folder"
        )
    source = open_source(config.source)
    if isinstance(source, SyntheticSource):
        origin, tokenizer = f"{source.spec.synthetic} (its own)", source.tokenizer
    elif tokenizer is None:
        origin = _tokenizer_location(config.tokenizer or DEFAULT_TOKENIZER)
        tokenizer = load_tokenizer(config.tokenizer or DEFAULT_TOKENIZER)
    else:
        origin = None
    eod = eod_token_id(tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    identity = {
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "source_fingerprint": source.fingerprint,
        "val_fraction": config.val_fraction,
        "seed": config.seed,
        "max_tokens": config.max_tokens,
    }
    if existing.is_file():
        meta = read_meta(output)
        changed = [key for key in _IDENTITY_KEYS if meta.get(key) != identity[key]]
        if not changed:
            say(f"reusing {output}: same tokenizer, source and settings")
            return meta
        if not config.overwrite:
            raise DataError(
                f"{output} was built from other inputs ({', '.join(changed)} changed); pass "
                "--overwrite to rebuild it, or choose another output folder"
            )
        say(f"rebuilding {output}: {', '.join(changed)} changed")

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        counts = _pack(source, tokenizer, eod, dtype, config, tmp, say)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **identity,
            "tokenizer": origin,
            "vocab_size": vocab_size,
            "eod_id": eod,
            "dtype": dtype.name,
            "source": config.source.to_dict(),
            "splits": counts["splits"],
            "skipped_empty_documents": counts["skipped"],
        }
        if isinstance(source, SyntheticSource):
            meta["generator"] = source.summary()
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _swap_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _tokenizer_location(spec: str) -> str:
    """A local tokenizer as an absolute path (meta.json is read from other folders); else as is."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _swap_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished folder over ``output``; the old one is removed only afterwards."""
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old)
    else:
        tmp.rename(output)


def _pack(
    source: Source | SyntheticSource,
    tokenizer: Tokenizer,
    eod: int,
    dtype: np.dtype,
    config: PrepareConfig,
    directory: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    writers = {s: _SplitWriter(directory, s, dtype, config.shard_tokens) for s in SPLITS}
    num_documents = source.num_documents
    fixed_validation = None
    if num_documents is not None:
        fixed_validation = np.zeros(num_documents, dtype=bool)
        fixed_validation[validation_documents(num_documents, config.val_fraction, config.seed)] = 1
    say(f"tokenizing {source.describe()} into {config.output}")
    start, last_report = time.perf_counter(), time.perf_counter()
    index = total = skipped = 0
    # Text that spells a special token ("<|endoftext|>") is encoded as plain text: only the
    # packer's own end-of-document ids may act as control tokens.
    saved_flag = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        for texts in _batches(source, config.batch_chars):
            indices = np.arange(index, index + len(texts))
            index += len(texts)
            if fixed_validation is not None:
                is_val = fixed_validation[indices]
            else:
                is_val = document_scores(config.seed, indices) < config.val_fraction
            keep = [i for i, text in enumerate(texts) if text.strip()]
            skipped += len(texts) - len(keep)
            encodings = tokenizer.encode_batch_fast(
                [texts[i] for i in keep], add_special_tokens=False
            )
            docs = [(enc.ids, bool(is_val[i])) for enc, i in zip(encodings, keep, strict=True)]
            if config.max_tokens is not None:
                docs = _cut_at(docs, config.max_tokens - total)
            for split, want_val in (("train", False), ("validation", True)):
                chosen = [ids for ids, val in docs if val == want_val]
                if chosen:
                    writers[split].write(_join(chosen, eod, dtype), len(chosen))
            total += sum(len(ids) + 1 for ids, _ in docs)
            now = time.perf_counter()
            if now - last_report > 10:
                say(f"  {index:,} documents, {total:,} tokens, "
                    f"{total / (now - start):,.0f} tokens/s")
                last_report = now
            if config.max_tokens is not None and total >= config.max_tokens:
                break
    finally:
        tokenizer.encode_special_tokens = saved_flag
        for writer in writers.values():
            writer.close()
    if total == 0:
        raise DataError(f"{source.describe()}: every document is empty; nothing to pack")
    elapsed = time.perf_counter() - start
    say(f"packed {index:,} documents, {total:,} tokens in {elapsed:.1f}s "
        f"({total / max(elapsed, 1e-9):,.0f} tokens/s)")
    return {"splits": {s: w.summary() for s, w in writers.items()}, "skipped": skipped}


def _cut_at(docs: list[tuple[list[int], bool]], budget: int) -> list[tuple[list[int], bool]]:
    """The documents up to and including the one that uses up ``budget`` tokens."""
    for n, (ids, _) in enumerate(docs):
        budget -= len(ids) + 1
        if budget <= 0:
            return docs[: n + 1]
    return docs


def _join(documents: list[list[int]], eod: int, dtype: np.dtype) -> np.ndarray:
    """Concatenate documents, each followed by the end-of-document id."""
    out = np.empty(sum(len(ids) + 1 for ids in documents), dtype=dtype)
    position = 0
    for ids in documents:
        out[position : position + len(ids)] = ids
        position += len(ids)
        out[position] = eod
        position += 1
    return out

