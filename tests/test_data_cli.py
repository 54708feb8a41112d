"""``sinklm prepare-data`` / ``train-tokenizer``: configs, overrides, errors without tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sinklm.cli.main import main
from sinklm.data import PrepareConfig, load_tokenizer, read_meta, sink_token_ids

REPO = Path(__file__).resolve().parents[1]
TEXT = "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.\n" * 40


def test_prepare_data_from_a_config_with_flag_overrides(
    data_neox_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "docs.jsonl"
    texts = [f"Document {i}. {TEXT}" for i in range(6)]
    source.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    # The tokenizer through a symbolic link, as when ../shared is one: meta.json records the
    # resolved path, so paths are compared resolved.
    linked = tmp_path / "shared-link"
    linked.symlink_to(data_neox_path.parent, target_is_directory=True)
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({
        "source": {"path": str(source), "text_field": "body", "cache_dir": str(tmp_path / "c")},
        "tokenizer": str(linked / data_neox_path.name), "output": str(tmp_path / "out"),
        "val_fraction": 0.5,
    }))
    assert main(["prepare-data", "--config", str(config), "--seed", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(data_neox_path)
    total = sum(len(tokenizer.encode(t).ids) + 1 for t in texts)
    splits = printed["splits"]
    assert splits["train"]["documents"] == splits["validation"]["documents"] == 3
    assert splits["train"]["tokens"] + splits["validation"]["tokens"] == total
    meta = read_meta(tmp_path / "out")
    assert (meta["seed"], meta["val_fraction"]) == (3, 0.5)
    assert Path(meta["tokenizer"]).resolve() == data_neox_path.resolve()
    assert main(["prepare-data", "--config", str(config), "--seed", "3"]) == 0
    assert "reusing" in capsys.readouterr().err
    assert main(["prepare-data", "--config", str(config)]) == 2  # seed 0 now: refused
    assert "seed changed); pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--source", "{tmp}/empty.txt", "--output", "{tmp}/o"], "empty.txt: the file is empty"),
        (["--output", "{tmp}/o"], "no source: pass --source"),
        (["--config", "{tmp}/missing.yaml"], "missing.yaml: cannot read the data config"),
        (["--source", "{tmp}/a.txt", "--output", "{tmp}/o", "--val-fraction", "2"],
         "val_fraction=2.0: must lie in [0, 1]"),
        (["--source", "{tmp}/a.txt", "--output", "{tmp}/o", "--text-field", "body",
          "--tokenizer", "{tmp}/none.json"], "none.json: no such tokenizer file"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("text")
    assert main(["prepare-data", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sinklm prepare-data: ")
    assert expected in err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_train_tokenizer_then_pack_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "book.txt").write_text(TEXT)
    out = tmp_path / "tok"
    assert main(["train-tokenizer", "--source", str(tmp_path / "book.txt"), "--vocab-size",
                 "290", "--min-frequency", "1", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["vocab_size"] == 290 and printed["eod_id"] == 0
    tokenizer = load_tokenizer(out)
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT
    assert sink_token_ids(tokenizer, 1, 384) == [290]
    assert main(["prepare-data", "--source", str(tmp_path / "book.txt"), "--tokenizer",
                 str(out), "--output", str(tmp_path / "packed")]) == 0
    meta = read_meta(tmp_path / "packed")
    assert meta["splits"]["train"]["tokens"] == len(tokenizer.encode(TEXT).ids) + 1
    assert main(["train-tokenizer", "--source", str(tmp_path / "book.txt"), "--vocab-size",
                 "10", "--output", str(out), "--overwrite"]) == 2
    assert "sinklm train-tokenizer: vocab_size=10" in capsys.readouterr().err


def test_train_tokenizer_refuses_an_existing_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Packed data records its tokenizer's hash: replacing the file silently would orphan it."""
    (tmp_path / "book.txt").write_text(TEXT)
    out = tmp_path / "tok"
    argv = ["train-tokenizer", "--source", str(tmp_path / "book.txt"), "--min-frequency", "1",
            "--output", str(out)]
    assert main([*argv, "--vocab-size", "290"]) == 0
    before = (out / "tokenizer.json").read_text()
    capsys.readouterr()
    assert main([*argv, "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err == (f"sinklm train-tokenizer: --output {out} already holds a tokenizer.json: "
                   "pass --overwrite to replace it\n")
    assert (out / "tokenizer.json").read_text() == before
    assert main([*argv, "--vocab-size", "300", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 300
    assert main([*argv, "--vocab-size", "290", "--output", str(tmp_path / "book.txt")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["prepare-data", "train-tokenizer"])
def test_help_has_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert f"example: sinklm {command}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["pile_deduped", "pg19_test", "local_corpus", "books_local"])
def test_shipped_data_configs_are_valid(name: str) -> None:
    data = yaml.safe_load((REPO / "configs" / "data" / f"{name}.yaml").read_text())
    config = PrepareConfig.from_dict(data)
    if name in ("pile_deduped", "pg19_test"):
        assert config.source.streaming and not config.source.is_local
        assert config.tokenizer == "EleutherAI/gpt-neox-20b"
    elif (REPO.parent / "shared" / "data").is_dir():
        assert (REPO / config.source.path).exists()
        assert (REPO / config.tokenizer).is_file()
