"""Results and exported weights: atomic writes that colleagues can read (the umask's mode, not
the 0600 of a private temporary file), and one overwrite rule."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sinklm.cli.outputs import output_refusal, write_atomic
from sinklm.data.tokenizer import train_tokenizer
from sinklm.models import CausalLM, ModelConfig
from sinklm.models.load import Checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_write_gives_the_umasks_mode(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "report.json"
    write_atomic(path, "{}\n")
    assert path.read_text() == "{}\n"
    assert mode(path) == 0o666 & ~umask  # 0644 under umask 022
    write_atomic(path, "[]\n")  # replacing keeps it readable too
    assert path.read_text() == "[]\n" and mode(path) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "report.json"
    path.write_text("old\n")

    def fail(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_exported_weights_get_the_umasks_mode(tmp_path: Path, umask: int) -> None:
    from sinklm.models.hub import export_model

    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20,
                                vocab_size=290, min_frequency=1)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=320, n_layer=1, n_head=2, d_model=16,
                                 max_seq_len=32)).eval()
    folder = export_model(Checkpoint(model, tokenizer, [], "tiny", "memory"), tmp_path / "out")
    modes = {path.name: mode(path) for path in folder.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}


def test_output_refusal() -> None:
    assert output_refusal(REPO / "absent.json", overwrite=False) is None
    readme = REPO / "README.md"
    assert output_refusal(readme, overwrite=False) == (
        f"--output {readme} exists: pass --overwrite to replace it")
    assert output_refusal(readme, overwrite=True) is None
    assert output_refusal(REPO, overwrite=True) == f"--output {REPO} is a folder; give a file path"


def test_only_the_atomic_write_helper_makes_private_temporary_files() -> None:
    """mkstemp's files are 0600: any other use would write results colleagues cannot read."""
    users = sorted(
        str(path.relative_to(REPO))
        for folder in ("cli", "data", "eval", "models", "train")
        for path in (REPO / folder).rglob("*.py")
        if "mkstemp" in path.read_text() or "NamedTemporaryFile" in path.read_text()
    )
    assert users == ["cli/outputs.py"]
