"""Results and exported weights: atomic writes that colleagues can read (the umask's mode, not
the 0600 of a private temporary file), and one output guard: an existing result, a folder in
the way and a place this process cannot write are refused in one line naming the file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sinklm.cli.main import UserError
from sinklm.cli.outputs import guard_outputs, unwritable, write_atomic
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
    files = {path.name: mode(path) for path in folder.rglob("*") if path.is_file()}
    assert files["model.safetensors"] == 0o666 & ~umask
    assert set(files.values()) == {0o666 & ~umask}
    # Folders inside the export (custom_generate/) get the umask's folder mode, 0755 under 022.
    assert {mode(path) for path in folder.rglob("*") if path.is_dir()} <= {0o777 & ~umask}


def refusal(paths: list[Path], overwrite: bool = False) -> str | None:
    try:
        guard_outputs(paths, overwrite)
    except UserError as error:
        return str(error)
    return None


def test_the_guard_refuses_each_file_a_command_writes(tmp_path: Path) -> None:
    result, losses, plot = tmp_path / "r.json", tmp_path / "r.npz", tmp_path / "r.png"
    assert refusal([result, losses, plot]) is None
    result.write_text("{}")
    assert refusal([result, losses, plot]) == (
        f"--output {result} exists: pass --overwrite to replace it")
    assert refusal([result, losses, plot], overwrite=True) is None
    result.unlink()
    losses.write_bytes(b"")  # the files beside the JSON hold a result too
    assert refusal([result, losses, plot]) == (
        f"{losses} (written beside --output {result}) exists: pass --overwrite to replace it")
    assert refusal([result, losses, plot], overwrite=True) is None
    plot.mkdir()
    assert refusal([result, losses, plot], overwrite=True) == (
        f"{plot} (written beside --output {result}) is a folder; move it or choose another "
        "--output")
    assert refusal([tmp_path], overwrite=True) == (
        f"--output {tmp_path} is a folder; give a file path")
    assert losses.read_bytes() == b"" and plot.is_dir()  # a refusal touches nothing


def test_unwritable_says_which_folder_is_at_fault(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    deep = a_file / "runs" / "r.json"
    assert unwritable(deep) == f"{a_file} is a file, so {deep} cannot be created"
    assert unwritable(tmp_path / "new" / "deeper" / "r.json") is None
    # Permissions through os.access, so the test holds as root too (root may write anywhere).
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: (
        False if Path(path) in (locked, a_file) and mode & os.W_OK else real(path, mode)))
    for path in (locked, locked / "r.json", locked / "new" / "r.json"):
        assert unwritable(path) == f"no permission to write in {locked}"
    assert unwritable(a_file) == f"{a_file} is read-only"
    assert refusal([locked / "r.json"]) == (
        f"--output {locked / 'r.json'} cannot be written: no permission to write in {locked}; "
        "choose another --output or fix the permissions")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: os.access says so too")
def test_unwritable_reads_real_permissions(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert unwritable(locked / "r.json") == f"no permission to write in {locked}"
    finally:
        locked.chmod(0o755)


def test_the_guard_imports_nothing_of_sinklm() -> None:
    """Training, export and data may all call it, so it must not pull in any of them."""
    code = ("import sys, sinklm.cli.outputs\n"
            "print(sorted(m for m in sys.modules if m.startswith('sinklm')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["['sinklm',", "'sinklm.cli',", "'sinklm.cli.outputs']"]


def test_only_the_atomic_write_helper_makes_private_temporary_files() -> None:
    """mkstemp's files are 0600: any other use would write results colleagues cannot read."""
    users = sorted(
        str(path.relative_to(REPO))
        for folder in ("cli", "data", "eval", "models", "train")
        for path in (REPO / folder).rglob("*.py")
        if "mkstemp" in path.read_text() or "NamedTemporaryFile" in path.read_text()
    )
    assert users == ["cli/outputs.py"]
