"""Where documents come from: a Hub dataset or local files, both read through ``datasets``.

A ``.txt`` file is one document; a JSON Lines row or a Parquet row is one document. Local files
are checked up front (empty, not UTF-8, missing or non-text field) so that a bad file stops
``prepare-data`` before any tokenization, with the file and the fix in the message. The same
scan hashes the contents, which is the source fingerprint that packed shards are tied to.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DataError
from .keys import reject_unknown_keys

if TYPE_CHECKING:  # imported where used: training from packed shards needs neither
    import datasets

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES

# Bump when the way text is read or transformed changes, so old shards are not reused.
READER_VERSION = 1
_CHUNK = 1 << 22
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


@dataclass(frozen=True)
class SourceSpec:
    """A document source: a Hub dataset id or a local file or folder.

    path:       Hub id (``EleutherAI/the_pile_deduplicated``) or a local file or folder.
    name:       the Hub dataset's config name (``load_dataset``'s ``name``).
    split:      the Hub split; local files are one split (carve validation out by fraction).
    text_field: the column holding the document text (``.txt`` files always give ``text``).
    streaming:  read rows as they download instead of preparing the whole set (the Pile).
    revision:   a Hub branch, tag or commit.
    reflow:     join hard-wrapped lines into paragraphs (see ``reflow``).
    cache_dir:  where ``datasets`` caches Arrow files (default: its own cache).
    """

    path: str
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    revision: str | None = None
    reflow: bool = False
    cache_dir: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SourceSpec:
        reject_unknown_keys(data, cls, "source keys", DataError)
        if not data.get("path"):
            raise DataError("the source needs 'path': a Hub dataset id or a local file or folder")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_local(self) -> bool:
        """A path that exists, or that is spelled like one (so a typo is not sent to the Hub)."""
        path = self.path
        return (
            Path(path).expanduser().exists()
            or path.startswith(("/", "./", "../", "~"))
            or path.endswith(SUPPORTED_SUFFIXES)
        )


def reflow(text: str) -> str:
    """Join hard-wrapped lines into one line per paragraph; blank lines separate paragraphs.

    Project Gutenberg text is wrapped at ~70 characters. In a small model every one of those
    newlines is a cheap, frequent token that draws attention like a sink, so studies of sinks
    want the wrapping gone. Paragraphs come out separated by one blank line; leading and
    trailing spaces of each line are dropped. Verse loses its line breaks too, so this is an
    option, not a default.
    """
    paragraphs = _BLANK_LINES.split(text.replace("\r\n", "\n").strip())
    joined = (" ".join(line.strip() for line in p.split("\n") if line.strip()) for p in paragraphs)
    return "\n\n".join(p for p in joined if p)


def local_files(path: Path) -> list[Path]:
    """The supported files at ``path`` (a file, or a folder searched recursively), sorted."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_file():
        if not path.name.endswith(SUPPORTED_SUFFIXES):
            raise DataError(
                f"{path}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}"
            )
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.name.endswith(SUPPORTED_SUFFIXES)
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(
            f"{path}: the folder holds no {', '.join(SUPPORTED_SUFFIXES)} files; point the "
            "source at a folder of documents or at one file"
        )
    return files


def _utf8_error(path: Path, where: str, raw: bytes, error: UnicodeDecodeError,
                offset: int) -> DataError:
    what = f"byte 0x{raw[error.start]:02x}" if error.start < len(raw) else "a cut-off character"
    return DataError(
        f"{path}{where}: not valid UTF-8 ({what} at byte offset {offset + error.start}); "
        "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
    )


def _scan_text(path: Path, digest: Any) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, has_text = 0, False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            digest.update(chunk)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                raise _utf8_error(path, "", chunk, error, offset) from None
            has_text = has_text or bool(text.strip())
            offset += len(chunk)
            if not chunk:
                break
    if not has_text:
        raise DataError(f"{path}: the file is empty (a .txt file is one document); remove it")


