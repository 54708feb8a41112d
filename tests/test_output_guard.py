"""Every writing command refuses, in one line and before any model or corpus is read, an output
it cannot write: no ``PermissionError`` traceback after the work.

Permissions are simulated through ``os.access`` (what the guard asks), so the test holds when
it runs as root; every other input is bad too (an absent checkpoint), so a command that did not
guard its output first would fail on that instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sinklm.cli.main import main


@pytest.fixture
def locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder this process may not write in."""
    folder = tmp_path / "locked"
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (
        False if Path(path) == folder and mode & os.W_OK else real(path, mode, **kwargs)))
    return folder


COMMANDS = {
    "stream-eval": ["--checkpoint", "{tmp}/absent", "--text", "{tmp}/book.txt",
                    "--output", "{out}/r.json"],
    "sinks": ["--checkpoint", "{tmp}/absent", "--text", "{tmp}/book.txt",
              "--output", "{out}/s.json"],
    "generate": ["--checkpoint", "{tmp}/absent", "--prompt", "Once", "--output", "{out}/g.json"],
    "zeroshot": ["--checkpoint", "{tmp}/absent", "--output", "{out}/z.json"],
    "compare": ["{tmp}/absent", "--text", "{tmp}/book.txt", "--output", "{out}/report"],
    "export": ["--checkpoint", "{tmp}/absent", "--output", "{out}/export"],
    "prepare-data": ["--source", "{tmp}/book.txt", "--output", "{out}/packed"],
    "train-tokenizer": ["--source", "{tmp}/book.txt", "--vocab-size", "300",
                        "--output", "{out}/tokenizer"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unwritable_output_is_one_line_before_any_work(
    command: str, locked: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "book.txt").write_text("It was a dark and stormy night.\n" * 20)
    argv = [a.format(tmp=tmp_path, out=locked) for a in COMMANDS[command]]
    assert main([command, *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"sinklm {command}: --output ") and err.count("\n") == 1, err
    assert f"cannot be written: no permission to write in {locked}; choose another --output" in err
    assert "Traceback" not in err and out == ""
    assert list(locked.iterdir()) == []
