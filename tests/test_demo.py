"""`sinklm demo`: the whole path (tokenizer, packing, three trainings, comparison) on a small
corpus cut from the shared books and a model shrunk through the fit arguments, so it takes
seconds; its printed numbers are the report's and those of evaluating the checkpoints directly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from sinklm.cli import demo, demo_lab, demo_runs, demo_text
from sinklm.cli.main import main as sinklm_main
from sinklm.data.sinks import SinkPrefix
from sinklm.data.synthetic import BigramBackcopySpec, build_chain, score_stream
from sinklm.eval import compare as compare_module
from sinklm.eval.cache import StartRecent, parse_caches
from sinklm.eval.generate import Detokenizer, Sampling, Session, answer
from sinklm.eval.report import markdown_table
from sinklm.eval.streaming import evaluate
from sinklm.eval.texts import encode_streams, read_files
from sinklm.models.load import load_checkpoint
from sinklm.train import fit as fit_module

# Shrinks tiny-5m to a 64-token, one-layer model: the orchestration is under test, not the model.
TINY = ["--", "--data.seq_len=64", "--data.micro_batch_size=2",
        '--model.model_overrides={"n_layer": 1, "d_model": 32, "n_head": 2, "max_seq_len": 64}']


@pytest.fixture
def demo_data(data_shared: Path, tmp_path: Path) -> Path:
    """The ../shared/data layout in small: 40 documents of one book, 20k characters of another."""
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "books").mkdir()
    text = (data_shared / "books" / "frankenstein_shelley_pg84.txt").read_text()
    rows = [json.dumps({"text": text[i : i + 4000]}) for i in range(0, 160_000, 4000)]
    (data / "corpus" / "small.jsonl").write_text("\n".join(rows) + "\n")
    book = (data_shared / "books" / "pride_and_prejudice_austen_pg1342.txt").read_text()
    (data / "books" / "book.txt").write_text(book[:20_000])
    return data


def demo_args(data: Path, *extra: str) -> list[str]:
    return ["demo", "--data", str(data), "--steps", "2", "--lab-steps", "2",
            "--max-eval-tokens", "2000", "--lab-eval-tokens", "2000",
            "--output-dir", "runs/demo", "--threads", "1", *extra, *TINY]


def test_demo_runs_the_whole_path_then_reuses_it(
    demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # tokenizers/, packed/ and runs/ land here
    monkeypatch.setattr(demo_text, "hub_unreachable", lambda: "offline in this test")
    monkeypatch.setattr(demo_lab, "GENERATED_CONTEXTS", 2)  # 256 tokens per cache, not 2,560
    made: list[demo_lab.Generation] = []

    def generation(lab: demo_lab.Lab) -> demo_lab.Generation:
        made.append(demo_lab.run_generation(lab))
        return made[-1]

    monkeypatch.setattr(demo, "run_generation", generation)
    threads = torch.get_num_threads()
    try:
        assert sinklm_main(demo_args(demo_data)) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    # The sink lab first: Bigram-Backcopy packed, three bb models, the table from its report.
    assert out.index("## Sink lab") < out.index("## Natural text")
    lab = json.loads(Path("runs/demo/lab/report/report.json").read_text())
    assert [m["label"] for m in lab["models"]] == [
        "lab-1l-vanilla", "lab-1l-zero_sink", "lab-1l-sink_token"]
    assert lab["streaming"]["caches"] == ["0+64", "1+63", "2+62", "4+60", "dense"]
    assert demo_lab.lab_table(argparse.Namespace(files={"json": "runs/demo/lab/report/report.json"})
                          ) in out
    assert all(sentence in out for sentence in lab["streaming"]["findings"])
    # Then the document-aligned lab: its own data, windows and streams led by end-of-document.
    docs = json.loads(Path("runs/demo/lab-docs/report/report.json").read_text())
    assert [m["label"] for m in docs["models"]] == ["lab-1l-vanilla", "lab-1l-zero_sink"]
    assert docs["streaming"]["eod_first"] is True
    assert demo_lab.lab_table(argparse.Namespace(
        files={"json": "runs/demo/lab-docs/report/report.json"})) in out
    assert out.index("Windows mid-stream") < out.index("Windows aligned to documents")
    assert json.loads(Path("packed/bigram_backcopy_docs/meta.json").read_text())["source"][
        "doc_tokens"] == 127
    checkpoint = torch.load("runs/demo/lab-docs/vanilla/checkpoints/last.ckpt",
                            map_location="cpu", weights_only=False)
    assert checkpoint["datamodule_hyper_parameters"]["windows"] == "documents"
    assert json.loads(Path("packed/bigram_backcopy/meta.json").read_text())["source"][
        "synthetic"] == "bigram-backcopy"
    report = json.loads(Path("runs/demo/report/report.json").read_text())
    labels = [m["label"] for m in report["models"]]
    # TINY's overrides name the model: it is no longer the tiny-5m preset.
    tiny = "tiny-5m+n_layer=1+d_model=32+n_head=2+max_seq_len=64"
    assert labels == [f"{tiny}-vanilla", f"{tiny}-zero_sink", f"{tiny}-sink_token"]
    assert report["streaming"]["caches"] == ["0+32", "1+31", "2+30", "4+28", "dense"]
    table = markdown_table([(label, report["streaming"]["results"][label]) for label in labels])
    assert table in out
    assert "skipped: the Hub is unreachable (offline in this test)" in out
    report_md = Path("runs/demo/report/report.md").resolve()
    assert f"report: {report_md} (all 18 results measured in this run)" in out
    assert Path("tokenizers/english_pd_4k/tokenizer.json").is_file()
    assert json.loads(Path("packed/english_pd_mix-bpe4k/meta.json").read_text())["source"][
        "path"] == str(demo_data / "corpus")

    for variant, label in zip(demo_runs.VARIANTS, labels, strict=True):
        path = Path(f"runs/demo/{variant}/checkpoints/last.ckpt")
        assert torch.load(path, map_location="cpu", weights_only=False)["global_step"] == 2
        checkpoint = load_checkpoint(path)
        assert len(checkpoint.sink_token_ids) == (variant == "sink_token")
        streams = encode_streams(read_files([demo_data / "books" / "book.txt"]),
                                 checkpoint.tokenizer, SinkPrefix(checkpoint.sink_token_ids), 2000)
        direct = evaluate(checkpoint.model, streams, parse_caches("0+32,1+31,2+30,4+28,dense"))
        printed = [r["ppl"] for r in report["streaming"]["results"][label]]
        assert printed == pytest.approx([r.ppl for r in direct], rel=1e-5)

    # It ends with the lab's sink-token model generating past its context per cache, scored by
    # the chain; the printed scores are those of the stream `answer` draws with the settings
    # the caption states (the sink id alone, temperature 1, seed 0, past end-of-document).
    (scored,) = made
    assert out.index("## Natural text") < out.index("## Streaming generation") < out.index(
        "\ntime:")
    assert demo_lab.generation_table(scored) in out and "lab generation " in out
    assert (scored.context, scored.tokens, list(scored.scores)) == (128, 256, ["1+126", "0+127"])
    assert scored.truth.copy_accuracy == 1.0 and scored.truth.forbidden == 0
    checkpoint = load_checkpoint("runs/demo/lab/sink_token/checkpoints/last.ckpt")
    chain = build_chain(BigramBackcopySpec.from_dict(
        json.loads(Path("packed/bigram_backcopy/meta.json").read_text())["source"]))
    for policy in (StartRecent(1, 126), StartRecent(0, 127)):
        session = Session(checkpoint.model, policy, Sampling(temperature=1.0, seed=0))
        turn = answer(session, checkpoint.sink_token_ids, Detokenizer(checkpoint.tokenizer), 256)
        assert score_stream(chain, turn.generated_ids, scored_from=128) == scored.scores[
            policy.label]

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rerun must reuse what the first run made")

    monkeypatch.setattr(fit_module, "run_fit", fail)
    monkeypatch.setattr(compare_module, "evaluate", fail)
    assert sinklm_main(demo_args(demo_data)) == 0
    out = capsys.readouterr().out
    assert table in out and "0 results measured in this run, 18 reused" in out
    assert out.count("0 results measured in this run, 18 reused") == 2  # the lab's too
    assert "0 results measured in this run, 12 reused" in out  # the document-aligned lab's
    assert made[1] == scored  # generated again, the same

    assert sinklm_main(demo_args(demo_data, "--steps", "3")) == 2
    err = capsys.readouterr().err
    assert "runs/demo/vanilla holds a run with other settings" in err
    assert "Traceback" not in err


def test_demo_says_what_is_missing(
    demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # no ../shared/data from here
    monkeypatch.setattr(demo_text, "hub_unreachable", lambda: "offline in this test")

    def refused(args: list[str]) -> str:
        assert sinklm_main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("sinklm demo: ") and "Traceback" not in err
        return err

    err = refused(["demo", "--pythia", "none"])
    assert "no local data" in err and "offline in this test" in err and "--data DIR" in err
    assert "no such folder" in refused(["demo", "--data", str(tmp_path / "missing")])
    assert "no corpus/" in refused(["demo", "--data", str(demo_data / "books")])
    assert "--steps 0" in refused(demo_args(demo_data, "--steps", "0"))
    assert "--book" in refused(demo_args(demo_data, "--book", str(tmp_path / "none.txt")))
    assert not Path("runs").exists()
