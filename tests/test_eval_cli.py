"""Checkpoint loading and the ``sinklm stream-eval`` / ``sinklm sinks`` commands end to end, on
local transformers GPTNeoX folders with the real GPT-NeoX tokenizer and a real book."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: E402

from sinklm.cli.main import main  # noqa: E402
from sinklm.data.sinks import SinkPrefix  # noqa: E402
from sinklm.eval.texts import (  # noqa: E402
    Stream,
    TextSourceError,
    encode_streams,
    read_files,
    split_dataset_spec,
)
from sinklm.models import CausalLM, ModelConfig  # noqa: E402
from sinklm.models.convert import hf_config_from  # noqa: E402
from sinklm.models.load import CheckpointError, load_checkpoint  # noqa: E402

SHARED_DATA = Path(
    os.environ.get("SINKLM_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)
TOKENIZER = SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
BOOK = SHARED_DATA / "books" / "frankenstein_shelley_pg84.txt"
needs_data = pytest.mark.skipif(
    not (TOKENIZER.is_file() and BOOK.is_file()),
    reason=f"shared data (tokenizer and books) not found under {SHARED_DATA}; "
    "set SINKLM_SHARED_DATA",
)



def hf_folder(path: Path, vocab_size: int = 50304, sinklm: dict | None = None,
              tokenizer: bool = True) -> Path:
    """A random transformers GPTNeoX saved with save_pretrained, plus the real tokenizer."""
    config = transformers.GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False,
    )
    if sinklm is not None:
        config.sinklm = sinklm
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():  # transformers zero-inits biases and norms; make every weight count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    if tokenizer:
        shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


def variant_folder(path: Path, softmax: str) -> tuple[Path, CausalLM]:
    """A folder for a variant plain GPT-NeoX cannot hold: config.json with sinklm metadata and
    our state dict in model.safetensors."""
    torch.manual_seed(1)
    model = CausalLM(ModelConfig(vocab_size=50304, n_layer=2, n_head=4, d_model=32,
                                 max_seq_len=128, attention={"softmax": softmax}, sink_tokens=1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sink_logit"):
                param.normal_()
    path.mkdir()
    config = hf_config_from(model.config).to_dict()
    config["sinklm"] = {"attention_softmax": softmax, "sink_tokens": 1, "sink_token_ids": [50277]}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path, model.eval()


# --- load_checkpoint -----------------------------------------------------------------------------


@needs_data
def test_load_transformers_folder_exactly(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf")
    checkpoint = load_checkpoint(folder)
    assert checkpoint.sink_token_ids == []
    assert checkpoint.model.config.attention.softmax == "softmax"
    assert checkpoint.name == "hf"
    assert checkpoint.tokenizer.get_vocab_size() == 50277
    hf_model = transformers.GPTNeoXForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([checkpoint.tokenizer.encode("It was a dark and stormy night.").ids])
    with torch.no_grad():
        diff = (checkpoint.model(ids) - hf_model(ids).logits).abs().max().item()
    assert diff < 1e-4


@needs_data
def test_load_sink_metadata(tmp_path: Path) -> None:
    meta = {"attention_softmax": "softmax", "sink_tokens": 1, "sink_token_ids": [50277]}
    checkpoint = load_checkpoint(hf_folder(tmp_path / "hf", sinklm=meta))
    assert checkpoint.sink_token_ids == [50277]
    assert checkpoint.model.config.sink_tokens == 1


@needs_data
@pytest.mark.parametrize("softmax", ["softmax1", "sink_logit"])
def test_load_variant_folder(tmp_path: Path, softmax: str) -> None:
    folder, model = variant_folder(tmp_path / "variant", softmax)
    checkpoint = load_checkpoint(folder)
    assert checkpoint.model.config.attention.softmax == softmax
    assert checkpoint.sink_token_ids == [50277]
    ids = torch.tensor([[50277, 12092, 1533]])
    with torch.no_grad():
        assert torch.allclose(checkpoint.model(ids), model(ids), atol=1e-5)


@needs_data
def test_checkpoint_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "file.ckpt").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be read as a checkpoint"):
        load_checkpoint(tmp_path / "file.ckpt")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(CheckpointError, match=r"not a `sinklm fit` checkpoint \(\.ckpt\)"):
        load_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(CheckpointError, match="no such folder"):
        load_checkpoint(tmp_path / "missing" / "deeper" / "path")
    with pytest.raises(CheckpointError, match="no tokenizer at"):
        load_checkpoint(hf_folder(tmp_path / "untokenized", tokenizer=False))
    with pytest.raises(CheckpointError, match="embeds only 1000"):
        load_checkpoint(hf_folder(tmp_path / "small", vocab_size=1000))
    ordinary = {"attention_softmax": "softmax", "sink_tokens": 1, "sink_token_ids": [100]}
    with pytest.raises(CheckpointError, match="ordinary token"):
        load_checkpoint(hf_folder(tmp_path / "ordinary", sinklm=ordinary))
    missing = {"attention_softmax": "softmax", "sink_tokens": 1}
    with pytest.raises(CheckpointError, match="metadata is incomplete"):
        load_checkpoint(hf_folder(tmp_path / "incomplete", sinklm=missing))


# --- text sources ------------------------------------------------------------------------------


def test_dataset_spec() -> None:
    assert split_dataset_spec("deepmind/pg19") == ("deepmind/pg19", "test")
    assert split_dataset_spec("deepmind/pg19:validation") == ("deepmind/pg19", "validation")
    assert split_dataset_spec("./local/folder:train") == ("./local/folder", "train")


@needs_data
def test_streams_take_the_first_tokens_with_sink_ids_in_front() -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    text = "It was a dark and stormy night; the rain fell in torrents."
    documents = iter([("a", text), ("b", "x"), ("c", text), ("d", text)])
    streams = encode_streams(documents, tokenizer, SinkPrefix([50277]), max_tokens=20)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert [s.name for s in streams] == ["a", "c"]  # "b" has a single token: nothing to score
    assert streams[0].sinks.prepend(streams[0].text).tolist() == [50277, *ids]
    assert sum(s.text_tokens for s in streams) == 20 - 1  # "b" counted in the budget
    assert streams[1].text.tolist() == ids[: 20 - 1 - len(ids)]


# --- sinklm stream-eval ------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@needs_data
def test_stream_eval_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = {"attention_softmax": "softmax", "sink_tokens": 1, "sink_token_ids": [50277]}
    folder = hf_folder(tmp_path / "hf", sinklm=meta)
    output = tmp_path / "out" / "results.json"
    caches = "0+32,1+31,4+28,dense,recompute:32:8"
    code, out, err = run_cli(capsys, "stream-eval", "--checkpoint", folder, "--text", BOOK,
                             "--cache", caches, "--max-tokens", 400, "--output", output)
    assert code == 0, err
    document = json.loads(output.read_text())
    assert document["tokens"] == 399
    assert document["sink_token_ids"] == [50277]
    assert document["evaluator"] == "fast"
    rows = document["results"]
    assert [r["cache"] for r in rows] == caches.split(",")
    assert (rows[2]["start"], rows[2]["recent"]) == (4, 28)
    assert rows[3]["start"] is None and rows[4]["stride"] == 8
    for row in rows:
        assert {"cache", "start", "recent", "ppl", "nll", "tokens_per_second"} <= set(row)
        assert row["ppl"] == pytest.approx(np.exp(row["nll"]))
    losses = np.load(output.with_suffix(".npz"))
    assert losses["stream_lengths"].tolist() == [399]
    assert losses["4+28"].shape == (399,)
    assert float(losses["4+28"].mean()) == pytest.approx(rows[2]["nll"], rel=1e-6)
    assert output.with_suffix(".png").stat().st_size > 0
    assert "| Cache config | 0+32 | 1+31 | 4+28 | dense | recompute:32:8 |" in out
    assert "| hf (softmax, sink_tokens=1) |" in out

    # The reference evaluator gives the same numbers.
    reference = tmp_path / "reference.json"
    code, _, err = run_cli(capsys, "stream-eval", "--checkpoint", folder, "--text", BOOK,
                           "--cache", "1+31,recompute:32:8", "--max-tokens", 120, "--reference",
                           "--output", reference)
    assert code == 0, err
    fast = tmp_path / "fast.json"
    run_cli(capsys, "stream-eval", "--checkpoint", folder, "--text", BOOK,
            "--cache", "1+31,recompute:32:8", "--max-tokens", 120, "--output", fast)
    slow_rows = json.loads(reference.read_text())["results"]
    fast_rows = json.loads(fast.read_text())["results"]
    for slow_row, fast_row in zip(slow_rows, fast_rows, strict=True):
        assert abs(slow_row["nll"] - fast_row["nll"]) < 1e-5


@needs_data
def test_stream_eval_dataset_and_default_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "pg"
    data.mkdir()
    text = BOOK.read_text()[:3000]
    rows = [{"text": text[:1500]}, {"text": text[1500:]}]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "results.json"
    code, _, err = run_cli(capsys, "stream-eval", "--checkpoint", hf_folder(tmp_path / "hf"),
                           "--dataset", f"{data}:test", "--max-tokens", 500,
                           "--output", output)
    assert code == 0, err
    document = json.loads(output.read_text())
    assert len(document["streams"]) == 2
    assert document["text_tokens"] == 500
    assert document["tokens"] == 498  # each stream's first token is not scored
    # Default grid: x+y = half the 128-position context.
    assert [r["cache"] for r in document["results"]] == ["0+64", "1+63", "2+62", "4+60", "dense"]
    assert "warning: cache dense: queries reach position" in err


@needs_data
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache", "4+"], "cache '4+': expected X+Y"),
        (["--cache", "a+b"], "cache 'a+b': expected X+Y"),
        (["--cache", "-1+8"], "sizes must be >= 0"),
        (["--max-tokens", "1"], "--max-tokens 1: must be at least 2"),
        (["--text", "missing.txt"], "missing.txt does not exist"),
    ],
)
def test_stream_eval_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    args = {"--checkpoint": str(tmp_path / "absent"), "--text": str(BOOK), "--cache": "4+28"}
    args.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    flat = [f"{key}={value}" for key, value in args.items()]  # --cache=-1+8 is not an option
    code, out, err = run_cli(capsys, "stream-eval", *flat, "--output", tmp_path / "r.json")
    assert code == 2
    assert err.startswith("sinklm stream-eval: ") and message in err
    assert "Traceback" not in err and out == ""


@needs_data
def test_stream_eval_warnings_and_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = hf_folder(tmp_path / "hf")
    code, _, err = run_cli(capsys, "stream-eval", "--checkpoint", folder, "--text", BOOK,
                           "--cache", "4+200,8+500", "--max-tokens", 300,
                           "--output", tmp_path / "r.json")
    assert code == 0
    assert ("cache 4+200: queries reach position 204, past the 128 positions (0..127)") in err
    assert "cache 8+500: 1 of 1 streams (300 tokens or fewer) never fill the 508-token cache" in err

    small = hf_folder(tmp_path / "small", vocab_size=1000)
    code, _, err = run_cli(capsys, "stream-eval", "--checkpoint", small, "--text", BOOK,
                           "--output", tmp_path / "r2.json")
    assert code == 2
    assert "tokenizer has 50277 ids but the model embeds only 1000" in err
    assert "Traceback" not in err


# --- sinklm sinks ------------------------------------------------------------------------------


@needs_data
def test_sinks_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = variant_folder(tmp_path / "variant", "softmax1")
    output = tmp_path / "sinks" / "report.json"
    code, out, err = run_cli(capsys, "sinks", "--checkpoint", folder, "--text", BOOK,
                             "--window", 64, "--windows", 2, "--output", output)
    assert code == 0, err
    document = json.loads(output.read_text())
    assert document["windows"] == 2 and document["window"] == 64
    assert document["sink_token_ids"] == [50277]
    assert np.asarray(document["attention_to_position"]).shape == (2, 4, 4)
    assert np.asarray(document["implicit_sink"]).shape == (2, 4)
    counts = document["token_classes"]["counts"]
    assert counts["first"] == 2 and counts["newline"] > 0 and counts["punctuation"] > 0
    assert all(Path(p).is_file() for p in document["plots"].values())
    assert "Sink_1^0.3 = " in out and "implicit sink" in out

    code, _, err = run_cli(capsys, "sinks", "--checkpoint", folder, "--text", BOOK,
                           "--window", 2, "--output", output, "--overwrite")
    assert code == 2 and "sinklm sinks: --window 2" in err


# --- one overwrite rule ------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["stream-eval", "sinks"])
def test_an_existing_output_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = tmp_path / "book.txt"
    text.write_text("It was a dark and stormy night.\n")
    output = tmp_path / "result.json"
    output.write_text("{}\n")
    argv = [command, "--checkpoint", tmp_path / "absent", "--text", text, "--output", output]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == f"sinklm {command}: --output {output} exists: pass --overwrite to replace it\n"
    assert output.read_text() == "{}\n"
    # With --overwrite the command goes on, as far as the (absent) checkpoint.
    code, _, err = run_cli(capsys, *argv, "--overwrite")
    assert code == 2 and "exists" not in err and str(tmp_path / "absent") in err
    code, _, err = run_cli(capsys, *argv[:-1], tmp_path, "--overwrite")
    assert code == 2 and f"--output {tmp_path} is a folder" in err


def test_chunk_size_help_states_the_evaluators_default(capsys: pytest.CaptureFixture[str]) -> None:
    from sinklm.eval.streaming import DEFAULT_CHUNK

    with pytest.raises(SystemExit):
        main(["stream-eval", "--help"])
    assert f"(default {DEFAULT_CHUNK})" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("command", "beside"), [("stream-eval", "result.npz"),
                                                 ("stream-eval", "result.png"),
                                                 ("sinks", "result_maps.png")])
def test_a_result_beside_the_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, beside: str
) -> None:
    """The losses and plots are results too: a JSON that is missing does not free them."""
    text = tmp_path / "book.txt"
    text.write_text("It was a dark and stormy night.\n")
    (tmp_path / beside).write_bytes(b"kept")
    output = tmp_path / "result.json"
    argv = [command, "--checkpoint", tmp_path / "absent", "--text", text, "--output", output]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == (f"sinklm {command}: {tmp_path / beside} (written beside --output {output}) "
                   "exists: pass --overwrite to replace it\n")
    assert (tmp_path / beside).read_bytes() == b"kept" and not output.exists()


def test_a_text_folder_is_named_as_such(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "stream-eval", "--checkpoint", tmp_path / "absent",
                           "--text", tmp_path, "--output", tmp_path / "r.json")
    assert code == 2
    assert err.startswith(f"sinklm stream-eval: text file {tmp_path} is a folder: name each "
                          "file")


# --- a text the model's tokenizer cannot represent ----------------------------------------------


def symbol_tokenizer(unk: str | None = "<|unk|>") -> Tokenizer:
    """A sink-lab-like vocabulary: end-of-document, unknown, then words sym0..sym59."""
    vocab = {"<|endoftext|>": 0, **({unk: 1} if unk else {}),
             **{f"sym{i}": i + 2 for i in range(60)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=unk) if unk else WordLevel(vocab))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


def test_a_few_unknown_tokens_pass_and_more_are_refused(tmp_path: Path) -> None:
    tokenizer = symbol_tokenizer()
    known = " ".join(f"sym{i % 60}" for i in range(200))
    (tmp_path / "one_percent.txt").write_text(known + " the cat")  # 2 of 202 unknown
    streams = encode_streams(read_files([tmp_path / "one_percent.txt"]), tokenizer,
                             SinkPrefix([]))
    assert streams[0].text_tokens == 202 and int((streams[0].text == 1).sum()) == 2
    (tmp_path / "more.txt").write_text(known + " the cat sat")  # 3 of 203: 1.5%
    with pytest.raises(TextSourceError) as error:
        encode_streams(read_files([tmp_path / "more.txt"]), tokenizer, SinkPrefix([]))
    assert str(error.value) == (
        "more.txt: 1.5% of its 203 tokens are the unknown token '<|unk|>' of the model's "
        "tokenizer (62 ids), more than the 1% allowed: the text is not in that vocabulary; "
        "evaluate on data packed with the model's tokenizer (--packed DIR) or on another text")


def test_a_tokenizer_that_fails_on_the_text_is_refused(tmp_path: Path) -> None:
    (tmp_path / "book.txt").write_text("sym1 sym2 the cat")
    with pytest.raises(TextSourceError, match=r"book\.txt: the model's tokenizer cannot encode "
                       r"this text \(.*\): evaluate on data packed"):
        encode_streams(read_files([tmp_path / "book.txt"]), symbol_tokenizer(None),
                       SinkPrefix([]))


def test_no_document_to_evaluate_names_the_files(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("sym1")
    with pytest.raises(TextSourceError) as error:
        encode_streams(read_files([tmp_path / "empty.txt", tmp_path / "one.txt"]),
                       symbol_tokenizer(), SinkPrefix([]))
    assert str(error.value) == ("no document with at least two tokens to evaluate: "
                                "empty.txt (0 tokens), one.txt (1 token)")


def test_stream_eval_refuses_a_text_outside_the_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sink-lab model on an English book: every token is unknown, so no perplexity."""
    folder = hf_folder(tmp_path / "lab", vocab_size=64, tokenizer=False)
    symbol_tokenizer().save(str(folder / "tokenizer.json"))
    capsys.readouterr()  # save_pretrained's own progress
    book = tmp_path / "book.txt"
    book.write_text("It was a dark and stormy night; the rain fell in torrents.\n" * 10)
    output = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "stream-eval", "--checkpoint", folder, "--text", book,
                             "--cache", "1+7", "--output", output)
    assert (code, out) == (2, "")
    assert err.startswith("sinklm stream-eval: book.txt: 100.0% of its 120 tokens are the "
                          "unknown token '<|unk|>' of the model's tokenizer (62 ids)")
    assert "(--packed DIR) or on another text" in err and err.count("\n") == 1
    assert list(tmp_path.glob("r.*")) == []


# --- progress ------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr", [io.StringIO, Terminal])
def test_progress_bars_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                          stderr: type[io.StringIO]) -> None:
    """A bar's redraws would run into the lines of a log file (`make demo > log`)."""
    from sinklm.eval.cache import Dense
    from sinklm.eval.streaming import evaluate

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16,
                                 max_seq_len=32)).eval()
    streams = [Stream("s", torch.randint(0, 64, (20,)), SinkPrefix([]))]
    monkeypatch.setattr(sys, "stderr", stderr())
    evaluate(model, streams, [Dense()], progress=True)
    written = sys.stderr.getvalue()
    assert ("cache dense" in written) == (stderr is Terminal), repr(written)
