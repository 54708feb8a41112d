"""Packing: counts against the tokenizer's own encoding, the split, reuse, refusal, atomicity."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from sinklm.data import (
    DataError,
    PrepareConfig,
    SourceSpec,
    load_tokenizer,
    packed_tokenizer,
    prepare_data,
    train_tokenizer,
)
from sinklm.data import sources as sources_module
from sinklm.data.packing import document_scores

SENTENCE = "The quick brown fox, aged {i}, jumps over {n} lazy dogs near the river bank. "


def documents(count: int) -> list[str]:
    return [f"Document {i}.\n" + SENTENCE.format(i=i, n=i * 7) * (i % 5 + 1) for i in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def read_split(directory: Path, split: str) -> np.ndarray:
    meta = json.loads((directory / "meta.json").read_text())
    parts = [np.fromfile(directory / s["file"], dtype=meta["dtype"])
             for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=meta["dtype"])


def split_documents(stream: np.ndarray, eod: int = 0) -> list[list[int]]:
    """Cut a packed stream at its end-of-document ids (which every document ends with)."""
    assert stream.size == 0 or stream[-1] == eod
    ends = np.flatnonzero(stream == eod)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[s:e].tolist() for s, e in zip(starts, ends, strict=True)]


def config(source: Path, output: Path, **changes: object) -> PrepareConfig:
    spec = SourceSpec(str(source), cache_dir=str(output.parent / "hf-cache"),
                      streaming=bool(changes.pop("streaming", False)))
    return PrepareConfig(source=spec, output=str(output), **changes)


@pytest.fixture
def neox(data_neox_path: Path) -> Tokenizer:
    return load_tokenizer(data_neox_path)


def test_books_match_the_tokenizers_own_encoding(
    data_shared: Path, neox: Tokenizer, tmp_path: Path
) -> None:
    books = sorted((data_shared / "books").glob("*.txt"))
    meta = prepare_data(config(data_shared / "books", tmp_path / "out"), tokenizer=neox, log=None)
    expected = [neox.encode(p.read_text("utf-8")).ids for p in books]
    assert [len(ids) for ids in expected] == [196501, 100919, 171630]  # SOURCES.md's counts
    stream = read_split(tmp_path / "out", "train")
    assert stream.dtype == np.uint16
    assert split_documents(stream) == expected
    assert meta["splits"]["train"] == {
        "documents": 3,
        "tokens": 196501 + 100919 + 171630 + 3,
        "shards": [{"file": "train-00000.bin", "tokens": 469053}],
    }
    assert meta["splits"]["validation"]["tokens"] == 0
    assert (meta["eod_id"], meta["vocab_size"], meta["dtype"]) == (0, 50277, "uint16")
    assert meta["tokenizer"] is None  # given as an object; the folder keeps its own copy
    assert packed_tokenizer(tmp_path / "out").encode("Hello world").ids == [12092, 1533]


def test_validation_split_is_by_document_exact_and_seeded(neox: Tokenizer, tmp_path: Path) -> None:
    texts = documents(50)
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    encoded = {tuple(neox.encode(t).ids): i for i, t in enumerate(texts)}
    meta = prepare_data(config(source, tmp_path / "a", val_fraction=0.2, seed=7), neox, log=None)
    train = [encoded[tuple(d)] for d in split_documents(read_split(tmp_path / "a", "train"))]
    val = [encoded[tuple(d)] for d in split_documents(read_split(tmp_path / "a", "validation"))]
    assert len(val) == 10 and len(train) == 40  # round(0.2 * 50), every document once
    assert sorted(train + val) == list(range(50))
    assert train == sorted(train) and val == sorted(val)  # source order kept within a split
    assert meta["splits"]["validation"]["documents"] == 10
    assert meta["splits"]["validation"]["tokens"] == sum(len(neox.encode(texts[i]).ids) + 1
                                                         for i in val)
    # The split depends on the seed only: not on batch sizes.
    prepare_data(config(source, tmp_path / "b", val_fraction=0.2, seed=7, batch_chars=300),
                 neox, log=None)
    for split in ("train", "validation"):
        assert np.array_equal(read_split(tmp_path / "a", split), read_split(tmp_path / "b", split))
    prepare_data(config(source, tmp_path / "c", val_fraction=0.2, seed=8), neox, log=None)
    assert not np.array_equal(read_split(tmp_path / "c", "validation"),
                              read_split(tmp_path / "a", "validation"))


def test_streamed_source_splits_by_score(neox: Tokenizer, tmp_path: Path) -> None:
    texts = documents(60)
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    cfg = config(source, tmp_path / "s", val_fraction=0.3, seed=3, streaming=True, batch_chars=500)
    meta = prepare_data(cfg, neox, log=None)
    chosen = np.flatnonzero(document_scores(3, np.arange(60)) < 0.3).tolist()
    val = split_documents(read_split(tmp_path / "s", "validation"))
    assert val == [neox.encode(texts[i]).ids for i in chosen]
    assert meta["splits"]["train"]["documents"] + len(chosen) == 60
    # The scores are uniform: about 30% of many documents.
    assert abs(np.mean(document_scores(3, np.arange(20000)) < 0.3) - 0.3) < 0.02


def test_rerun_reuses_and_other_inputs_are_refused(
    neox: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", documents(8))
    out = tmp_path / "out"
    first = prepare_data(config(source, out), neox)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare_data(config(source, out), neox) == first
    assert "reusing" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    other = neox.from_str(neox.to_str())
    other.add_tokens(["river bank"])
    with pytest.raises(DataError, match=r"tokenizer_hash changed\); pass --overwrite"):
        prepare_data(config(source, out), other, log=None)
    with pytest.raises(DataError, match="val_fraction, seed changed"):
        prepare_data(config(source, out, val_fraction=0.5, seed=1), neox, log=None)
    write_jsonl(source, documents(9))
    with pytest.raises(DataError, match="source_fingerprint changed"):
        prepare_data(config(source, out), neox, log=None)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # untouched

    rebuilt = prepare_data(config(source, out, overwrite=True), other, log=None)
    assert rebuilt["splits"]["train"]["documents"] == 9
    assert rebuilt["tokenizer_hash"] != first["tokenizer_hash"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_interrupted_run_leaves_the_old_folder_intact(
    neox: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", documents(8))
    out = tmp_path / "out"
    prepare_data(config(source, out), neox, log=None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(self: sources_module.Source, batch_size: int = 64) -> Iterator[list[str]]:
        yield ["a first document"]
        raise KeyboardInterrupt

    monkeypatch.setattr(sources_module.Source, "iter_texts", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(config(source, out, seed=5, overwrite=True), neox, log=None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_shards_split_at_the_size_limit(neox: Tokenizer, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", documents(20))
    whole = prepare_data(config(source, tmp_path / "one"), neox, log=None)
    meta = prepare_data(config(source, tmp_path / "many", shard_tokens=100), neox, log=None)
    shards = meta["splits"]["train"]["shards"]
    total = whole["splits"]["train"]["tokens"]
    expected = [100] * (total // 100) + ([total % 100] if total % 100 else [])
    assert [s["tokens"] for s in shards] == expected
    assert all((tmp_path / "many" / s["file"]).stat().st_size == 2 * s["tokens"] for s in shards)
    assert np.array_equal(read_split(tmp_path / "many", "train"),
                          read_split(tmp_path / "one", "train"))


def test_max_tokens_stops_after_the_document_that_reaches_it(
    neox: Tokenizer, tmp_path: Path
) -> None:
    texts = documents(30)
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    sizes = np.cumsum([len(neox.encode(t).ids) + 1 for t in texts])
    meta = prepare_data(config(source, tmp_path / "o", max_tokens=int(sizes[9]) - 1,
                               batch_chars=700), neox, log=None)
    assert meta["splits"]["train"] == {**meta["splits"]["train"], "documents": 10,
                                       "tokens": int(sizes[9])}


def test_empty_documents_are_skipped_and_special_text_stays_text(
    neox: Tokenizer, tmp_path: Path
) -> None:
    texts = ["Hello world", "   ", "", "a <|endoftext|> b"]
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    meta = prepare_data(config(source, tmp_path / "o"), neox, log=None)
    stream = read_split(tmp_path / "o", "train").tolist()
    special_free = neox.from_str(neox.to_str())
    special_free.encode_special_tokens = True
    assert stream == [12092, 1533, 0, *special_free.encode("a <|endoftext|> b").ids, 0]
    assert stream.count(0) == 2  # only the packer's own end-of-document ids
    assert meta["skipped_empty_documents"] == 2
    write_jsonl(source, ["", "  "])
    with pytest.raises(DataError, match="every document is empty"):
        prepare_data(config(source, tmp_path / "e"), neox, log=None)
    assert not (tmp_path / "e").exists()


def test_large_vocabularies_pack_as_uint32(neox: Tokenizer, tmp_path: Path) -> None:
    big = neox.from_str(neox.to_str())
    big.add_tokens([f"zqx{i}" for i in range(65536 - 50277 + 10)])
    assert big.get_vocab_size() > 65536
    source = write_jsonl(tmp_path / "docs.jsonl", ["tokens zqx15268 and zqx0 here"])
    meta = prepare_data(config(source, tmp_path / "o"), big, log=None)
    assert meta["dtype"] == "uint32"
    expected = [*big.encode("tokens zqx15268 and zqx0 here").ids, 0]
    assert read_split(tmp_path / "o", "train").tolist() == expected
    assert 65545 in read_split(tmp_path / "o", "train").tolist()


def test_output_folders_that_are_not_ours_are_left_alone(neox: Tokenizer, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", documents(3))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("precious")
    with pytest.raises(DataError, match=r"not empty and has no meta\.json"):
        prepare_data(config(source, tmp_path / "busy", overwrite=True), neox, log=None)
    assert (tmp_path / "busy" / "thesis.tex").read_text() == "precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is not a folder"):
        prepare_data(config(source, tmp_path / "file"), neox, log=None)
    (tmp_path / "empty").mkdir()
    assert prepare_data(config(source, tmp_path / "empty"), neox, log=None)["splits"]


def test_bad_settings_fail_before_any_work(tmp_path: Path) -> None:
    spec = SourceSpec(str(tmp_path / "x.jsonl"))
    with pytest.raises(DataError, match=r"val_fraction=1.5: must lie in \[0, 1\]"):
        PrepareConfig(source=spec, output=str(tmp_path / "o"), val_fraction=1.5)
    with pytest.raises(DataError, match="needs source and output"):
        PrepareConfig.from_dict({})
    source = write_jsonl(tmp_path / "one.jsonl", ["only one"])
    with pytest.raises(DataError, match="too few to split by document"):
        prepare_data(config(source, tmp_path / "o", val_fraction=0.5),
                     train_tokenizer(["only one document here"], 270), log=None)
    assert not (tmp_path / "o").exists()


def test_the_folder_keeps_the_exact_tokenizer(neox: Tokenizer, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", documents(3))
    prepare_data(config(source, tmp_path / "o"), neox, log=None)
    copy = packed_tokenizer(tmp_path / "o")
    assert copy.to_str() == neox.to_str()
    train_tokenizer(documents(3), 280).save(str(tmp_path / "o" / "tokenizer.json"))
    with pytest.raises(DataError, match=r"does not match the hash in meta\.json"):
        packed_tokenizer(tmp_path / "o")
