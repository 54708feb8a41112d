"""`sinklm sweep`: the grid file checked whole before any run, the fit arguments each setting
becomes, the table's numbers from a report (hand computed), and a tiny sweep end to end that
a rerun reuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sinklm.cli import sweep_table
from sinklm.cli.main import main as sinklm_main
from sinklm.cli.sweep import Grid, Setting, SweepError, fit_arguments, read_grid

REPO = Path(__file__).resolve().parents[1]
GRID = REPO / "configs" / "sweeps" / "bb-first-token.yaml"


def write_grid(tmp_path: Path, **changes: object) -> Path:
    grid = {"variants": ["vanilla", "sink_token"], "seeds": [1], "window": 16,
            "max_tokens": 512, "settings": [{"name": "tiny", "steps": 2,
                                             "source": {"tokens": 40_000, "doc_tokens": 2048}}]}
    grid.update(changes)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


def test_the_bundled_grid_is_valid_and_covers_the_knobs() -> None:
    grid = read_grid(GRID)
    assert grid.seeds == (1234, 1, 2) and grid.variants == ("vanilla", "zero_sink", "sink_token")
    changed = {key for s in grid.settings for key in (*s.model, *s.optimizer, *s.source)}
    assert {"n_layer", "n_head", "learned_positions", "lr", "weight_decay", "doc_tokens",
            "triggers"} <= changed
    assert {s.windows for s in grid.settings} == {"stream", "documents"}
    assert any((s.steps or 300) >= 4 * 300 for s in grid.settings)
    screened = read_grid(GRID, only=["base", "learned-pos"], seeds=[7])
    assert [(s.name, screened.seeds_of(s)) for s in screened.settings] == [
        ("base", (7,)), ("learned-pos", (7,))]
    assert {grid.seeds_of(s) for s in grid.settings} == {(1234,), (1234, 1, 2)}


@pytest.mark.parametrize(("setting", "message"), [
    ({"name": "a", "windows": "aligned"}, "windows='aligned'; allowed ['stream', 'documents']"),
    ({"name": "a", "model": {"n_layers": 2}}, "unknown model config keys ['n_layers']"),
    ({"name": "a", "model": {"n_head": 3}}, "n_head=3 does not divide d_model=128"),
    ({"name": "a", "optimizer": {"momentum": 0.9}}, "optimizer keys ['momentum']"),
    ({"name": "a", "source": {"triggers": 99}}, "triggers"),
    ({"name": "a", "steps": 0}, "steps=0"),
    ({"name": "a b"}, "use letters, digits"),
    ({"name": "a", "lr": 1}, "unknown keys of setting 'a' ['lr']"),
])
def test_a_bad_setting_is_refused_before_any_run(tmp_path: Path, setting: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(SweepError) as error:
        read_grid(write_grid(tmp_path, settings=[setting]))
    assert message in str(error.value)


def test_grid_level_mistakes_are_named(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"variants \['vanila'\]"):
        read_grid(write_grid(tmp_path, variants=["vanila"]))
    with pytest.raises(SweepError, match="the caches need 4 < W < the trained context 128"):
        read_grid(write_grid(tmp_path, window=128))
    with pytest.raises(SweepError, match="max_tokens='all'; give an integer >= 2"):
        read_grid(write_grid(tmp_path, max_tokens="all"))
    with pytest.raises(SweepError, match="setting names repeat"):
        read_grid(write_grid(tmp_path, settings=[{"name": "a"}, {"name": "a"}]))
    with pytest.raises(SweepError, match="--only nope: not in"):
        read_grid(write_grid(tmp_path), only=["nope"])
    with pytest.raises(SweepError, match=r"unknown keys in .* \['seed'\]"):
        read_grid(write_grid(tmp_path, seed=3))


def test_a_setting_becomes_the_fit_arguments_a_user_would_type() -> None:
    config = {"model": {"preset": "lab-1l", "model_overrides": {"d_model": 64}}}
    setting = Setting(name="s", model={"n_layer": 2}, optimizer={"weight_decay": 0.5, "lr": 0.01},
                      windows="documents")
    assert fit_arguments(config, setting, 7) == [
        "--seed_everything", "7",
        "--model.model_overrides", '{"d_model": 64, "n_layer": 2}',
        "--model.optimizer.lr", "0.01", "--model.optimizer.weight_decay", "0.5",
        "--data.windows", "documents",
    ]
    assert fit_arguments({"model": {"preset": "lab-1l"}}, Setting(name="s"), 1) == [
        "--seed_everything", "1"]


def report_document(ppl: dict[str, list[float]]) -> dict[str, object]:
    labels = list(ppl)
    return {"models": [{"label": label} for label in labels],
            "streaming": {"results": {
                label: [{"cache": c, "ppl": p} for c, p in zip(("0+16", "1+15", "4+12"), values,
                                                               strict=True)]
                for label, values in ppl.items()}}}


def sink_report(first: float, self_: float, previous: float) -> dict[str, object]:
    # Two layers of two heads: the largest value must be found wherever it sits.
    return {"implicit_sink": None, "targets": {
        "targets": ["first", "self", "previous"],
        "non_trigger": [[[0.01, 0.2, 0.1], [first, 0.1, 0.0]], [[0.0, self_, 0.0], [0, 0, 0]]],
        "trigger": [[[0.0, 0.0, previous], [0, 0, 0.2]], [[0, 0, 0], [0, 0, 0]]]}}


def test_rows_and_verdicts_are_the_hand_computed_numbers() -> None:
    grid = Grid(settings=(Setting(name="s", about="what"),), window=16, seeds=(1, 2))
    runs = [{"setting": "s", "variant": v, "seed": seed} for v in ("vanilla", "sink_token")
            for seed in (1, 2)]
    ppl = {"v1": [6.5, 5.0, 4.95], "v2": [7.0, 5.0, 4.97], "s1": [40.0, 5.0, 5.0],
           "s2": [10.0, 5.0, 5.05]}
    sinks = {label: sink_report(0.4, 0.3, 0.9) for label in ppl}
    rows = sweep_table.setting_rows(runs, report_document(ppl), sinks, grid)
    assert rows[0]["ratio"] == pytest.approx(1.3) and rows[0]["one_over_four"] == pytest.approx(
        5.0 / 4.95)
    assert (rows[0]["first"], rows[0]["self"], rows[0]["previous"]) == (0.4, 0.3, 0.9)
    assert rows[0]["before"] == 0.1
    assert rows[0]["implicit"] is None
    # 1.3x and 1.0101 <= 1.02 in both vanilla seeds; sink_token 8x and 2x, 4+12 not below.
    assert sweep_table.verdict(rows) == "the paper's rows appear in 2 seeds (confirm with 3)"
    third = [dict(r, seed=3) for r in rows if r["seed"] == 1]
    assert sweep_table.verdict(rows + third) == "the paper's rows appear (3 seeds)"
    weak = [dict(r, ratio=1.29) if r["seed"] == 2 and r["variant"] == "vanilla" else r
            for r in rows]
    assert sweep_table.verdict(weak) == (
        "vanilla varies by seed (1 its first token, 1 none); sink_token needs its first token "
        "(2 seeds)")
    # Keeping one token is 3% worse than keeping four: the model needs more than its first.
    unsettled = [dict(r, one_over_four=1.03) if r["variant"] == "sink_token" else r for r in rows]
    assert sweep_table.verdict(unsettled) == (
        "vanilla needs its first token; sink_token needs several first tokens (2 seeds)")
    flat = [dict(r, ratio=1.0, one_over_four=1.0) for r in rows]
    assert sweep_table.verdict(flat).startswith("vanilla needs nothing of its first tokens;")
    table = sweep_table.markdown(rows, grid)
    # Mean (min-max) over the two seeds: 0+W of vanilla is 6.75 (6.50-7.00).
    assert "| s | vanilla | 2 | 6.75 (6.50-7.00) | 5.00 (5.00-5.00) |" in table
    assert "| s | what | the paper's rows appear in 2 seeds (confirm with 3) |" in table


def test_a_tiny_sweep_runs_end_to_end_and_a_rerun_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    grid = write_grid(tmp_path)
    out = tmp_path / "sweep"
    assert sinklm_main(["sweep", "--grid", str(grid), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    table = json.loads((out / "sweep.json").read_text())
    assert [(r["variant"], r["seed"]) for r in table["rows"]] == [("vanilla", 1),
                                                                   ("sink_token", 1)]
    report = json.loads((out / "compare" / "tiny" / "report.json").read_text())
    for row, model in zip(table["rows"], report["models"], strict=True):
        ppl = {r["cache"]: r["ppl"] for r in report["streaming"]["results"][model["label"]]}
        assert row["ratio"] == pytest.approx(ppl["0+16"] / ppl["1+15"])
    assert "| tiny | vanilla | 1 |" in captured.out
    assert (out / "sweep.png").stat().st_size > 0 and (out / "sweep.csv").is_file()
    assert sinklm_main(["sweep", "--grid", str(grid), "--output", str(out)]) == 0
    assert captured.err.count("training bb") == 2
    assert "training bb" not in capsys.readouterr().err  # every run reused
    # Another selection would rewrite the table of this one: only with --overwrite.
    assert sinklm_main(["sweep", "--grid", str(grid), "--output", str(out), "--seeds", "2"]) == 2
    assert "holds a sweep of another grid or selection" in capsys.readouterr().err


def test_a_folder_that_is_not_a_sweep_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert sinklm_main(["sweep", "--grid", str(write_grid(tmp_path)), "--output",
                        str(tmp_path / "out")]) == 2
    assert "holds files but no grid.json" in capsys.readouterr().err