def _scan_json_lines(path: Path, text_field: str, digest: Any) -> None:
    opener = gzip.open if path.name.endswith(".gz") else open
    rows, offset = 0, 0
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                digest.update(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise _utf8_error(path, f":{number}", raw, error, offset) from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{path}:{number}: not a JSON object ({error.msg}); the file must hold "
                        "one JSON object per line (JSON Lines)"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: a JSON Lines row must be an object")
                if text_field not in row:
                    raise DataError(
                        f"{path}:{number}: no field '{text_field}' (fields: "
                        f"{', '.join(row) or 'none'}); pass the text field's name, e.g. "
                        f"--text-field {next(iter(row), 'text')}"
                    )
                if not isinstance(row[text_field], str):
                    raise DataError(
                        f"{path}:{number}: field '{text_field}' is "
                        f"{type(row[text_field]).__name__}, not text; fix the row or drop it"
                    )
                rows += 1
    except (gzip.BadGzipFile, EOFError) as error:
        raise DataError(f"{path}: not a readable gzip file ({error}); re-compress it") from None
    if rows == 0:
        raise DataError(f"{path}: the file has no rows; remove it")


def _scan_parquet(path: Path, text_field: str, digest: Any) -> None:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column '{text_field}' (columns: {', '.join(schema.names)}); pass the "
            "text column's name, e.g. --text-field NAME"
        )
    kind = str(schema.field(text_field).type)
    if kind not in ("string", "large_string", "string_view"):
        raise DataError(f"{path}: column '{text_field}' holds {kind}, not text")
    if parquet.metadata.num_rows == 0:
        raise DataError(f"{path}: the file has no rows; remove it")
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)


def check_local_files(files: list[Path], text_field: str, root: Path) -> str:
    """Validate every file (before any tokenization) and return a hash of their contents.

    Files are named relative to ``root`` in the hash, so moving the folder keeps it.
    """
    total = hashlib.sha256()
    for path in files:
        digest = hashlib.sha256()
        if path.name.endswith(TEXT_SUFFIXES):
            _scan_text(path, digest)
        elif path.name.endswith(JSON_SUFFIXES):
            _scan_json_lines(path, text_field, digest)
        else:
            _scan_parquet(path, text_field, digest)
        name = path.name if path == root else path.relative_to(root).as_posix()
        total.update(f"{name}\0{digest.hexdigest()}\n".encode())
    return total.hexdigest()


