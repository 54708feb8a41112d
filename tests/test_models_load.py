"""What a ``--checkpoint`` string points at is decided in one place, and loading stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sinklm.models.load import CheckpointError, locate


def test_importing_the_loader_leaves_transformers_unimported() -> None:
    """Evaluators import the loader at start-up; transformers (seconds) is paid only by the
    folders and Hub ids that need it."""
    code = "import sys, sinklm.models.load\nassert 'transformers' not in sys.modules\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_locate_tells_a_ckpt_a_folder_and_a_hub_id_apart(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    ckpt, folder = locate(tmp_path / "last.ckpt"), locate(str(tmp_path / "export"))
    assert (ckpt.kind, ckpt.path) == ("ckpt", tmp_path / "last.ckpt")
    assert (folder.kind, folder.path) == ("folder", tmp_path / "export")
    hub = locate("EleutherAI/pythia-70m")
    assert (hub.kind, hub.name) == ("hub", "EleutherAI/pythia-70m")


def test_locate_says_why_a_string_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty has no config\.json"):
        locate(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"weights.bin is a file but not a `sinklm fit`"):
        locate(tmp_path / "weights.bin")
    missing = tmp_path / "a" / "b"
    with pytest.raises(CheckpointError, match="b: no such folder, and not a Hub id like org/name"):
        locate(missing)
    with pytest.raises(CheckpointError, match="b: no such file or folder, and not a Hub id"):
        locate(missing, missing="file or folder")


def test_a_folder_of_checkpoints_points_at_one(tmp_path: Path) -> None:
    """``--checkpoint runs/x/checkpoints`` (or ``runs/x``): name the file to pass instead."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("step=100.ckpt", "last.ckpt"):
        (checkpoints / name).write_bytes(b"")
    for folder in (checkpoints, checkpoints.parent):
        with pytest.raises(CheckpointError) as error:
            locate(folder)
        assert str(error.value) == (
            f"{folder} has no config.json: it holds `sinklm fit` checkpoints (2); pass one of "
            f"them, e.g. {checkpoints / 'last.ckpt'}")


def test_load_tokenizer_reads_only_the_tokenizer(tmp_path: Path) -> None:
    """What compare checks against its text before evaluating any checkpoint."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from sinklm.models.checkpoint import CHECKPOINT_KEY, TOKENIZER_KEY
    from sinklm.models.load import load_tokenizer

    tokenizer = Tokenizer(WordLevel({"<|endoftext|>": 0, "<|unk|>": 1, "a": 2},
                                    unk_token="<|unk|>"))
    ckpt = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: {"not": "a model"}, TOKENIZER_KEY: tokenizer.to_str()}, ckpt)
    assert load_tokenizer(ckpt).to_str() == tokenizer.to_str()
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tokenizer.save(str(folder / "tokenizer.json"))
    assert load_tokenizer(folder).get_vocab() == tokenizer.get_vocab()
    torch.save({CHECKPOINT_KEY: {}}, ckpt)
    with pytest.raises(CheckpointError, match=r"not written by `sinklm fit` \(no tokenizer"):
        load_tokenizer(ckpt)
