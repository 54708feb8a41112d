"""``data.windows: documents`` (a training window at every document start, beginning with the
end-of-document id) and the matching evaluation streams (``--eod-first``), against windows
worked out by hand on a small hand-packed folder; ``stream`` stays the fixed grid."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.train_data import TinyData, tiny_config
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from sinklm.cli.main import main as sinklm_main
from sinklm.data import DataError, PackedDataset, SinkCollator, read_meta
from sinklm.data import windows as windows_module
from sinklm.data.packing import FORMAT, FORMAT_VERSION, META_FILE, TOKENIZER_FILE
from sinklm.data.sinks import SinkPrefix
from sinklm.data.tokenizer import tokenizer_hash
from sinklm.data.windows import document_window_starts
from sinklm.eval.compare_cache import text_identity
from sinklm.eval.texts import eod_first_note, packed_streams, trained_windows
from sinklm.models.checkpoint import CHECKPOINT_KEY, DATA_KEY
from sinklm.models.config import ConfigError
from sinklm.train.data_module import SinkLMDataModule
from sinklm.train.fit import run_fit
from sinklm.train.fit_cli import check_resume_compatible, model_config, resume_differences

EOD = 0
# Documents of 3, 7, 1, 4 and 10 tokens (ids from 1 on), each followed by EOD, as packed:
#   position: 0-2 doc0 | 3 EOD | 4-10 doc1 | 11 EOD | 12 doc2 | 13 EOD | 14-17 doc3 | 18 EOD |
#             19-28 doc4 | 29 EOD                                          (30 tokens)
LENGTHS = (3, 7, 1, 4, 10)
# With T = 4 text tokens per window: documents start at 0, 3, 11, 13, 18 and 29; windows at
# 0 | 3, 7 | 11 | 13, 17 | 18, 22, (26) | (29): 26 and 29 would run past the 30th token.
STARTS_T4 = [0, 3, 7, 11, 13, 17, 18, 22]


def documents(lengths: tuple[int, ...], first: int = 1) -> list[list[int]]:
    """Documents of the given lengths with ids counting up from ``first`` (wrapping below 40)."""
    out, next_id = [], first
    for length in lengths:
        out.append([(next_id + i - 1) % 39 + 1 for i in range(length)])
        next_id += length
    return out


def packed_tokens(docs: list[list[int]]) -> np.ndarray:
    return np.array([t for doc in docs for t in [*doc, EOD]], dtype=np.int64)


def word_tokenizer() -> Tokenizer:
    vocab = {"<|endoftext|>": EOD, **{f"w{i}": i for i in range(1, 40)}, "[UNK]": 40}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


def write_packed(root: Path, splits: dict[str, list[list[int]]], shard_tokens: int = 1 << 20,
                 eod_id: int | None = EOD) -> Path:
    """A packed folder as prepare-data writes it, from documents given as ids."""
    root.mkdir(parents=True)
    tokenizer = word_tokenizer()
    tokenizer.save(str(root / TOKENIZER_FILE))
    meta_splits = {}
    for split, docs in splits.items():
        tokens = packed_tokens(docs).astype(np.uint16)
        shards = []
        for i, start in enumerate(range(0, len(tokens), shard_tokens)):
            piece = tokens[start : start + shard_tokens]
            name = f"{split}-{i:05d}.bin"
            piece.tofile(root / name)
            shards.append({"file": name, "tokens": len(piece)})
        meta_splits[split] = {"documents": len(docs), "tokens": len(tokens), "shards": shards}
    meta = {"format": FORMAT, "version": FORMAT_VERSION,
            "tokenizer_hash": tokenizer_hash(tokenizer), "source_fingerprint": "by-hand",
            "val_fraction": 0.5, "seed": 0, "max_tokens": None, "tokenizer": None,
            "vocab_size": 41, "eod_id": eod_id, "dtype": "uint16", "source": {},
            "splits": meta_splits, "skipped_empty_documents": 0}
    if eod_id is None:
        del meta["eod_id"]
    (root / META_FILE).write_text(json.dumps(meta))
    read_meta(root)  # as the pipeline checks it
    return root


@pytest.fixture
def by_hand(tmp_path: Path) -> Path:
    """LENGTHS in train (shards of 7 tokens: windows straddle them) and in validation."""
    docs = documents(LENGTHS)
    return write_packed(tmp_path / "packed", {"train": docs, "validation": docs}, shard_tokens=7)


def reference_starts(tokens: np.ndarray, window: int) -> list[int]:
    """The rule, one document at a time."""
    bounds = [0, *[int(p) for p in np.flatnonzero(tokens == EOD) if p > 0], len(tokens)]
    starts = []
    for start, end in itertools.pairwise(bounds):
        starts += [s for s in range(start, end, window) if s + window + 1 <= len(tokens)]
    return starts


def test_document_windows_by_hand(by_hand: Path) -> None:
    tokens = packed_tokens(documents(LENGTHS))
    ds = PackedDataset(by_hand, "train", seq_len=4, windows="documents")
    assert ds.window_starts.tolist() == STARTS_T4 and len(ds) == len(STARTS_T4)
    for i, start in enumerate(STARTS_T4):
        assert np.array_equal(ds[i], tokens[start : start + 5])
    # Written out: every window but the first begins with the EOD that closed a document (or,
    # within a long one, T tokens after it); a short document's window runs into the next.
    assert ds[1].tolist() == [EOD, 4, 5, 6, 7]
    assert ds[3].tolist() == [EOD, 11, EOD, 12, 13]
    assert ds[0].tolist() == [1, 2, 3, EOD, 4]
    with pytest.raises(IndexError):
        ds[len(ds)]
    # Other T: 2 text tokens (3 per window), and one window of 29 + 1 over everything.
    assert PackedDataset(by_hand, "train", 2, windows="documents").window_starts.tolist() == [
        0, 2, 3, 5, 7, 9, 11, 13, 15, 17, 18, 20, 22, 24, 26]
    assert PackedDataset(by_hand, "train", 29, windows="documents").window_starts.tolist() == [0]


def test_every_token_is_a_target(by_hand: Path, tmp_path: Path) -> None:
    """Each position after the first is a target of some window, up to a tail shorter than a
    window at the split's end (the stream grid drops such a tail too)."""
    rng = np.random.default_rng(0)
    lengths = tuple(int(n) for n in rng.integers(1, 30, size=60))
    folder = write_packed(tmp_path / "random", {"train": documents(lengths)}, shard_tokens=50)
    tokens = packed_tokens(documents(lengths))
    for seq_len, sinks in ((5, 0), (12, 1), (9, 2)):
        ds = PackedDataset(folder, "train", seq_len, sinks, windows="documents")
        window = seq_len - sinks
        assert ds.window_starts.tolist() == reference_starts(tokens, window)
        targeted = np.zeros(len(tokens), bool)
        for start in ds.window_starts:
            targeted[start + 1 : start + window + 1] = True
        last = int(ds.window_starts[-1]) + window
        assert targeted[1 : last + 1].all() and not targeted[0]
        assert len(tokens) - 1 - last < window
        doc_starts = [0, *(p for p in np.flatnonzero(tokens == EOD) if p + window < len(tokens))]
        assert set(doc_starts) <= set(ds.window_starts.tolist())


