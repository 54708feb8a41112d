"""`sinklm compare`: its tables hold what the single-model commands measure, its cache is reused
and invalidated by the checkpoint's files, and it refuses bad input before any work.

Tiny random models exported with the real GPT-NeoX tokenizer, a few hundred tokens of a real
book, two items of one local benchmark.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from sinklm.cli.main import main as sinklm_main
from sinklm.data import PrepareConfig, prepare_data
from sinklm.data.tokenizer import sink_token_ids
from sinklm.eval import compare as compare_module
from sinklm.eval.compare import unique_labels
from sinklm.eval.compare_cache import checkpoint_identity
from sinklm.eval.compare_tables import training_sinks_markdown
from sinklm.eval.report import markdown_table
from sinklm.models import CausalLM, ModelConfig
from sinklm.models.hub import export_model
from sinklm.models.load import Checkpoint

CACHES = "0+16,1+15,4+12,dense"
TOKENS = "400"


@pytest.fixture(autouse=True)
def compare_one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Leave the second core to the other jobs; one process for lm-eval's bootstrap."""
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compare_models(tmp_path_factory: pytest.TempPathFactory, data_neox_path: Path) -> list[Path]:
    """A vanilla and a sink-token model (context 64) as exported folders."""
    tokenizer = Tokenizer.from_file(str(data_neox_path))
    root = tmp_path_factory.mktemp("compare_models")
    folders = []
    for seed, (variant, sinks) in enumerate([("vanilla", 0), ("sink_token", 1)]):
        torch.manual_seed(seed)
        config = ModelConfig(vocab_size=50304, n_layer=2, n_head=4, d_model=32, max_seq_len=64,
                             sink_tokens=sinks)
        model = CausalLM(config).eval()
        with torch.no_grad():  # non-trivial attention, so sink statistics differ per model
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        copy = Tokenizer.from_str(tokenizer.to_str())
        ids = sink_token_ids(copy, sinks, config.vocab_size)
        checkpoint = Checkpoint(model, copy, ids, f"tiny-{variant}", "memory")
        folders.append(export_model(checkpoint, root / variant))
    return folders


def compare_args(models: list[Path], book: Path, output: Path, *extra: str) -> list[str]:
    return ["compare", *map(str, models), "--text", str(book), "--max-tokens", TOKENS,
            "--cache", CACHES, "--output", str(output), *extra]


ZEROSHOT = ("--tasks", "arc_easy", "--limit", "2", "--bootstrap-iters", "100")


