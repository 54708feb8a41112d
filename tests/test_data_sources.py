"""Sources: local files through datasets, up-front checks with clear errors, reflow."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sinklm.data import DataError, Source, SourceSpec, reflow


def texts_of(path: Path, tmp_path: Path, **options: object) -> list[str]:
    source = Source(SourceSpec(str(path), cache_dir=str(tmp_path / "cache"), **options))
    return [text for batch in source.iter_texts(batch_size=2) for text in batch]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_txt_file_is_one_document(tmp_path: Path) -> None:
    text = "First line\nsecond line\n\nA new paragraph.\n"
    (tmp_path / "a.txt").write_text(text)
    assert texts_of(tmp_path / "a.txt", tmp_path) == [text]


def test_jsonl_rows_are_documents_in_order(tmp_path: Path) -> None:
    rows = [{"id": i, "body": f"document {i} ünïcode"} for i in range(5)]
    for name in ("d.jsonl", "d.jsonl.gz"):
        path = write_jsonl(tmp_path / name, rows)
        assert texts_of(path, tmp_path, text_field="body") == [r["body"] for r in rows]


def test_parquet_and_mixed_folder(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["p1", "p2"], "n": [1, 2]}), folder / "sub" / "b.parquet")
    write_jsonl(folder / "c.jsonl", [{"text": "j1"}])
    (folder / "a.txt").write_text("t1")
    (folder / ".hidden.txt").write_text("never read")
    (folder / "notes.md").write_text("not a supported type")
    assert sorted(texts_of(folder, tmp_path)) == ["j1", "p1", "p2", "t1"]


def test_real_corpus_and_books(data_shared: Path, tmp_path: Path) -> None:
    corpus = data_shared / "corpus" / "english_pd_mix.jsonl.gz"
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        expected = [json.loads(line)["text"] for line in f]
    assert len(expected) == 138
    assert texts_of(corpus, tmp_path) == expected
    books = sorted((data_shared / "books").glob("*.txt"))
    assert texts_of(data_shared / "books", tmp_path) == [p.read_text("utf-8") for p in books]


def test_fingerprint_follows_content_and_options(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("one")
    first = Source(SourceSpec(str(path))).fingerprint
    assert Source(SourceSpec(str(path))).fingerprint == first
    assert Source(SourceSpec(str(path), reflow=True)).fingerprint != first
    path.write_text("two")
    assert Source(SourceSpec(str(path))).fingerprint != first


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("empty.txt", b"", "empty.txt: the file is empty"),
        ("blank.txt", b"  \n\n", "blank.txt: the file is empty"),
        ("latin1.txt", b"caf\xe9 ok", "latin1.txt: not valid UTF-8 (byte 0xe9 at byte offset 3)"),
        ("none.jsonl", b"\n", "none.jsonl: the file has no rows"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": \n', "bad.jsonl:2: not a JSON object"),
        ("latin1.jsonl", b'{"text": "a"}\n{"text": "\xe9"}\n', "latin1.jsonl:2: not valid UTF-8"),
        ("list.jsonl", b'[1, 2]\n', "list.jsonl:1: a JSON Lines row must be an object"),
        ("null.jsonl", b'{"text": null}\n', "null.jsonl:1: field 'text' is NoneType, not text"),
        ("notes.md", b"x", "notes.md: unsupported file type"),
    ],
)
def test_bad_files_name_the_file_and_fix(
    tmp_path: Path, name: str, content: bytes, expected: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=None) as error:
        Source(SourceSpec(str(path)))
    assert expected in str(error.value)
    assert str(tmp_path) in str(error.value)


def test_missing_text_field_lists_the_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "content": "x"}])
    with pytest.raises(DataError) as error:
        Source(SourceSpec(str(path)))
    message = str(error.value)
    assert "d.jsonl:1: no field 'text' (fields: id, content)" in message
    assert "--text-field" in message
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(columns: body\)"):
        Source(SourceSpec(str(tmp_path / "t.parquet")))


def test_one_bad_file_in_a_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DataError, match=r"b.txt: not valid UTF-8 \(byte 0xff at byte offset 0\)"):
        Source(SourceSpec(str(tmp_path)))


def test_missing_path_and_split_on_local_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or folder"):
        Source(SourceSpec(str(tmp_path / "nope.jsonl")))
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="local files form a single split"):
        Source(SourceSpec(str(tmp_path / "a.txt"), split="test"))
    with pytest.raises(DataError, match="unknown source keys"):
        SourceSpec.from_dict({"path": "x", "colum": "text"})


def test_reflow_joins_wrapped_lines_into_paragraphs() -> None:
    text = (
        "  It was the best of times,\nit was the worst of times,\r\n"
        "it was the age of wisdom.\n \n\n\tCHAPTER II\n\nThe Mail.\n"
    )
    assert reflow(text) == (
        "It was the best of times, it was the worst of times, it was the age of wisdom."
        "\n\nCHAPTER II\n\nThe Mail."
    )
    assert reflow("one line") == "one line"
    assert reflow("\n\n") == ""


def test_reflow_on_a_real_book_keeps_every_word(data_shared: Path) -> None:
    text = (data_shared / "books" / "frankenstein_shelley_pg84.txt").read_text("utf-8")
    flowed = reflow(text)
    assert flowed.split() == text.split()
    paragraphs = flowed.split("\n\n")
    assert all("\n" not in p for p in paragraphs)
    # Every paragraph of the original (a run of non-blank lines) is one line now.
    lines = text.split("\n")
    original = [
        " ".join(line.strip() for line in group)
        for nonblank, group in itertools.groupby(lines, key=lambda line: bool(line.strip()))
        if nonblank
    ]
    assert paragraphs == original
    assert flowed.count("\n") < text.count("\n") / 3


def test_reflow_option_applies_to_documents(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hard\nwrapped\n\nnext")
    assert texts_of(tmp_path / "a.txt", tmp_path, reflow=True) == ["hard wrapped\n\nnext"]


@pytest.fixture
def data_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub calls fail at once (offline mode) instead of retrying a missing network."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_datasets_take_the_same_path(
    data_offline: None, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    rows = {"content": ["first doc", "second\nwrapped doc"], "meta": ["a", "b"]}
    calls: list[tuple] = []

    def fake_hub(
        path: str, name: str | None = None, **options: Any
    ) -> datasets.Dataset | datasets.IterableDataset:
        calls.append((path, name, options["split"], options["streaming"], options["revision"]))
        local = datasets.Dataset.from_dict(rows)
        return local.to_iterable_dataset() if options["streaming"] else local

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    spec = SourceSpec("org/books", name="en", split="test", text_field="content",
                      streaming=streaming, revision="v1", reflow=True)
    source = Source(spec)
    texts = [t for batch in source.iter_texts() for t in batch]
    assert texts == ["first doc", "second wrapped doc"]
    assert calls == [("org/books", "en", "test", streaming, "v1")]
    assert source.num_documents == (None if streaming else 2)
    with pytest.raises(DataError, match=r"no field 'text' \(fields: content, meta\)"):
        Source(SourceSpec("org/books", streaming=streaming)).dataset  # noqa: B018


def test_unreachable_hub_dataset_is_a_clear_error(data_offline: None) -> None:
    source = Source(SourceSpec("EleutherAI/the_pile_deduplicated", streaming=True))
    with pytest.raises(DataError, match="cannot load Hub dataset 'EleutherAI/the_pile_dedup") as e:
        source.dataset  # noqa: B018
    assert "pass a local file or folder" in str(e.value)