def test_the_scan_reads_in_chunks(by_hand: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of any size (here 1 to 11 tokens, across 7-token shards) find the same starts."""
    tokens = packed_tokens(documents(LENGTHS))
    for chunk in (1, 2, 3, 11, len(tokens)):
        pieces = [tokens[i : i + chunk] for i in range(0, len(tokens), chunk)]
        assert document_window_starts(pieces, len(tokens), EOD, 4).tolist() == STARTS_T4
        monkeypatch.setattr(windows_module, "SCAN_TOKENS", chunk)
        assert PackedDataset(by_hand, "train", 4, windows="documents").window_starts.tolist() \
            == STARTS_T4


def test_sink_ids_go_in_front_of_the_eod(by_hand: Path) -> None:
    ds = PackedDataset(by_hand, "train", seq_len=6, sink_tokens=2, windows="documents")
    assert ds.window_starts.tolist() == STARTS_T4  # T = 6 - 2
    batch = SinkCollator([41, 42], 6)([ds[1], ds[3]])
    assert batch["input_ids"].tolist() == [[41, 42, EOD, 4, 5, 6], [41, 42, EOD, 11, EOD, 12]]
    assert batch["labels"].tolist() == [[-100, EOD, 4, 5, 6, 7], [-100, EOD, 11, EOD, 12, 13]]


def test_stream_is_the_fixed_grid(by_hand: Path) -> None:
    tokens = packed_tokens(documents(LENGTHS))
    for ds in (PackedDataset(by_hand, "train", 4),
               PackedDataset(by_hand, "train", 4, windows="stream")):
        assert ds.window_starts is None and len(ds) == (len(tokens) - 1) // 4 == 7
        for i in range(len(ds)):
            assert np.array_equal(ds[i], tokens[4 * i : 4 * i + 5])


def test_bad_settings_are_refused_before_compute(by_hand: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"windows='document': unknown; use one of stream, "
                                        "documents"):
        PackedDataset(by_hand, "train", 4, windows="document")
    with pytest.raises(DataError, match=r"^data.windows='grid': unknown; use one of stream, "):
        SinkLMDataModule(path=str(by_hand), windows="grid")
    with pytest.raises(DataError, match="Megatron rows are fixed, pre-shuffled"):
        SinkLMDataModule(megatron_path=str(tmp_path / "pythia"), windows="documents")
    old = write_packed(tmp_path / "old", {"train": documents(LENGTHS)}, eod_id=None)
    with pytest.raises(DataError, match=r"records no eod_id.*re-pack it"):
        SinkLMDataModule(path=str(old), windows="documents")
    with pytest.raises(DataError, match="records no eod_id"):
        PackedDataset(old, "train", 4, windows="documents")
    SinkLMDataModule(path=str(old))  # stream needs no eod_id


def test_data_module_uses_the_setting_for_training_and_validation(by_hand: Path) -> None:
    data = SinkLMDataModule(path=str(by_hand), seq_len=4, vocab_size=64, micro_batch_size=2,
                            num_workers=0, windows="documents")
    assert data.hparams["windows"] == "documents"
    train, validation = data.train_dataloader(), data.val_dataloader()
    assert train.dataset.window_starts.tolist() == STARTS_T4
    assert validation.dataset.window_starts.tolist() == STARTS_T4
    assert len(validation.sampler) == len(STARTS_T4)
    first = next(iter(validation))["input_ids"]  # in order: windows 0 and 1
    assert first.tolist() == [[1, 2, 3, EOD], [EOD, 4, 5, 6]]
    assert data.probe_dataloader().dataset is validation.dataset  # scanned once
    assert data.identity()["windows"] == "documents"
    stream = SinkLMDataModule(path=str(by_hand), seq_len=4, vocab_size=64, num_workers=0)
    assert stream.identity()["windows"] == "stream"
    assert stream.val_dataloader().dataset.window_starts is None


def test_resume_with_other_windows_is_refused(by_hand: Path, tmp_path: Path) -> None:
    config = model_config("tiny-1m", "vanilla", model_overrides={"vocab_size": 64})
    documents_data = SinkLMDataModule(path=str(by_hand), seq_len=4, vocab_size=64,
                                      windows="documents")
    stream_data = SinkLMDataModule(path=str(by_hand), seq_len=4, vocab_size=64)
    for data in (documents_data, stream_data):
        data.check_vocabulary(64)

    def checkpoint(identity: dict) -> dict:
        return {CHECKPOINT_KEY: config.to_dict(), DATA_KEY: identity}

    saved = checkpoint(documents_data.identity())
    assert resume_differences(saved, config, documents_data) == []
    assert resume_differences(saved, config, stream_data) == [
        "windows: checkpoint documents vs data stream"]
    # Checkpoints from before windows were recorded were trained on the stream grid.
    older = checkpoint({k: v for k, v in stream_data.identity().items() if k != "windows"})
    assert resume_differences(older, config, stream_data) == []
    assert resume_differences(older, config, documents_data) == [
        "windows: checkpoint stream vs data documents"]
    path = tmp_path / "documents.ckpt"
    torch.save({**saved, "global_step": 2}, path)
    with pytest.raises(ConfigError, match=r"\(windows: checkpoint documents vs data stream\); "
                                          "resume it with the config and data it was trained"):
        check_resume_compatible(path, config, stream_data)


def test_packed_streams_with_the_eod_first(by_hand: Path) -> None:
    tokenizer, sinks = word_tokenizer(), SinkPrefix([41])
    docs = documents(LENGTHS)
    spec = f"{by_hand}:train"
    plain = packed_streams(spec, tokenizer, sinks)
    assert [s.text.tolist() for s in plain] == [d for d in docs if len(d) >= 2]
    first = packed_streams(spec, tokenizer, sinks, eod_first=True)
    assert [s.text.tolist() for s in first] == [[EOD, *d] for d in docs]
    assert [s.name for s in first] == [f"packed:train[{i}]" for i in range(5)]
    assert all(s.sinks == sinks and s.tokens == len(s.text) + 1 for s in first)
    # max_tokens counts the EOD as the text token it is.
    cut = packed_streams(spec, tokenizer, sinks, max_tokens=10, eod_first=True)
    assert [s.text.tolist() for s in cut] == [[EOD, *docs[0]], [EOD, *docs[1][:5]]]


@pytest.fixture(scope="module")
def document_run(train_data: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step vanilla `sinklm fit` with data.windows: documents; its last checkpoint."""
    root = tmp_path_factory.mktemp("document_run")
    config = tiny_config(train_data, root / "run", variant="vanilla", steps=2,
                         checkpoint_every=2)
    config["data"]["windows"] = "documents"
    (root / "fit.yaml").write_text(yaml.safe_dump(config))
    assert run_fit(["--config", str(root / "fit.yaml")]) == 0
    return root / "run" / "checkpoints" / "last.ckpt"


def test_a_fit_with_document_windows_records_them(
    document_run: Path, train_data: TinyData, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = torch.load(document_run, map_location="cpu", weights_only=False)
    assert saved[DATA_KEY]["windows"] == "documents"
    assert saved["datamodule_hyper_parameters"]["windows"] == "documents"
    assert trained_windows(str(document_run)) == "documents"
    assert "--eod-first" in eod_first_note(str(document_run), eod_first=False)
    assert eod_first_note(str(document_run), eod_first=True) is None
    # Resuming it on the stream grid is refused in one line, before any compute.
    config = tiny_config(train_data, tmp_path / "run", variant="vanilla", steps=4)
    (tmp_path / "stream.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert run_fit(["--config", str(tmp_path / "stream.yaml"),
                    "--ckpt_path", str(document_run)]) == 2
    err = capsys.readouterr().err
    assert "windows: checkpoint documents vs data stream" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_stream_eval_eod_first_reaches_the_streams(
    document_run: Path, train_data: TinyData, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["stream-eval", "--checkpoint", str(document_run), "--packed",
              str(train_data.packed), "--max-tokens", "300", "--cache", "0+16,dense"]
    assert sinklm_main([*common, "--output", str(tmp_path / "plain.json")]) == 0
    assert "note: " in capsys.readouterr().err  # trained on documents, evaluated without
    assert sinklm_main([*common, "--eod-first", "--output", str(tmp_path / "eod.json")]) == 0
    assert "note: " not in capsys.readouterr().err
    plain, eod = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "eod"))
    assert (plain["eod_first"], eod["eod_first"]) == (False, True)
    tokenizer = Tokenizer.from_file(str(train_data.tokenizer))
    with_eod, without = (packed_streams(str(train_data.packed), tokenizer, SinkPrefix(()), 300,
                                        eod_first=first) for first in (True, False))
    assert with_eod[0].text[0] == read_meta(train_data.packed)["eod_id"]
    assert torch.equal(with_eod[0].text[1:], without[0].text[:-1])
    for document, streams in ((eod, with_eod), (plain, without)):
        assert document["streams"] == [{"name": s.name, "text_tokens": s.text_tokens}
                                       for s in streams]


