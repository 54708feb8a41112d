"""Pythia's pre-tokenized, pre-shuffled data: Megatron ``MMapIndexedDataset`` ``.bin``/``.idx``.

Pythia trained on ``EleutherAI/pile-deduped-pythia-preshuffled``: a ``document.bin`` of token
ids and a ``document.idx`` index whose sequences are 2049-token rows in training order. Step s
uses rows [s*1024, (s+1)*1024) (batch 1024, 2048 tokens + 1 label token each), so reading rows
in order with ``shuffle=False`` reproduces the paper's exact data order.

The ``.idx`` layout (little-endian), as GPT-NeoX and Megatron-LM write it::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
              (6 and 7 are floats, never token ids)
    u64       number of sequences n
    u64       number of document-index entries d
    i32[n]    sizes: tokens per sequence
    i64[n]    pointers: byte offset of each sequence in the .bin
    i64[d]    document index: first sequence of each document, then n
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import DataError
from .windows import text_tokens

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
PYTHIA_BATCH_SIZE = 1024
_HEADER = struct.Struct("<9sQBQQ")


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    """``prefix.bin`` and ``prefix.idx``; a prefix given with either suffix is accepted."""
    prefix = Path(prefix)
    if prefix.suffix in (".bin", ".idx"):
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


class MMapIndexedDataset:
    """Read-only, memory-mapped sequences of a Megatron ``.bin``/``.idx`` pair.

    ``dataset[i]`` is sequence i (for Pythia's files, row i of 2049 tokens); ``batch(step)``
    is the rows step ``step`` trained on.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.bin_path, self.idx_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"{path}: no such file (a Megatron dataset is a .bin/.idx pair)")
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        if index.size < _HEADER.size:
            raise DataError(f"{self.idx_path}: {index.size} bytes, too short for an index header")
        magic, version, code, n, d = _HEADER.unpack(index[: _HEADER.size].tobytes())
        if magic != MAGIC:
            raise DataError(
                f"{self.idx_path}: not a Megatron MMapIndexedDataset index (magic {magic!r}, "
                f"expected {MAGIC!r})"
            )
        if version != VERSION:
            raise DataError(f"{self.idx_path}: index version {version}, only {VERSION} is known")
        if code not in DTYPE_CODES:
            raise DataError(
                f"{self.idx_path}: dtype code {code} is not an integer token type "
                f"(known: {sorted(DTYPE_CODES)})"
            )
        expected = _HEADER.size + 12 * n + 8 * d
        if index.size != expected:
            raise DataError(
                f"{self.idx_path}: {index.size} bytes, but a header with {n} sequences and {d} "
                f"document entries needs {expected}; the file is truncated or not an index"
            )
        self.dtype = DTYPE_CODES[code]
        offset = _HEADER.size
        self.sizes = np.frombuffer(index, dtype=np.int32, count=n, offset=offset)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=n, offset=offset + 4 * n)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=d, offset=offset + 12 * n)
        self._index = index
        self._data = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        if n and self.pointers[-1] + int(self.sizes[-1]) * self.dtype.itemsize > (
            self._data.size * self.dtype.itemsize
        ):
            raise DataError(
                f"{self.bin_path}: shorter than its index says; the .bin is truncated or "
                "belongs to another index"
            )

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range [0, {len(self)})")
        start = int(self.pointers[index]) // self.dtype.itemsize
        return self._data[start : start + int(self.sizes[index])]

    def batch(self, step: int, batch_size: int = PYTHIA_BATCH_SIZE) -> np.ndarray:
        """The rows of training step ``step``: [step*batch_size, (step+1)*batch_size), stacked."""
        rows = range(step * batch_size, (step + 1) * batch_size)
        if rows.stop > len(self):
            raise DataError(
                f"step {step} needs rows up to {rows.stop - 1}, but {self.idx_path} has "
                f"{len(self)} rows"
            )
        return np.stack([self[i] for i in rows])


def write_mmap_indexed(
    prefix: str | Path, sequences: Sequence[np.ndarray], dtype: np.dtype | type = np.uint16,
    documents: Sequence[int] | None = None,
) -> None:
    """Write ``sequences`` as a Megatron ``.bin``/``.idx`` pair (the layout above).

    ``documents`` lists how many sequences each document has (default: one each), which is
    what the document index records. Used to convert data and to test the reader.
    """
    dtype = np.dtype(dtype)
    codes = {v: k for k, v in DTYPE_CODES.items()}
    if dtype not in codes:
        raise DataError(f"dtype {dtype}: the format stores {sorted(map(str, codes))}")
    bin_path, idx_path = _paths(prefix)
    sizes = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * dtype.itemsize
    counts = [1] * len(sequences) if documents is None else list(documents)
    if sum(counts) != len(sequences):
        raise DataError(f"documents add up to {sum(counts)} sequences, not {len(sequences)}")
    doc_idx = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    with open(bin_path, "wb") as f:
        for sequence in sequences:
            f.write(np.asarray(sequence).astype(dtype).tobytes())
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, codes[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(doc_idx.tobytes())


class MegatronRows:
    """Pythia's rows as training windows: the first ``seq_len - sink_tokens + 1`` tokens.

    With ``seq_len=2048`` and no sinks that is the whole 2049-token row, as Pythia trained;
    with k sink tokens the last k tokens of each row are dropped so the sequence stays 2048.
    Feed it to ``build_loader(..., shuffle=False)``: with B rows per step across all ranks,
    step s then trains on rows [s*B, (s+1)*B).
    """

    def __init__(self, prefix: str | Path, seq_len: int = 2048, sink_tokens: int = 0) -> None:
        self.data = MMapIndexedDataset(prefix)
        self.seq_len = seq_len
        self.sink_tokens = sink_tokens
        self.window = text_tokens(seq_len, sink_tokens)
        shortest = int(self.data.sizes.min()) if len(self.data) else 0
        if shortest < self.window + 1:
            raise DataError(
                f"{self.data.idx_path}: rows of {shortest} tokens cannot hold windows of "
                f"{self.window + 1} (seq_len={seq_len}, sink_tokens={sink_tokens}); use "
                f"seq_len <= {shortest - 1 + sink_tokens}"
            )

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> np.ndarray:
        return np.array(self.data[index][: self.window + 1])