def _hub_revision(spec: SourceSpec) -> str:
    """The commit a Hub dataset resolves to, so a changed upstream is a changed source."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().dataset_info(spec.path, revision=spec.revision)
    except RevisionNotFoundError:
        raise DataError(
            f"Hub dataset '{spec.path}' has no revision '{spec.revision}'; check the revision"
        ) from None
    except RepositoryNotFoundError:
        raise DataError(
            f"'{spec.path}' is neither a local file or folder nor a Hub dataset; check the "
            "path or the dataset id"
        ) from None
    except Exception:
        # Offline or unreachable: datasets may still serve it from its cache, so fall back to
        # the revision as written; a moving branch then cannot be told apart from itself.
        return f"unresolved:{spec.revision or 'main'}"
    return info.sha or f"unresolved:{spec.revision or 'main'}"


def _load_local(spec: SourceSpec, files: list[Path]) -> datasets.Dataset | datasets.IterableDataset:
    import datasets

    parts = []
    groups = (
        ("text", TEXT_SUFFIXES, {"sample_by": "document", "encoding": "utf-8"}, "text"),
        ("json", JSON_SUFFIXES, {}, spec.text_field),
        ("parquet", PARQUET_SUFFIXES, {"columns": [spec.text_field]}, spec.text_field),
    )
    for builder, suffixes, options, column in groups:
        group = [str(p) for p in files if p.name.endswith(suffixes)]
        if not group:
            continue
        part = datasets.load_dataset(
            builder, data_files=group, split="train", streaming=spec.streaming,
            cache_dir=spec.cache_dir, **options,
        )
        parts.append(_text_column(part, column))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _text_column(
    ds: datasets.Dataset | datasets.IterableDataset, field: str
) -> datasets.Dataset | datasets.IterableDataset:
    ds = ds.select_columns([field])
    return ds if field == "text" else ds.rename_column(field, "text")


class Source:
    """A checked, fingerprinted source, readable as batches of document texts.

    Construction does the cheap checks (files scanned, Hub id resolved); ``dataset`` loads
    through ``datasets`` on first use, so a second ``prepare-data`` that reuses its shards
    never loads the data at all.
    """

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        self.files: list[Path] = []
        if spec.is_local:
            if spec.split != "train":
                raise DataError(
                    f"split '{spec.split}': local files form a single split; drop the split "
                    "and carve out validation data with a validation fraction"
                )
            root = Path(spec.path).expanduser()
            self.files = local_files(root)
            content = check_local_files(self.files, spec.text_field, root)
        else:
            content = _hub_revision(spec)
        identity = {
            "reader": READER_VERSION,
            "content": content,
            "hub": None if spec.is_local else [spec.path, spec.name, spec.split],
            "text_field": spec.text_field,
            "reflow": spec.reflow,
        }
        self.fingerprint = hashlib.sha256(
            json.dumps(identity, sort_keys=True).encode()
        ).hexdigest()
        self._dataset: datasets.Dataset | datasets.IterableDataset | None = None

    @property
    def dataset(self) -> datasets.Dataset | datasets.IterableDataset:
        """The documents as a ``datasets`` object with a single ``text`` column."""
        if self._dataset is None:
            self._dataset = _load_local(self.spec, self.files) if self.files else self._load_hub()
        return self._dataset

    def _load_hub(self) -> datasets.Dataset | datasets.IterableDataset:
        import datasets

        spec = self.spec
        try:
            ds = datasets.load_dataset(
                spec.path, spec.name, split=spec.split, streaming=spec.streaming,
                revision=spec.revision, cache_dir=spec.cache_dir,
            )
        except Exception as error:
            raise DataError(
                f"cannot load Hub dataset '{spec.path}' (config {spec.name}, split "
                f"{spec.split}): {type(error).__name__}: {error}. Check the id, config and "
                "split and the network, or pass a local file or folder"
            ) from None
        columns = ds.column_names
        if columns is None:  # a streamed set whose schema is only known from its rows
            columns = list(next(iter(ds.take(1)), {}))
        if spec.text_field not in columns:
            raise DataError(
                f"Hub dataset '{spec.path}' has no field '{spec.text_field}' (fields: "
                f"{', '.join(columns)}); pass the text field's name, e.g. --text-field NAME"
            )
        return _text_column(ds, spec.text_field)

    @property
    def num_documents(self) -> int | None:
        """The number of rows, when known without reading them all (not when streaming)."""
        import datasets

        ds = self.dataset
        return len(ds) if isinstance(ds, datasets.Dataset) else None

    def describe(self) -> str:
        spec = self.spec
        if self.files:
            return f"{spec.path} ({len(self.files)} file{'s' * (len(self.files) != 1)})"
        return f"{spec.path}" + (f" [{spec.name}]" if spec.name else "") + f" split {spec.split}"

    def iter_texts(self, batch_size: int = 64) -> Iterator[list[str]]:
        """Document texts in source order, in batches, with ``reflow`` applied if asked."""
        row = 0
        for batch in self.dataset.iter(batch_size=batch_size):
            texts = batch["text"]
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.describe()}: row {row + i} has no text in '{self.spec.text_field}' "
                        f"({type(text).__name__}); fix or drop the row"
                    )
            row += len(texts)
            yield [reflow(t) for t in texts] if self.spec.reflow else texts