def test_eod_first_without_packed_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    book = tmp_path / "book.txt"
    book.write_text("a b c")
    for command in (["stream-eval", "--checkpoint", str(tmp_path / "none.ckpt")],
                    ["sinks", "--checkpoint", str(tmp_path / "none.ckpt")],
                    ["compare", str(tmp_path / "none.ckpt")]):
        args = [*command, "--text", str(book), "--eod-first",
                "--output", str(tmp_path / f"{command[0]}.out")]
        assert sinklm_main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sinklm {command[0]}: --eod-first keeps the end-of-document")
        assert "use it with --packed" in err and err.count("\n") == 1


def test_compare_records_eod_first(
    document_run: Path, train_data: TinyData, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["compare", str(document_run), "--packed", str(train_data.packed),
            "--max-tokens", "200", "--cache", "0+16,dense"]
    assert sinklm_main([*args, "--eod-first", "--output", str(tmp_path / "eod")]) == 0
    assert "note: " not in capsys.readouterr().err
    report = json.loads((tmp_path / "eod" / "report.json").read_text())
    assert report["streaming"]["eod_first"] is True
    assert report["streaming"]["text"][0]["eod_first"] is True
    assert "each document led by its end-of-document id" in (
        tmp_path / "eod" / "report.md").read_text()
    assert sinklm_main([*args, "--output", str(tmp_path / "plain")]) == 0
    assert "--eod-first" in capsys.readouterr().err  # the note, once
    report = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert report["streaming"]["eod_first"] is False
    assert "eod_first" not in report["streaming"]["text"][0]  # earlier caches stay valid


def test_text_identity_marks_eod_first_only_when_set(by_hand: Path) -> None:
    from sinklm.eval.compare import Settings

    plain = text_identity(Settings(texts=(), packed=str(by_hand)))
    marked = text_identity(Settings(texts=(), packed=str(by_hand), eod_first=True))
    assert plain == [{"packed": "packed", "split": "validation", "source": "by-hand",
                      "tokenizer": read_meta(by_hand)["tokenizer_hash"]}]
    assert marked == [{**plain[0], "eod_first": True}]
