"""The results cache of ``sinklm compare``: one folder per checkpoint in ``DIR/cache/``, one file
per (checkpoint identity, setting).

A checkpoint is identified by its resolved path and the size and modification time of its
weight, config and tokenizer files (a Hub id by the id), a text by its contents. A retrained
checkpoint is therefore evaluated anew, and a rerun with another cache or task computes only
what is missing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sinklm.cli.outputs import write_atomic
from sinklm.models.load import locate

from .cache import CachePolicy
from .streaming import CacheResult
from .texts import check_packed, split_packed_spec

if TYPE_CHECKING:
    from .compare import Settings

# The cache's folder inside a compare output folder.
CACHE_DIR = "cache"
# The files of a checkpoint folder that make the model (results files beside it do not).
MODEL_FILES = ("config.json", "tokenizer.json", "*.safetensors", "*.safetensors.index.json",
               "*.bin", "*.bin.index.json", "*.py")
# Sink diagnostics: as `sinklm sinks` by default (windows of min(512, context) tokens).
SINK_WINDOW = 512
SINK_WINDOWS = 4
SINK_FIRST = 4
SINK_EPS = 0.3
# What a cached model description holds: its fields and the sink probe's training record.
MODEL_SETTING = {"fields": ["describe", "sink_token_ids", "training_sinks"]}

# A text's identity: a file by name and content hash, or a packed split by its fingerprints
# (and ``eod_first: true`` when its documents keep the end-of-document id in front).
Text = list[dict[str, str]]


def slug(text: str) -> str:
    """``text`` as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_identity(spec: str) -> dict[str, Any]:
    """What a checkpoint's results are keyed by: its path and the size and mtime of its model
    files (reading gigabytes to hash them would cost more than some evaluations)."""
    where = locate(spec, missing="file or folder")
    if where.kind == "hub":
        return {"hub": where.name}
    path = where.path
    if where.kind == "ckpt":
        files, root = [path], path.parent
    else:
        root = path
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and any(fnmatch(p.name, pattern) for pattern in MODEL_FILES))
    stats = [(p.relative_to(root).as_posix(), p.stat()) for p in files]
    return {"path": str(path.resolve()),
            "files": [[name, s.st_size, s.st_mtime_ns] for name, s in stats]}


def text_identity(settings: Settings) -> Text:
    """Each text by name and content hash (a moved copy of a book keeps its results), or the
    packed split by its source fingerprint and tokenizer, marked when its documents keep the
    end-of-document id in front (only then: results cached without it stay valid)."""
    if settings.packed is not None:
        meta = check_packed(settings.packed)
        folder, split = split_packed_spec(settings.packed)
        text = {"packed": folder.name, "split": split, "source": meta["source_fingerprint"],
                "tokenizer": meta["tokenizer_hash"]}
        return [{**text, "eod_first": True} if settings.eod_first else text]
    return [{"file": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in settings.texts]


@dataclass(frozen=True)
class Missing:
    """What one checkpoint lacks in the cache: caches to stream, the sinks, zero-shot tasks."""

    caches: list[CachePolicy]
    sinks: bool
    tasks: list[str]

    @property
    def count(self) -> int:
        """Results to compute, so a progress bar counts real work only."""
        return len(self.caches) + self.sinks + len(self.tasks)


class ModelCache:
    """One checkpoint's cache folder: its results by kind and setting, and its description
    (``describe`` is called, and may load the model, only when none is cached)."""

    def __init__(self, spec: str, root: Path, settings: Settings,
                 describe: Callable[[], dict[str, Any]]) -> None:
        self.spec = spec
        self.identity = checkpoint_identity(spec)
        key = _digest(self.identity)[:12]
        tail = "_".join(Path(spec).parts[-3:])
        self.folder = root / f"{slug(tail)}-{key}"
        self.settings = settings
        self._describe = describe

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The model's description (Checkpoint.describe, sink ids, the probe's record)."""
        meta = self._get("model", MODEL_SETTING)
        if meta is None:
            meta = self._describe()
            self._put("model", MODEL_SETTING, meta)
        return meta

    def _path(self, kind: str, setting: dict[str, Any], suffix: str = ".json") -> Path:
        return self.folder / f"{kind}-{_digest(setting)[:12]}{suffix}"

    def _get(self, kind: str, setting: dict[str, Any]) -> Any:
        """A cached result, or None; a file from another identity or setting is never used."""
        path = self._path(kind, setting)
        if not path.is_file():
            return None
        document = json.loads(path.read_text())
        if document.get("identity") != self.identity or document.get("setting") != setting:
            return None
        return document["result"]

    def _put(self, kind: str, setting: dict[str, Any], result: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        document = {"identity": self.identity, "setting": setting, "result": result}
        write_atomic(self._path(kind, setting), json.dumps(document, indent=1) + "\n")

    def missing(self, caches: Sequence[CachePolicy], text: Text) -> Missing:
        """What a comparison of ``caches`` on ``text`` (and the settings' tasks) must compute."""
        return Missing(caches=[p for p in caches if self.stream(p, text) is None],
                       sinks=self.sinks(text) is None,
                       tasks=[t for t in self.settings.tasks if self.zeroshot(t) is None])

    # --- streaming ---------------------------------------------------------------------------

    def _stream_setting(self, policy: CachePolicy, text: Text) -> dict[str, Any]:
        return {"text": text, "max_tokens": self.settings.max_tokens,
                "dtype": self.settings.dtype, "cache": policy.label}

    def stream(self, policy: CachePolicy, text: Text) -> CacheResult | None:
        setting = self._stream_setting(policy, text)
        row = self._get("stream", setting)
        losses = self._path("stream", setting, ".npy")
        if row is None or not losses.is_file():
            return None
        return CacheResult(policy, np.load(losses), row["seconds"], row.get("notes", []),
                           row.get("max_position"))

    def put_stream(self, result: CacheResult, text: Text) -> None:
        """The per-token losses (.npy) and the result's row, losses first."""
        setting = self._stream_setting(result.policy, text)
        self.folder.mkdir(parents=True, exist_ok=True)
        np.save(self._path("stream", setting, ".npy"), result.losses)
        self._put("stream", setting, result.to_json())

    # --- sinks -------------------------------------------------------------------------------

    @property
    def sink_window(self) -> int:
        return min(SINK_WINDOW, self.meta["max_seq_len"])

    def _sink_setting(self, text: Text) -> dict[str, Any]:
        return {"text": text, "window": self.sink_window, "windows": SINK_WINDOWS,
                "first": SINK_FIRST, "eps": SINK_EPS, "dtype": self.settings.dtype}

    def sinks(self, text: Text) -> dict[str, Any] | None:
        return self._get("sinks", self._sink_setting(text))

    def put_sinks(self, text: Text, report: dict[str, Any]) -> None:
        self._put("sinks", self._sink_setting(text), report)

    # --- zero-shot ---------------------------------------------------------------------------

    def _zeroshot_setting(self, task: str) -> dict[str, Any]:
        s = self.settings
        return {"task": task, "data_dir": str(s.data_dir.resolve()) if s.data_dir else None,
                "limit": s.limit, "dtype": s.dtype, "bootstrap_iters": s.bootstrap_iters}

    def zeroshot(self, task: str) -> dict[str, Any] | None:
        return self._get("zeroshot", self._zeroshot_setting(task))

    def put_zeroshot(self, task: str, row: dict[str, Any]) -> None:
        self._put("zeroshot", self._zeroshot_setting(task), row)
