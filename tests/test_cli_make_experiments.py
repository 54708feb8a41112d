"""`python configs/make_experiments.py`: --help prints help (it used to rewrite every config)
and --check names the configs that differ from the generator without writing any."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "configs" / "make_experiments.py"


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The generator, writing into tmp_path instead of configs/experiments."""
    spec = importlib.util.spec_from_file_location("make_experiments", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    return module


def test_help_writes_nothing(make: ModuleType, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make.main(["--help"])
    assert exit_info.value.code == 0
    assert "--check" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_check_names_stale_missing_and_unknown_files(
    make: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert make.main([]) == 0
    assert make.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    (tmp_path / "tiny-vanilla.yaml").write_text("edited by hand\n")
    (tmp_path / "pythia-160m-gated.yaml").unlink()
    (tmp_path / "old-name.yaml").write_text("seed_everything: 1\n")
    assert make.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "3 config(s) out of date" in err
    assert "old-name.yaml, pythia-160m-gated.yaml, tiny-vanilla.yaml" in err
    assert (tmp_path / "tiny-vanilla.yaml").read_text() == "edited by hand\n"  # nothing written
