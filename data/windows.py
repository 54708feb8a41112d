"""Training windows over packed tokens, the sink-token collator, and a resumable order.

A window holds ``seq_len - sink_tokens`` text tokens plus one more for the last label; the
collator puts the sink ids in front, so every sequence is exactly ``seq_len`` long and starts
with them. Consecutive windows share one token (as Megatron's samples do), so every token of
the stream is a target once, and once more from the sink at the start of the next window.

Where windows start (``windows``): ``stream`` cuts a fixed grid over the packed stream, so a
window mostly starts mid-document; ``documents`` starts one at every document start (the
end-of-document id that closed the previous document, or the split's first token) and every T
tokens after it within that document, as packed pretraining with document separators does.

The order is a permutation fixed by (seed, epoch), dealt across ranks without overlap, and the
loader remembers how far it got: ``state_dict``/``load_state_dict`` on the loader is the
protocol Lightning 2.x looks for on each train dataloader (``_Stateful``), saving the state in
every checkpoint and restoring it before the first batch when a fit resumes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .errors import DataError
from .packing import read_meta
from .sinks import SinkPrefix

IGNORE_INDEX = -100  # cross_entropy's default ignore_index: positions without a target
# How training windows meet documents: a fixed grid over the stream, or one at every document
# start (see the module's docstring).
WINDOWS = ("stream", "documents")
# Tokens read at a time when finding document starts: memory stays O(windows), not O(tokens).
SCAN_TOKENS = 1 << 24


class WindowDataset(Protocol):
    """What the loader needs from a dataset of windows (PackedDataset, MegatronRows)."""

    seq_len: int
    sink_tokens: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


def text_tokens(seq_len: int, sink_tokens: int) -> int:
    """Text tokens per window: ``seq_len - sink_tokens``, which must be at least one."""
    if sink_tokens < 0:
        raise DataError(f"sink_tokens={sink_tokens}: must be >= 0")
    if seq_len <= sink_tokens:
        raise DataError(
            f"seq_len={seq_len} leaves no room for text after {sink_tokens} sink token(s); "
            f"use seq_len > {sink_tokens}"
        )
    return seq_len - sink_tokens


def check_windows(windows: str, setting: str = "windows") -> str:
    """``windows`` if it is one of :data:`WINDOWS`, else a DataError naming them."""
    if windows not in WINDOWS:
        raise DataError(
            f"{setting}={windows!r}: unknown; use one of {', '.join(WINDOWS)} (stream: a fixed "
            "grid over the packed stream; documents: a window at every document start)"
        )
    return windows


def _grid(starts: np.ndarray, ends: np.ndarray, step: int) -> np.ndarray:
    """``start, start + step, ...`` below ``end`` for each (start, end), in order."""
    counts = (ends - starts + step - 1) // step
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(int(counts.sum())) - firsts) * step


def document_window_starts(
    chunks: Iterable[np.ndarray], total: int, eod_id: int, window: int
) -> np.ndarray:
    """Where the windows of ``windows="documents"`` start in a split of ``total`` tokens.

    A document starts at the split's first token and at every ``eod_id`` (the window begins
    with the end-of-document id that closed the previous document); it ends where the next one
    starts. Its windows start at its start and every ``window`` tokens after it within it (the
    last may run into the next document); starts whose ``window + 1`` tokens would run past the
    split's end are dropped. ``chunks`` are the split's tokens in order, in pieces of any size:
    memory is O(windows) however long the split.
    """
    pieces: list[np.ndarray] = []
    current, offset = 0, 0  # the start of the document being read; tokens read so far
    for chunk in chunks:
        eods = np.flatnonzero(chunk == eod_id).astype(np.int64) + offset
        offset += len(chunk)
        eods = eods[eods > current]  # an id at the split's very first token starts no new one
        if eods.size:
            pieces.append(_grid(np.concatenate([[current], eods[:-1]]), eods, window))
            current = int(eods[-1])
    if offset != total:
        raise DataError(f"read {offset} tokens of a split that should hold {total}; the packed "
                        "folder is damaged, rebuild it with `sinklm prepare-data ... --overwrite`")
    pieces.append(_grid(np.array([current], np.int64), np.array([total], np.int64), window))
    starts = np.concatenate(pieces)
    # Sorted: only the last few can run past the end.
    return starts[: int(np.searchsorted(starts, total - window, side="left"))]


class PackedDataset(Dataset):
    """Windows of ``seq_len - sink_tokens + 1`` tokens over one split of a packed folder.

    With ``windows="stream"`` item ``i`` is tokens [i*T, i*T + T + 1) of the split's stream
    (T text tokens per window); with ``windows="documents"`` it is the T + 1 tokens from the
    i-th start of :func:`document_window_starts`, found once, scanning the shards in chunks.
    Tokens are read from the memory-mapped shards (a window may straddle two shards). Pass
    ``tokenizer_hash`` to refuse shards built with another tokenizer.
    """

    def __init__(
        self,
        directory: str | Path,
        split: str = "train",
        seq_len: int = 2048,
        sink_tokens: int = 0,
        tokenizer_hash: str | None = None,
        windows: str = "stream",
    ) -> None:
        self.directory = Path(directory)
        self.split = split
        self.seq_len = seq_len
        self.sink_tokens = sink_tokens
        self.windows = check_windows(windows)
        self.window = text_tokens(seq_len, sink_tokens)
        meta = read_meta(self.directory)
        if tokenizer_hash is not None and meta["tokenizer_hash"] != tokenizer_hash:
            raise DataError(
                f"{self.directory} was packed with another tokenizer ({meta['tokenizer']}, hash "
                f"{meta['tokenizer_hash'][:12]}, not {tokenizer_hash[:12]}); re-run "
                "`sinklm prepare-data` with this tokenizer (--overwrite or a new --output)"
            )
        if split not in meta["splits"]:
            raise DataError(f"{self.directory}: no split '{split}'; have {list(meta['splits'])}")
        self.meta = meta
        info = meta["splits"][split]
        self.num_tokens: int = info["tokens"]
        if self.num_tokens < self.window + 1:
            raise DataError(
                f"{self.directory}: the {split} split has {self.num_tokens} tokens, fewer than "
                f"one window of {self.window + 1}; use a smaller seq_len or more data"
                + (" (or a validation fraction > 0)" if split == "validation" else "")
            )
        self.dtype = np.dtype(meta["dtype"])
        self._files = [self.directory / shard["file"] for shard in info["shards"]]
        sizes = [shard["tokens"] for shard in info["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: list[np.memmap] | None = None
        self.window_starts: np.ndarray | None = None  # set for windows="documents"
        if self.windows == "documents":
            if meta.get("eod_id") is None:
                raise DataError(
                    f"{self.directory}: meta.json records no eod_id, so its documents cannot be "
                    "found for windows=documents; re-pack it with `sinklm prepare-data ... "
                    "--overwrite`, or use windows=stream"
                )
            self.window_starts = document_window_starts(
                self._scan(), self.num_tokens, int(meta["eod_id"]), self.window
            )

    def _scan(self) -> Iterator[np.ndarray]:
        """The split's tokens in order, ``SCAN_TOKENS`` at a time (maps closed afterwards)."""
        for file in self._files:
            tokens = np.memmap(file, dtype=self.dtype, mode="r")
            for start in range(0, len(tokens), SCAN_TOKENS):
                yield np.asarray(tokens[start : start + SCAN_TOKENS])
            del tokens

    def __len__(self) -> int:
        if self.window_starts is not None:
            return len(self.window_starts)
        return (self.num_tokens - 1) // self.window

    def start(self, index: int) -> int:
        """Where window ``index`` starts in the split's stream."""
        if self.window_starts is not None:
            return int(self.window_starts[index])
        return index * self.window

    def _shards(self) -> list[np.memmap]:
        # Opened lazily, so each worker process maps the files itself instead of pickling them.
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self._files]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        return self.tokens(self.start(index), self.window + 1)

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the split's stream from ``start``, across shard boundaries."""
        shards = self._shards()
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces, position, end = [], start, start + count
        for shard in range(first, len(shards)):
            lo, hi = self._starts[shard], self._starts[shard + 1]
            pieces.append(shards[shard][position - lo : min(end, hi) - lo])
            position = min(end, hi)
            if position == end:
                break
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)


