"""`sinklm --help`, every command's --help and argument errors answer without importing torch.

Importing torch and Lightning takes 5-9 s; a user reading help or fixing a typo should not wait
for it. Each check runs in a fresh interpreter, since this test process has imported torch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from sinklm.cli.main import COMMANDS, build_parser, main

HEAVY = ("torch", "lightning", "transformers", "datasets", "lm_eval", "matplotlib")


def heavy_modules_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter has imported after running ``code``."""
    script = (
        f"import sys\n{code}\n"
        f"print(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def commands() -> list[str]:
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    return list(subparsers.choices)


def test_help_lists_the_table_in_its_order(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMANDS is the one list: every command, its order in --help and its one-line help."""
    assert commands() == [command.name for command in COMMANDS]
    monkeypatch.setenv("COLUMNS", "200")  # one line per command
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for command in COMMANDS:
        assert f"{command.name} {command.help}" in listed


def test_building_the_parser_imports_no_heavy_module() -> None:
    code = "from sinklm.cli.main import build_parser\nbuild_parser()"
    assert heavy_modules_after(code) == []


def test_help_and_argument_errors_import_no_heavy_module() -> None:
    """Every command's --help and a parse error."""
    argvs = [["--help"], *([name, "--help"] for name in commands()),
             ["stream-eval", "--no-such-flag"], ["sinks", "--dtype", "float8"]]
    code = (
        "import contextlib, io\nfrom sinklm.cli.main import main\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n            main(argv)\n        except SystemExit:\n            pass"
    )
    assert heavy_modules_after(code) == []


def test_every_command_has_help_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    for name in commands():
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert "example:" in capsys.readouterr().out, name


def test_fit_help_all_is_lightning_clis(capsys: pytest.CaptureFixture[str]) -> None:
    """fit's full help is LightningCLI's (seconds to build), behind --help-all."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help-all"])
    assert exit_info.value.code == 0
    assert "--trainer.max_steps" in capsys.readouterr().out
