"""The shipped experiment configs: in sync with their generator, parseable, the paper's recipe."""

from __future__ import annotations

import importlib.util
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from sinklm.models import ModelConfig
from sinklm.train.fit import run_fit

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def generator():
    spec = importlib.util.spec_from_file_location("make_experiments",
                                                  CONFIGS / "make_experiments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_match_generator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make = generator()
    monkeypatch.setattr(make, "OUT", tmp_path)
    make.main()
    shipped = {p.name: p.read_text() for p in (CONFIGS / "experiments").glob("*.yaml")}
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    assert shipped == fresh, "run `python configs/make_experiments.py` and commit the result"


@pytest.mark.parametrize("path", sorted((CONFIGS / "experiments").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_config_parses(path: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_fit(["--config", str(path), "--print_config"])
    assert exit_info.value.code in (None, 0)
    printed = yaml.safe_load(out.getvalue())
    assert printed["model"]["variant"] in path.stem


@pytest.mark.parametrize("variant", ["vanilla", "zero_sink", "sink_token"])
def test_paper_recipe(variant: str) -> None:
    """StreamingLLM sec. 4.2: Pythia-160M, seq 2048, batch 256, 143k steps, lr 6e-4, bf16."""
    config = yaml.safe_load((CONFIGS / "experiments" / f"pythia-160m-{variant}.yaml").read_text())
    trainer, model, data = config["trainer"], config["model"], config["data"]
    assert model["preset"] == "pythia-160m" and model["variant"] == variant
    assert trainer["max_steps"] == 143_000 and trainer["precision"] == "bf16-mixed"
    assert trainer["gradient_clip_val"] == 1.0
    assert data["seq_len"] == 2048 and data["global_batch_size"] == 256
    assert (data["micro_batch_size"] * trainer["devices"] * trainer["num_nodes"]
            * trainer["accumulate_grad_batches"]) == 256
    optimizer = model["optimizer"]
    assert optimizer["lr"] == 6e-4 and optimizer["betas"] == [0.9, 0.95]
    assert optimizer["eps"] == 1e-8 and optimizer["warmup_fraction"] == 0.01
    assert optimizer["min_lr_ratio"] == 0.1
    expected = ModelConfig.from_preset("pythia-160m", variant=variant)
    assert (expected.attention.softmax, expected.sink_tokens) == {
        "vanilla": ("softmax", 0), "zero_sink": ("softmax1", 0), "sink_token": ("softmax", 1)
    }[variant]