class SinkCollator:
    """Windows -> {"input_ids", "labels"} [B, seq_len], with the sink ids in front.

    ``labels[t]`` is the target of position t (already shifted), so the loss is
    ``cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)``. Positions whose
    target would be a sink get -100; the last sink predicts the first text token. A label equal
    to a sink id (text that spelled one) is ignored as well. With no sinks this is plain
    next-token prediction over the window.
    """

    def __init__(self, sink_ids: Sequence[int], seq_len: int) -> None:
        self.sinks = SinkPrefix(sink_ids)
        self.seq_len = seq_len
        self.window = text_tokens(seq_len, len(self.sinks))

    def __call__(self, windows: Sequence[np.ndarray]) -> dict[str, Tensor]:
        batch = torch.from_numpy(np.stack(windows).astype(np.int64))
        if batch.shape[1] != self.window + 1:
            raise DataError(
                f"windows of {batch.shape[1]} tokens, but seq_len={self.seq_len} with "
                f"{len(self.sinks)} sink(s) needs {self.window + 1}: build the dataset and the "
                "collator with the same seq_len and sink count"
            )
        k = len(self.sinks)
        if k == 0:
            return {"input_ids": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()}
        input_ids = self.sinks.prepend(batch[:, :-1])
        labels = torch.cat([torch.full((batch.shape[0], k - 1), IGNORE_INDEX), batch], dim=1)
        labels[self.sinks.is_sink(labels)] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


