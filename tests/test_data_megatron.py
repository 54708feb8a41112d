"""Pythia's Megatron .bin/.idx: the documented byte layout, rows, and step order."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from sinklm.data import DataError, MegatronRows, MMapIndexedDataset, build_loader
from sinklm.data.megatron import write_mmap_indexed


def write_by_hand(prefix: Path, rows: np.ndarray) -> None:
    """The format written straight from its description (not with the module's writer)."""
    n, length = rows.shape
    prefix.with_suffix(".bin").write_bytes(rows.astype("<u2").tobytes())
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    header += struct.pack("<Q", n) + struct.pack("<Q", n + 1)
    sizes = np.full(n, length, dtype="<i4").tobytes()
    pointers = (np.arange(n, dtype="<i8") * length * 2).tobytes()
    doc_idx = np.arange(n + 1, dtype="<i8").tobytes()
    prefix.with_suffix(".idx").write_bytes(header + sizes + pointers + doc_idx)


def pythia_like(rows: int, length: int = 2049) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 50277, size=(rows, length), dtype=np.int64)


def test_reads_a_hand_written_pythia_file(tmp_path: Path) -> None:
    rows = pythia_like(2 * 1024 + 5)
    write_by_hand(tmp_path / "document", rows)
    data = MMapIndexedDataset(tmp_path / "document")
    assert len(data) == rows.shape[0]
    assert data.dtype == np.uint16
    assert np.array_equal(data[7], rows[7])
    assert np.array_equal(data.batch(1), rows[1024:2048])  # step 1 = rows [1024, 2048)
    assert np.array_equal(data.batch(0, batch_size=3), rows[:3])
    with pytest.raises(DataError, match="step 2 needs rows up to 3071"):
        data.batch(2)
    assert np.array_equal(MMapIndexedDataset(tmp_path / "document.idx")[0], rows[0])


def test_writer_produces_the_documented_bytes(tmp_path: Path) -> None:
    rows = pythia_like(6, length=9)
    write_by_hand(tmp_path / "hand", rows)
    write_mmap_indexed(tmp_path / "ours", list(rows), np.uint16)
    for suffix in (".bin", ".idx"):
        ours, hand = tmp_path / f"ours{suffix}", tmp_path / f"hand{suffix}"
        assert ours.read_bytes() == hand.read_bytes()


def test_variable_sizes_documents_and_wide_dtypes(tmp_path: Path) -> None:
    sequences = [np.arange(3), np.arange(5) + 70000, np.arange(1)]
    write_mmap_indexed(tmp_path / "v", sequences, np.int32, documents=[2, 1])
    data = MMapIndexedDataset(tmp_path / "v")
    assert data.dtype == np.int32
    assert [data[i].tolist() for i in range(3)] == [s.tolist() for s in sequences]
    assert data.doc_idx.tolist() == [0, 2, 3]
    assert data.pointers.tolist() == [0, 12, 32]


def test_rows_become_windows_and_steps_keep_pythias_order(tmp_path: Path) -> None:
    rows = pythia_like(24, length=65)
    write_mmap_indexed(tmp_path / "d", list(rows))
    plain = MegatronRows(tmp_path / "d", seq_len=64)
    assert np.array_equal(plain[3], rows[3])
    sink = MegatronRows(tmp_path / "d", seq_len=64, sink_tokens=1)
    assert np.array_equal(sink[3], rows[3, :64])
    # Global batch 8 over 2 ranks of 4: step s trains on rows [8s, 8s + 8), as Pythia did.
    loaders = [build_loader(sink, 4, [50277], shuffle=False, rank=r, world_size=2)
               for r in range(2)]
    for step, batches in enumerate(zip(*loaders, strict=True)):
        seen = torch.cat([b["input_ids"][:, 1:] for b in batches])
        expected = torch.from_numpy(rows[8 * step : 8 * step + 8, :63])
        assert torch.equal(seen[seen[:, 0].argsort()], expected[expected[:, 0].argsort()])
        assert torch.all(torch.cat([b["input_ids"][:, 0] for b in batches]) == 50277)
    with pytest.raises(DataError, match="rows of 65 tokens cannot hold windows of 66"):
        MegatronRows(tmp_path / "d", seq_len=65)


def test_bad_files_are_named(tmp_path: Path) -> None:
    write_mmap_indexed(tmp_path / "d", list(pythia_like(4, length=9)))
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "magic.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    (tmp_path / "magic.bin").write_bytes((tmp_path / "d.bin").read_bytes())
    with pytest.raises(DataError, match=r"magic\.idx: not a Megatron MMapIndexedDataset index"):
        MMapIndexedDataset(tmp_path / "magic")
    (tmp_path / "cut.idx").write_bytes(idx[:-8])
    (tmp_path / "cut.bin").write_bytes((tmp_path / "d.bin").read_bytes())
    with pytest.raises(DataError, match=r"cut\.idx: .* the file is truncated"):
        MMapIndexedDataset(tmp_path / "cut")
    (tmp_path / "short.idx").write_bytes(idx)
    (tmp_path / "short.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"short\.bin: shorter than its index says"):
        MMapIndexedDataset(tmp_path / "short")
    (tmp_path / "float.idx").write_bytes(idx[:17] + bytes([7]) + idx[18:])
    (tmp_path / "float.bin").write_bytes((tmp_path / "d.bin").read_bytes())
    with pytest.raises(DataError, match="dtype code 7 is not an integer token type"):
        MMapIndexedDataset(tmp_path / "float")
    with pytest.raises(DataError, match=r"nothing\.idx: no such file"):
        MMapIndexedDataset(tmp_path / "nothing")
