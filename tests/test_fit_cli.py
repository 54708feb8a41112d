"""`sinklm fit` as a person meets it: help that starts with usage and examples, one-line
errors (with "did you mean") before any compute, those that need no model before torch loads,
and output without Lightning's noise: a progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.train_data import TinyData, tiny_config
from helpers.train_data import run_fit as run_fit_subprocess

from sinklm.cli.fit import COMMON_SETTINGS, help_text
from sinklm.train.callbacks import StepLines, StepProgressBar, progress_display
from sinklm.train.fit import known_settings, run_fit

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "experiments" / "tiny-sink_token.yaml"


def flat_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in values.items():
        keys.add(f"{prefix}{key}")
        if isinstance(value, dict):
            keys |= flat_keys(value, f"{prefix}{key}.")
    return keys


@pytest.fixture(scope="module")
def printed_config() -> dict[str, Any]:
    """Every setting of the fit parser, as `sinklm fit --print_config` writes them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        run_fit(["--config", str(TINY), "--print_config"])
    return yaml.safe_load(out.getvalue())


def test_help_is_fast_and_names_real_settings(printed_config: dict[str, Any]) -> None:
    """`sinklm fit --help` imports neither torch nor Lightning (a fresh interpreter), and every
    setting it names is one LightningCLI takes."""
    script = ("import contextlib, io, json, sys\nfrom sinklm.cli.main import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "    try:\n        main(['fit', '--help'])\n"
              "    except SystemExit as exit:\n        code = exit.code\n"
              "print(json.dumps([code, out.getvalue(), "
              "[m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    code, out, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert (code, heavy, out.strip()) == (0, [], help_text())
    assert out.startswith("usage: sinklm fit --config FILE")
    assert "example: sinklm fit --config" in out and "--ckpt_path auto" in out
    assert "--help-all" in out
    named = {option.split()[0].removeprefix("--") for settings in COMMON_SETTINGS.values()
             for option, _ in settings}
    assert named and named <= flat_keys(printed_config)


def test_help_all_is_lightning_clis(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_fit(["--help-all"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sinklm fit --config FILE")
    head = out[: out.index("options:")]
    assert "example: sinklm fit --config" in head and "--ckpt_path auto" in head
    # LightningCLI's --optimizer/--lr_scheduler would replace the recipe: not offered.
    assert "  --optimizer" not in out and "--lr_scheduler" not in out
    assert "--model.optimizer " in out


def test_early_checks_know_every_section_setting(printed_config: dict[str, Any]) -> None:
    """The names read from the classes' source are the parser's: none refused wrongly, none
    missed (the data's sink count and vocabulary are linked from the model, never set)."""
    known = known_settings()
    assert set(known[""]) == {*printed_config, "config", "print_config"}
    for section in ("trainer", "model", "model.optimizer", "data", "checkpoint", "throughput",
                    "sink_probe"):
        values = printed_config
        for part in section.split("."):
            values = values[part]
        linked = {"sink_tokens", "vocab_size"} if section == "data" else set()
        assert set(known[section]) == {*values, *linked}, section


def _set(section: str, key: str, value: object) -> Callable[[dict], None]:
    return lambda config: config[section].update({key: value})


@pytest.mark.parametrize(("change", "args", "expected"), [
    (None, ["--trainer.max_steps", "-5"],
     "trainer.max_steps=-5: must be a positive number of optimizer steps"),
    (None, ["--trainer.max_step", "3"],  # was silently taken as max_steps (abbreviation)
     "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
    (_set("data", "seq_lenn", 32), [],
     "data.seq_lenn: no such setting; did you mean data.seq_len?"),
    (lambda config: config.update(traner=config.pop("trainer")), [],
     "traner: no such setting; did you mean trainer?"),
    (lambda config: config["model"]["optimizer"].update(lrr=1e-3), [],
     "model.optimizer.lrr: no such setting; did you mean model.optimizer.lr?"),
    (None, ["--optimizer", "AdamW"], "set under model.optimizer"),
    (None, ["--lr_scheduler", "torch.optim.lr_scheduler.StepLR"], "set under model.optimizer"),
    # A class chosen by class_path: its settings are checked by LightningCLI.
    (None, ["--trainer.logger.init_args.save_dirr", "x"],
     "trainer.logger.save_dirr: no such setting of lightning.pytorch.loggers.CSVLogger; did you "
     "mean trainer.logger.save_dir?"),
    (None, ["--model.preset", "pythia160m"],
     "model.preset='pythia160m': no such preset; did you mean pythia-160m?"),
])
def test_bad_settings_are_one_line_with_exit_code_2(
    train_data: TinyData, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    change: Callable[[dict], None] | None, args: list[str], expected: str,
) -> None:
    config = tiny_config(train_data, tmp_path / "run", steps=4)
    if change is not None:
        change(config)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run_fit(["--config", str(path), *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[0].startswith("sinklm fit: "), lines
    assert expected in lines[0]
    assert not (tmp_path / "run").exists()


EARLY_REFUSALS = [
    (["--config", "{tmp}/absent.yaml"], "--config {tmp}/absent.yaml: no such file"),
    (["--config", "{tmp}/broken.yaml"], "--config {tmp}/broken.yaml: not valid YAML"),
    (["--config", "{tmp}/list.yaml"], "holds a YAML list, not settings by section"),
    (["--config", "{tiny}", "--trainer.max_step", "3"],
     "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
    (["--config", "{tiny}", "--traner.max_steps=3"], "traner: no such setting; did you mean"),
    (["--config", "{tiny}", "--checkpoint.every_n_train_step", "3"],
     "did you mean checkpoint.every_n_train_steps?"),
    (["--config", "{tiny}", "--model.model_overrides", "{{d_modl: 64}}"],
     "model.model_overrides.d_modl: no such setting; did you mean "
     "model.model_overrides.d_model?"),
    (["--config", "{tiny}", "--model.variant", "sinktoken"],
     "model.variant='sinktoken': no such variant; did you mean sink_token?"),
    (["--config", "{tiny}", "--trainer.max_steps=-5"],
     "trainer.max_steps=-5: must be a positive number"),
    (["--config", "{tiny}", "--trainer.default_root_dir", "{tmp}/locked/run"],
     "--trainer.default_root_dir {tmp}/locked/run cannot be written: no permission to write in "
     "{tmp}/locked"),
]


def test_what_needs_no_model_is_refused_before_torch_loads(tmp_path: Path) -> None:
    """In a fresh interpreter: each refusal is one line, exit code 2, and neither torch nor
    Lightning was imported for any of them (which takes seconds)."""
    (tmp_path / "broken.yaml").write_text("trainer: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- trainer\n- model\n")
    (tmp_path / "locked").mkdir()
    cases = [[arg.format(tmp=tmp_path, tiny=TINY) for arg in argv] for argv, _ in EARLY_REFUSALS]
    # Permissions simulated through os.access, what the guard asks (the tests may run as root).
    script = (
        "import contextlib, io, json, os, sys\nfrom sinklm.train.fit import run_fit\n"
        f"locked, access = {str(tmp_path / 'locked')!r}, os.access\n"
        "os.access = lambda p, mode, **k: False if str(p) == locked else access(p, mode, **k)\n"
        "answers = []\n"
        f"for argv in {cases!r}:\n"
        "    with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "        answers.append([run_fit(argv), err.getvalue()])\n"
        "print(json.dumps([answers, [m for m in ('torch', 'lightning') if m in sys.modules]]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=tmp_path)
    answers, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    for (code, err), (_, expected) in zip(answers, EARLY_REFUSALS, strict=True):
        expected = expected.format(tmp=tmp_path)
        assert code == 2 and err.count("\n") == 1 and err.startswith("sinklm fit: "), err
        assert expected in err, err
    assert heavy == []


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_only_on_a_terminal() -> None:
    assert isinstance(progress_display(Terminal()), StepProgressBar)
    assert isinstance(progress_display(io.StringIO()), StepLines)


def test_output_has_no_lightning_noise(train_data: TinyData, tmp_path: Path) -> None:
    """As a user sees it, written to files (not a terminal), with the progress display and
    Lightning's default model summary on: plain progress lines, no bar."""
    config = tiny_config(train_data, tmp_path / "run", steps=3, checkpoint_every=3)
    config["trainer"]["enable_progress_bar"] = True
    config["trainer"]["log_every_n_steps"] = 2
    del config["trainer"]["enable_model_summary"]
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_fit_subprocess(path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    for noise in ("litlogger", "Total FLOPs", "Epoch 0", "perf/tokens_per_", "v_num", "\r",
                  "━", "it/s"):
        assert noise not in output, noise
    assert re.search(r"sinklm fit: tiny-1m sink_token, [\d,]+ parameters", result.stderr)
    # A line every log_every_n_steps steps and one at the end, with short labels.
    lines = re.findall(r"^sinklm fit: step (\d)/3: loss [\d.]+, tok/s [\d,]+$", result.stderr,
                       flags=re.M)
    assert lines == ["2", "3"], result.stderr