def _distributed_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    return (0 if rank is None else rank, 1 if world_size is None else world_size)


def _chunks(indices: np.ndarray, size: int = 1 << 16) -> Iterator[int]:
    """Python ints from a large index array without building one huge list."""
    for start in range(0, indices.size, size):
        yield from indices[start : start + size].tolist()


class ResumableSampler(DistributedSampler):
    """A seeded permutation per epoch, dealt round-robin across ranks, resumable mid-epoch.

    Epoch e visits ``permutation(seed, e)`` (or 0..n-1 without shuffle) with rank r taking
    items r, r + W, r + 2W, ... of it; the tail that does not divide by the world size W is
    dropped so ranks stay in step. The position is counted globally (``consumed`` items of
    the epoch across all ranks), so a checkpoint resumes on any rank and even on another world
    size when the count divides by it. A subclass of DistributedSampler only so that Lightning
    (``use_distributed_sampler``) does not wrap it in a second one.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
    ) -> None:
        rank, world_size = _distributed_defaults(rank, world_size)
        if num_samples < world_size:
            raise DataError(
                f"{num_samples} windows cannot be shared by {world_size} ranks; use more data "
                "or a shorter seq_len"
            )
        super().__init__(
            range(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
            seed=seed, drop_last=True,
        )
        self.size = num_samples
        self.consumed = 0

    @property
    def epoch_length(self) -> int:
        """Items each rank takes per epoch."""
        return self.size // self.num_replicas

    def __len__(self) -> int:
        return self.epoch_length

    @property
    def remaining(self) -> int:
        """Items this rank has left in the current epoch."""
        return self.epoch_length - self.consumed // self.num_replicas

    def order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order across ranks, before dealing."""
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def __iter__(self) -> Iterator[int]:
        limit = self.epoch_length * self.num_replicas
        if self.consumed >= limit:
            self.epoch, self.consumed = self.epoch + 1, 0
        positions = range(self.consumed + self.rank, limit, self.num_replicas)
        if not self.shuffle:
            return iter(positions)  # Pythia's 146M rows need no index array
        return _chunks(self.order(self.epoch)[positions.start : positions.stop : positions.step])

    def advance(self, items: int) -> None:
        """Count ``items`` more taken by every rank (called by the loader per batch)."""
        limit = self.epoch_length * self.num_replicas
        self.consumed = min(self.consumed + items * self.num_replicas, limit)

    def finish_epoch(self) -> None:
        """Mark the epoch done (the loader ran out), so the next pass starts the next one."""
        self.consumed = self.epoch_length * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch already in progress."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("num_samples", self.size), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise DataError(
                    f"the checkpoint's data order has {key}={state[key]}, this run has {mine}: "
                    "resume with the same packed data, seq_len, sink count, seed and shuffle"
                )
        if state["consumed"] % self.num_replicas:
            raise DataError(
                f"the checkpoint stopped after {state['consumed']} windows of the epoch, which "
                f"{self.num_replicas} ranks cannot split evenly; resume on a world size that "
                "divides it"
            )
        self.epoch, self.consumed = state["epoch"], state["consumed"]


class ResumableLoader(DataLoader):
    """A DataLoader that counts the batches it hands out, so a checkpoint can resume them.

    The count moves when a batch is yielded (not when workers prefetch it), so the state
    saved after training on batch k resumes at batch k + 1. ``len()`` stays the full epoch's
    batch count, as Lightning expects after a restore.
    """

    sampler: ResumableSampler

    def __iter__(self) -> Iterator[Any]:
        # A generator: the worker iterator (and the sampler's order) starts on the first
        # next(), after Lightning has called set_epoch and load_state_dict.
        sampler, batch_size = self.sampler, self.batch_size or 1
        if sampler.remaining < (batch_size if self.drop_last else 1):
            # Not a batch left (a consumer that stopped at len() never saw StopIteration).
            sampler.finish_epoch()
        for batch in super().__iter__():
            sampler.advance(batch_size)
            yield batch
        sampler.finish_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def build_loader(
    dataset: WindowDataset,
    batch_size: int,
    sink_ids: Sequence[int] = (),
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> ResumableLoader:
    """The loader the trainer uses: resumable order, sink collator, {"input_ids", "labels"}.

    ``rank``/``world_size`` default to torch.distributed's when it is initialised, else 0/1.
    Use ``shuffle=False, drop_last=False`` for validation.
    """
    if len(sink_ids) != dataset.sink_tokens:
        raise DataError(
            f"{len(sink_ids)} sink id(s) for a dataset built with sink_tokens="
            f"{dataset.sink_tokens}; pass sink_token_ids(tokenizer, {dataset.sink_tokens}, ...)"
        )
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size}: must be positive")
    sampler = ResumableSampler(len(dataset), seed, rank, world_size, shuffle)
    return ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=SinkCollator(sink_ids, dataset.seq_len),
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
