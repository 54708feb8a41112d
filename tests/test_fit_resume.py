"""A checkpoint to resume from, named by --ckpt_path or found by auto, must hold the configured
model, sink ids, tokenizer and data; anything else is refused in one line before any compute."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_data import TinyData, tiny_config

from sinklm.data import PrepareConfig, prepare_data, read_meta, save_tokenizer, train_tokenizer
from sinklm.models.checkpoint import DATA_KEY
from sinklm.train.fit import run_fit


@dataclass
class Trained:
    checkpoint: Path  # a 2-step tiny sink_token run on train_data's packed books


def fit(config: dict, path: Path, *args: str) -> int:
    """`sinklm fit --config PATH ARGS` in this process."""
    path.write_text(yaml.safe_dump(config))
    return run_fit(["--config", str(path), *args])


def refusal(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a refused run printed."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    refusals = [line for line in lines if line.startswith("sinklm fit: ")]
    assert len(refusals) == 1 and "Traceback" not in "\n".join(lines), lines
    return refusals[0]


@pytest.fixture(scope="module")
def trained(train_data: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = tmp_path_factory.mktemp("trained")
    config = tiny_config(train_data, root / "run", steps=2, checkpoint_every=2)
    assert fit(config, root / "fit.yaml") == 0
    return Trained(checkpoint=root / "run" / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def other_data(train_data: TinyData, data_shared: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The books packed from other documents (same tokenizer), and with another tokenizer."""
    root = tmp_path_factory.mktemp("other_data")
    books = root / "two_books"
    books.mkdir()
    for book in sorted((data_shared / "books").glob("*.txt"))[:2]:
        shutil.copy(book, books)
    text = (data_shared / "books" / "frankenstein_shelley_pg84.txt").read_text()
    tokenizer = save_tokenizer(train_tokenizer([text], vocab_size=610), root / "tokenizer610")
    folders = {"source": (books, train_data.tokenizer),
               "tokenizer": (data_shared / "books", tokenizer)}
    for name, (source, tokenizer_path) in folders.items():
        prepare_data(PrepareConfig(source={"path": str(source)}, output=str(root / name),
                                   tokenizer=str(tokenizer_path), val_fraction=0.3), log=None)
    return {name: root / name for name in folders}


def test_checkpoint_records_its_data(train_data: TinyData, trained: Trained) -> None:
    meta = read_meta(train_data.packed)
    saved = torch.load(trained.checkpoint, map_location="cpu", weights_only=False)
    assert saved[DATA_KEY] == {"tokenizer_hash": meta["tokenizer_hash"],
                               "source_fingerprint": meta["source_fingerprint"],
                               "windows": "stream"}


def test_explicit_checkpoint_of_another_variant_is_refused(
    train_data: TinyData, trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LightningCLI used to replace the config's model with the checkpoint's and train it."""
    config = tiny_config(train_data, tmp_path / "run", variant="zero_sink", steps=4)
    assert fit(config, tmp_path / "zero_sink.yaml", "--ckpt_path", str(trained.checkpoint)) == 2
    line = refusal(capsys)
    assert f"ckpt_path={trained.checkpoint} holds another model" in line
    assert "variant: checkpoint sink_token vs config zero_sink" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("data", "difference"), [
    ("source", "source fingerprint: checkpoint"),
    ("tokenizer", "tokenizer hash: checkpoint"),
])
def test_resume_on_other_data_is_refused(
    train_data: TinyData, trained: Trained, other_data: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str], data: str, difference: str,
) -> None:
    config = tiny_config(train_data, tmp_path / "run", steps=4)
    config["data"]["path"] = str(other_data[data])
    assert fit(config, tmp_path / "other.yaml", "--ckpt_path", str(trained.checkpoint)) == 2
    line = refusal(capsys)
    assert difference in line and "resume it with the config and data" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_checkpoint_from_before_data_records_resumes_with_a_note(
    train_data: TinyData, trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = torch.load(trained.checkpoint, map_location="cpu", weights_only=False)
    del old[DATA_KEY]
    torch.save(old, tmp_path / "old.ckpt")
    config = tiny_config(train_data, tmp_path / "run", steps=3, checkpoint_every=3)
    assert fit(config, tmp_path / "a.yaml", "--ckpt_path", str(tmp_path / "old.ckpt")) == 0
    assert "was written before checkpoints recorded their data" in capsys.readouterr().err
    resumed = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 3 and DATA_KEY in resumed


@pytest.mark.parametrize("damage", ["text", "truncated"])
def test_unreadable_checkpoint_is_one_line(
    train_data: TinyData, trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    path = tmp_path / "bad.ckpt"
    good = trained.checkpoint.read_bytes()
    path.write_bytes(b"not a checkpoint\n" if damage == "text" else good[: len(good) // 2])
    config = tiny_config(train_data, tmp_path / "run", steps=4)
    assert fit(config, tmp_path / "a.yaml", "--ckpt_path", str(path)) == 2
    assert f"ckpt_path={path}: cannot be read as a checkpoint" in refusal(capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()
