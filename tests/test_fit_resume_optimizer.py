"""On a resume the configured ``model.optimizer`` wins over the checkpoint's, and any change is
named in one line: Lightning restores the optimizer's param groups and the scheduler's base
lrs, so a changed ``--model.optimizer.lr`` used to be silently ignored.

That a resume with unchanged settings trains bit-identically to an uninterrupted run is
``test_train_loop.py::test_resume_after_sigkill_is_exact`` (and the FSDP2 one there)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_data import TinyData, tiny_config

from sinklm.train.fit import run_fit
from sinklm.train.module import lr_multiplier

NOTE = "sinklm fit: resuming with changed optimizer settings: "
A = 3.0e-3  # tiny_config's lr


def fit(config: dict, path: Path, *args: str) -> int:
    """`sinklm fit --config PATH ARGS` in this process."""
    path.write_text(yaml.safe_dump(config))
    return run_fit(["--config", str(path), *args])


def logged_lrs(root: Path) -> dict[int, float]:
    """step -> train/lr, the lr each optimizer step used, from the run's CSV logs."""
    return {int(row["step"]): float(row["train/lr"])
            for log in sorted(root.glob("logs/version_*/metrics.csv"))
            for row in csv.DictReader(log.open()) if row.get("train/lr")}


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if "changed optimizer settings" in line]


@pytest.fixture(scope="module")
def checkpoint(train_data: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 steps with lr A (of max_steps 2), checkpointed after step 2."""
    root = tmp_path_factory.mktemp("resume_optimizer")
    assert fit(tiny_config(train_data, root / "run", steps=2, checkpoint_every=2),
               root / "fit.yaml") == 0
    return root / "run" / "checkpoints" / "last.ckpt"


CHANGES = {
    "lr": ({"lr": 1.0e-5}, "lr 0.003 -> 1e-05"),
    "the_rest": ({"betas": [0.8, 0.99], "eps": 1.0e-6, "weight_decay": 0.05,
                  "warmup_fraction": 0.5, "min_lr_ratio": 0.5},
                 "betas (0.9, 0.95) -> (0.8, 0.99), eps 1e-08 -> 1e-06, weight_decay 0.1 -> 0.05, "
                 "warmup_fraction 0.01 -> 0.5, min_lr_ratio 0.1 -> 0.5"),
}


@pytest.mark.parametrize("name", CHANGES)
def test_changed_optimizer_settings_win_and_are_named(
    train_data: TinyData, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    changes, named = CHANGES[name]
    config = tiny_config(train_data, tmp_path / "run", steps=4, checkpoint_every=4)
    config["model"]["optimizer"].update(changes)
    assert fit(config, tmp_path / "b.yaml", "--ckpt_path", str(checkpoint)) == 0
    assert notes(capsys.readouterr().err) == [NOTE + named]

    settings = {"lr": A, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                "warmup_fraction": 0.01, "min_lr_ratio": 0.1, **changes}
    lr, warmup, floor = settings["lr"], settings["warmup_fraction"], settings["min_lr_ratio"]
    # The lr each resumed step used: this run's lr on this run's schedule (over max_steps 4).
    expected = {step: lr * lr_multiplier(step, 4, warmup, floor) for step in (2, 3)}
    assert logged_lrs(tmp_path / "run") == pytest.approx(expected, rel=1e-6)

    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)
    assert saved["global_step"] == 4
    decayed, not_decayed = saved["optimizer_states"][0]["param_groups"]
    for group, decay in ((decayed, settings["weight_decay"]), (not_decayed, 0.0)):
        assert tuple(group["betas"]) == tuple(settings["betas"])
        assert group["eps"] == settings["eps"] and group["weight_decay"] == decay
        assert group["initial_lr"] == lr
        assert group["lr"] == pytest.approx(lr * lr_multiplier(4, 4, warmup, floor))
    assert saved["lr_schedulers"][0]["base_lrs"] == [lr, lr]
    # The Adam moments and step counts were restored, not restarted: 2 + 2 steps.
    assert all(state["step"] == 4 for state in saved["optimizer_states"][0]["state"].values())


def test_longer_run_follows_the_new_schedule_and_says_so(
    train_data: TinyData, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A longer trainer.max_steps is not an optimizer setting (no such note), but it reshapes
    the cosine from the resumed step on: one line names it with the lr before and after."""
    config = tiny_config(train_data, tmp_path / "run", steps=4, checkpoint_every=4)
    assert fit(config, tmp_path / "b.yaml", "--ckpt_path", str(checkpoint)) == 0
    err = capsys.readouterr().err
    assert notes(err) == []
    # By hand: warmup 1 step; at step 2 the cosine over 2 steps has ended (lr A * 0.1), over 4
    # it is a third of the way down (A * (0.1 + 0.9 * 0.5 * (1 + cos(pi / 3))) = A * 0.775).
    schedule = [line for line in err.splitlines() if "trainer.max_steps" in line]
    assert schedule == ["sinklm fit: resuming with trainer.max_steps 2 -> 4: the warmup + cosine "
                        "schedule now spans 4 steps (lr at step 2: 0.0003 -> 0.00233)"]
    expected = {step: A * lr_multiplier(step, 4, 0.01, 0.1) for step in (2, 3)}
    assert logged_lrs(tmp_path / "run") == pytest.approx(expected, rel=1e-6)
    assert expected[2] == pytest.approx(A * 0.775)


def test_same_max_steps_resumes_without_a_note(
    train_data: TinyData, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    config = tiny_config(train_data, tmp_path / "run", steps=2, checkpoint_every=2)
    assert fit(config, tmp_path / "b.yaml", "--ckpt_path", str(checkpoint)) == 0
    err = capsys.readouterr().err
    assert notes(err) == [] and "trainer.max_steps" not in err