def test_report_holds_what_the_single_model_commands_measure(
    compare_models: list[Path], data_shared: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    book = data_shared / "books" / "frankenstein_shelley_pg84.txt"
    benchmarks = data_shared / "benchmarks"
    out = tmp_path / "report"
    zeroshot = (*ZEROSHOT, "--data-dir", str(benchmarks))
    assert sinklm_main(compare_args(compare_models, book, out, *zeroshot)) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    labels = [m["label"] for m in report["models"]]
    assert labels == ["tiny-vanilla", "tiny-sink_token"]
    assert report["streaming"]["caches"] == CACHES.split(",")

    rows = []
    for label, folder in zip(labels, compare_models, strict=True):
        single = tmp_path / label
        common = ["--checkpoint", str(folder), "--text", str(book)]
        assert sinklm_main(["stream-eval", *common, "--max-tokens", TOKENS, "--cache", CACHES,
                            "--output", str(single / "stream.json")]) == 0
        assert sinklm_main(["sinks", *common, "--output", str(single / "sinks.json")]) == 0
        assert sinklm_main(["zeroshot", "--checkpoint", str(folder), *zeroshot,
                            "--output", str(single / "zeroshot.json")]) == 0
        stream = json.loads((single / "stream.json").read_text())["results"]
        ours = report["streaming"]["results"][label]
        assert [r["ppl"] for r in ours] == pytest.approx([r["ppl"] for r in stream], rel=1e-6)
        assert [r["tokens"] for r in ours] == [r["tokens"] for r in stream] == [399] * 4
        rows.append((label, stream))

        sinks = json.loads((single / "sinks.json").read_text())
        mine = report["sinks"][label]
        assert mine["attention_to_first_per_layer"] == pytest.approx(
            sinks["attention_to_first_per_layer"], rel=1e-6)
        assert mine["sink_rate"] == sinks["sink_rate"]

        task = json.loads((single / "zeroshot.json").read_text())["tasks"]["arc_easy"]
        row = report["zeroshot"]["results"][label]["arc_easy"]
        assert (row["acc"], row["acc_norm"], row["samples"]) == (
            task["acc"], task["acc_norm"], task["samples"])
    assert report["models"][1]["model"]["sink_token_ids"] == [50277]

    table = markdown_table(rows)
    assert table in (out / "report.md").read_text() and table in printed
    with open(out / "streaming.csv") as file:
        lines = list(csv.reader(file))
    assert lines[0] == ["model", *CACHES.split(",")]
    assert [float(v) for v in lines[2][1:]] == pytest.approx([r["ppl"] for r in rows[1][1]])
    with open(out / "zeroshot.csv") as file:
        assert next(csv.reader(file)) == ["model", "arc_easy_acc", "arc_easy_acc_norm"]
    for name in ("streaming.png", "sinks.png", "running/tiny-vanilla.png", "report.md"):
        assert (out / name).stat().st_size > 0, name


def test_reruns_reuse_the_cache_until_a_checkpoint_changes(
    compare_models: list[Path], data_shared: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    book = data_shared / "books" / "frankenstein_shelley_pg84.txt"
    out = tmp_path / "report"
    args = compare_args(compare_models, book, out)
    assert sinklm_main(args) == 0
    first = json.loads((out / "report.json").read_text())
    # Not a terminal: a plain line per result, no progress bar redrawn with carriage returns.
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "tiny-vanilla: cache 0+16: ppl " in err
    assert "tiny-sink_token: sinks: Sink_1^0.3 = " in err

    loaded: list[str] = []
    evaluated: list[list[str]] = []
    real_load, real_evaluate = compare_module.load_checkpoint, compare_module.evaluate

    def load(path: str, **kwargs: object) -> Checkpoint:
        loaded.append(Path(path).name)
        return real_load(path, **kwargs)

    def evaluate(model: CausalLM, streams: list, policies: list, **kwargs: object) -> list:
        evaluated.append([p.label for p in policies])
        return real_evaluate(model, streams, policies, **kwargs)

    monkeypatch.setattr(compare_module, "load_checkpoint", load)
    monkeypatch.setattr(compare_module, "evaluate", evaluate)
    assert sinklm_main(args) == 0
    assert loaded == [] and evaluated == []  # nothing loaded, nothing computed
    second = json.loads((out / "report.json").read_text())
    assert second["streaming"] == first["streaming"] and second["sinks"] == first["sinks"]
    assert (first["results"], second["results"]) == (
        {"computed": 10, "reused": 0}, {"computed": 0, "reused": 10})

    # One more cache and a retrained checkpoint (new weights file time): the new cache is
    # computed for each model, everything only for the retrained one. Those are other inputs,
    # so the report they make replaces the first only with --overwrite.
    weights = compare_models[1] / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    more = compare_args(compare_models, book, out, "--cache", CACHES + ",2+14")
    capsys.readouterr()
    assert sinklm_main(more) == 2
    assert capsys.readouterr().err == (
        f"sinklm compare: --output {out.resolve()} holds a report made from other inputs "
        "(checkpoints, caches differ): pass --overwrite to replace it (the cached results there "
        "are reused), or choose another folder\n")
    assert json.loads((out / "report.json").read_text()) == second
    assert loaded == [] and evaluated == []
    assert sinklm_main([*more, "--overwrite"]) == 0
    assert set(loaded) == {"sink_token", "vanilla"}
    assert evaluated == [["2+14"], [*CACHES.split(","), "2+14"]]
    assert json.loads((out / "report.json").read_text())["streaming"]["caches"][-1] == "2+14"


def test_a_report_of_other_inputs_is_kept_without_overwrite(
    compare_models: list[Path], data_shared: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    book = data_shared / "books" / "frankenstein_shelley_pg84.txt"
    out = tmp_path / "report"
    assert sinklm_main(compare_args(compare_models, book, out, "--cache", "4+12")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    for other in (compare_args(compare_models[:1], book, out, "--cache", "4+12"),
                  [*compare_args(compare_models, book, out, "--cache", "4+12"),
                   "--max-tokens", "300"]):
        assert sinklm_main(other) == 2
        err = capsys.readouterr().err
        assert "holds a report made from other inputs" in err and "--overwrite" in err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert "max_tokens differ" in err
    # The same inputs again: the report is rewritten from the cache, no --overwrite needed.
    assert sinklm_main(compare_args(compare_models, book, out, "--cache", "4+12")) == 0
    assert json.loads((out / "report.json").read_text())["results"]["reused"] == 4


@pytest.fixture(scope="module")
def compare_lab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of the sink lab's kind: a word-level symbol vocabulary with an unknown token."""
    vocab = {"<|endoftext|>": 0, "<|unk|>": 1, **{f"sym{i}": i + 2 for i in range(60)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    torch.manual_seed(2)
    model = CausalLM(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16,
                                 max_seq_len=64)).eval()
    checkpoint = Checkpoint(model, tokenizer, [], "tiny-lab", "memory")
    return export_model(checkpoint, tmp_path_factory.mktemp("lab") / "lab")


def test_every_tokenizer_is_checked_against_the_text_before_any_evaluation(
    compare_models: list[Path], compare_lab_model: Path, data_shared: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The first model fits the text, the second cannot read it: nothing is evaluated."""
    book = data_shared / "books" / "frankenstein_shelley_pg84.txt"
    packed = tmp_path / "packed"
    prepare_data(PrepareConfig.from_dict({
        "source": {"path": str(book)}, "output": str(packed),
        "tokenizer": str(compare_models[0] / "tokenizer.json"), "max_tokens": 2000}))
    evaluated: list[str] = []
    monkeypatch.setattr(compare_module, "evaluate",
                        lambda model, *args, **kwargs: evaluated.append("evaluated"))
    models = [str(compare_models[0]), str(compare_lab_model)]
    common = ["--max-tokens", TOKENS, "--cache", "4+12"]
    capsys.readouterr()
    assert sinklm_main(["compare", *models, "--packed", f"{packed}:train", *common,
                        "--output", str(tmp_path / "packed_report")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sinklm compare: {compare_lab_model}: --packed {packed}:train was "
                          "packed with another tokenizer")
    assert sinklm_main(["compare", *models, "--text", str(book), *common,
                        "--output", str(tmp_path / "text_report")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sinklm compare: {compare_lab_model}: frankenstein_shelley_pg84.txt: "
                          "100.0% of its 400 tokens are the unknown token '<|unk|>'")
    assert "(--packed DIR) or on another text" in err
    assert evaluated == []

def test_bad_input_is_refused_before_any_work(
    compare_models: list[Path], data_shared: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    book = data_shared / "books" / "frankenstein_shelley_pg84.txt"
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def refused(args: list[str]) -> str:
        assert sinklm_main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("sinklm compare: ") and "Traceback" not in err
        return err

    assert "--overwrite" in refused(compare_args(compare_models, book, out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sinklm_main(compare_args(compare_models[:1], book, out, "--cache", "4+12",
                                    "--overwrite")) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "report.md").is_file()
    capsys.readouterr()

    fresh = tmp_path / "fresh"
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "is a file" in refused(compare_args(compare_models, book, a_file))
    assert "given twice" in refused(compare_args([compare_models[0]] * 2, book, fresh))
    assert "no such file or folder" in refused(
        compare_args([tmp_path / "missing"], book, fresh))
    assert "does not exist" in refused(compare_args(compare_models, tmp_path / "no.txt", fresh))
    assert "cache '5'" in refused([*compare_args(compare_models, book, fresh), "--cache", "5"])
    assert "did you mean arc_easy" in refused(
        [*compare_args(compare_models, book, fresh), "--tasks", "arc_eazy"])
    assert "--tasks" in refused(
        [*compare_args(compare_models, book, fresh), "--data-dir", str(tmp_path)])
    assert not fresh.exists()


def test_cache_identity_is_the_path_and_the_model_files_stats(tmp_path: Path) -> None:
    """These values name the cache's files: a change would make every earlier report's cache
    unusable."""
    folder = tmp_path / "export"
    (folder / "code").mkdir(parents=True)
    names = ["code/modeling.py", "config.json", "model.safetensors", "tokenizer.json"]
    for name in [*names, "results.json"]:
        (folder / name).write_text(name)

    def stat(path: Path, root: Path) -> list[object]:
        return [path.relative_to(root).as_posix(), path.stat().st_size, path.stat().st_mtime_ns]

    assert checkpoint_identity(str(folder)) == {
        "path": str(folder.resolve()), "files": [stat(folder / n, folder) for n in names]}
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_text("x")
    assert checkpoint_identity(str(ckpt)) == {"path": str(ckpt.resolve()),
                                              "files": [stat(ckpt, tmp_path)]}
    assert checkpoint_identity("EleutherAI/pythia-70m") == {"hub": "EleutherAI/pythia-70m"}


def test_duplicate_names_get_the_distinguishing_end_of_their_path() -> None:
    names = ["tiny-5m-vanilla", "tiny-5m-vanilla", "pythia-70m"]
    sources = ["runs/a/checkpoints/last.ckpt", "runs/b/checkpoints/last.ckpt",
               "EleutherAI/pythia-70m"]
    assert unique_labels(names, sources) == [
        "tiny-5m-vanilla (a/checkpoints/last.ckpt)", "tiny-5m-vanilla (b/checkpoints/last.ckpt)",
        "pythia-70m",
    ]


def test_training_sinks_table_by_hand() -> None:
    history = [{"step": 10, "tokens": 1000, "sink_rate": 0.0, "first_mass": [0.1, 0.2]},
               {"step": 20, "tokens": 2000, "sink_rate": 0.25, "first_mass": [0.5, 0.6]},
               {"step": 30, "tokens": 3000, "sink_rate": 0.5, "first_mass": [0.7, 0.8]}]
    flat = [{**row, "sink_rate": 0.0} for row in history]
    table = training_sinks_markdown({"formed": history, "flat": flat}).splitlines()
    assert table[2] == "| formed | 3 | 3,000 | 2,000 tokens | 0.500 | 0.700, 0.800 |"
    assert table[3] == "| flat | 3 | 3,000 | never | 0.000 | 0.700, 0.800 |"


def test_one_finding_per_model_ties_its_three_measures() -> None:
    """Dependence (0+W against 1+(W-1)), attention to position 0 and Sink_1^eps in one
    finding per model, with the verdict their combination gives."""
    from sinklm.eval.cache import Dense, StartRecent
    from sinklm.eval.compare_tables import model_findings
    from sinklm.eval.streaming import CacheResult

    def result(policy: object, ppl: float, max_position: int = 63) -> CacheResult:
        return CacheResult(policy, np.full(10, np.log(ppl), dtype=np.float32), 1.0, [],
                           max_position)

    def needs(ratio: float) -> list[CacheResult]:
        return [result(StartRecent(0, 64), 5.0 * ratio), result(StartRecent(1, 63), 5.0),
                result(StartRecent(4, 60), 4.9)]

    def attention(*heads: float, non_trigger: float | None = None) -> dict:
        report = {"eps": 0.3, "attention_to_position": [[[h] for h in heads]],
                  "attention_to_first_per_layer": [sum(heads) / len(heads)]}
        if non_trigger is not None:
            report["targets"] = {"non_trigger": [[[non_trigger, 0.1, 0.2]]]}
        return report

    streams = {"sink": [*needs(8.0), result(Dense(), 100.0, 8191)], "partial": needs(8.0),
               "attended": needs(1.01), "none": needs(1.0)}
    sinks = {"sink": attention(0.9, 0.1), "partial": attention(0.12, 0.2, non_trigger=0.26),
             "attended": attention(0.5, 0.1), "none": attention(0.05, 0.02)}
    sink, partial, attended, none = model_findings(streams, sinks, dict.fromkeys(streams, 128))
    assert sink.startswith("sink: it depends on its first token (window-only 0+64 perplexity "
                           "is 8.00x that of 1+63, 40.00 vs 5.00; 4+60 is 2.0% below 1+63); "
                           "attention to position 0 averages 0.500 per layer, and 1 of 2 heads "
                           "give it more than 0.3 (Sink_1^0.3 = 0.500; the strongest head "
                           "0.900). So: a first-token sink")
    assert "Dense attention reaches position 8,191, past the 128 positions" in sink
    assert "(0.260 from non-trigger queries in the strongest head)" in partial
    assert "0 of 2 heads give it more than 0.3" in partial and "a partial sink" in partial
    assert "does not depend" in attended and "yet windows without it lose nothing" in attended
    assert none.endswith("So: no first-token sink by any of the three measures.")
    # Keeping one first token recovers too little: the model needs more than its first.
    (two,) = model_findings({"two": [result(StartRecent(0, 64), 15.5),
                                     result(StartRecent(1, 63), 10.7),
                                     result(StartRecent(4, 60), 5.0)]}, {}, {"two": 128})
    assert two == ("two: it depends on more than its first token (window-only 0+64 perplexity "
                   "is 3.10x that of 4+60, 15.50 vs 5.00, and keeping one, 1+63, is still "
                   "114.0% above it).")
    # A measure that was not taken is left out, and so is the verdict.
    (alone,) = model_findings({"x": needs(8.0)}, {}, {"x": 128})
    assert "depends on its first token" in alone and "So:" not in alone
