"""`sinklm fit` as a person meets it: help that starts with usage and examples, one-line
errors (with "did you mean") before any compute, and output without Lightning's noise."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from helpers.train_data import TinyData, tiny_config
from helpers.train_data import run_fit as run_fit_subprocess

from sinklm.train.fit import run_fit


def test_help_starts_with_usage_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_fit(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sinklm fit --config FILE")
    head = out[: out.index("options:")]
    assert "example: sinklm fit --config" in head and "--ckpt_path auto" in head
    # LightningCLI's --optimizer/--lr_scheduler would replace the recipe: not offered.
    assert "  --optimizer" not in out and "--lr_scheduler" not in out
    assert "--model.optimizer " in out


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
     "model.optimizer.lrr: no such setting of sinklm.train.module.OptimizerConfig; did you mean "
     "model.optimizer.lr?"),
    (None, ["--optimizer", "AdamW"], "set under model.optimizer"),
    (None, ["--lr_scheduler", "torch.optim.lr_scheduler.StepLR"], "set under model.optimizer"),
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


def test_output_has_no_lightning_noise(train_data: TinyData, tmp_path: Path) -> None:
    """As a user sees it: the progress bar and Lightning's default model summary on."""
    config = tiny_config(train_data, tmp_path / "run", steps=2, checkpoint_every=2)
    config["trainer"]["enable_progress_bar"] = True
    del config["trainer"]["enable_model_summary"]
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_fit_subprocess(path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    for noise in ("litlogger", "Total FLOPs", "Epoch 0/", "perf/tokens_per_", "v_num"):
        assert noise not in output, noise
    assert "tok/s" in output and "loss" in output  # the bar, with short labels
    assert re.search(r"sinklm fit: tiny-1m sink_token, [\d,]+ parameters", result.stderr)
