"""`sinklm zeroshot`: lm-eval's scores equal our own log-likelihoods, sinks lead every request.

A tiny random model (2 layers, d=64) with the real GPT-NeoX tokenizer, on a few items of the
shared benchmark slices. lm-eval indexes its task YAMLs once per process (~10 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from sinklm.cli.main import main as sinklm_main  # noqa: E402
from sinklm.data.tokenizer import sink_token_ids  # noqa: E402
from sinklm.eval.zeroshot import SinkLMEval, evaluate, summarize  # noqa: E402
from sinklm.eval.zeroshot_tasks import (  # noqa: E402
    PAPER_TASKS,
    ZeroshotError,
    lm_eval_task_names,
    piqa_dataset,
    task_manager,
    task_specs,
    winogrande_record,
)
from sinklm.models import CausalLM, ModelConfig  # noqa: E402
from sinklm.models.hub import export_model  # noqa: E402
from sinklm.models.load import Checkpoint  # noqa: E402

SHARED = Path(
    os.environ.get("SINKLM_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)
TOKENIZER = SHARED / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
BENCHMARKS = SHARED / "benchmarks"
needs_shared = pytest.mark.skipif(
    not (TOKENIZER.is_file() and (BENCHMARKS / "arc_easy").is_dir()),
    reason=f"needs the GPT-NeoX tokenizer and benchmark slices under {SHARED} "
    "(set SINKLM_SHARED_DATA to the shared data folder)",
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def tiny_checkpoint(tokenizer: Tokenizer, sinks: int, max_seq_len: int = 2048) -> Checkpoint:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50304, n_layer=2, n_head=4, d_model=64, max_seq_len=max_seq_len,
        sink_tokens=sinks,
    )
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    ids = sink_token_ids(tokenizer, sinks, config.vocab_size)
    return Checkpoint(CausalLM(config).eval(), tokenizer, ids, f"tiny-{sinks}", "memory")


def spy_on_inputs(model: SinkLMEval, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every row of every forward the network runs, as token ids."""
    seen: list[list[int]] = []
    forward: Callable[..., torch.Tensor] = model.network.forward

    def recording(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.extend(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model.network, "forward", recording)
    return seen


@needs_shared
@pytest.mark.parametrize("sinks", [0, 1])
def test_arc_easy_scores_equal_a_computation_by_hand(
    tokenizer: Tokenizer, sinks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tiny_checkpoint(tokenizer, sinks)
    model = SinkLMEval(checkpoint, batch_size=3)
    seen = spy_on_inputs(model, monkeypatch)
    raw = evaluate(model, task_specs(["arc_easy"], BENCHMARKS), limit=5, log_samples=True)

    # By hand: each choice scored alone as sinks + "Question: ...\nAnswer:" + " choice".
    lines = next((BENCHMARKS / "arc_easy").glob("*.jsonl")).read_text().splitlines()[:5]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    by_doc = {sample["doc_id"]: sample for sample in raw["samples"]["arc_easy"]}
    accs, norms = [], []
    for doc_id, line in enumerate(lines):
        doc = json.loads(line)
        context = encode(f"Question: {doc['question']['stem']}\nAnswer:")
        choices = [choice["text"] for choice in doc["question"]["choices"]]
        gold = [choice["label"] for choice in doc["question"]["choices"]].index(doc["answerKey"])
        lls = []
        for choice in choices:
            continuation = encode(" " + choice)
            ids = torch.tensor([checkpoint.sink_token_ids + context + continuation])
            with torch.no_grad():
                logprobs = F.log_softmax(checkpoint.model(ids)[0].float(), dim=-1)
            start = sinks + len(context)
            lls.append(sum(
                logprobs[start + j - 1, token].item() for j, token in enumerate(continuation)
            ))
        theirs = [ll for ll, _ in by_doc[doc_id]["filtered_resps"]]
        assert theirs == pytest.approx(lls, abs=1e-4)
        accs.append(float(max(range(len(lls)), key=lls.__getitem__) == gold))
        normed = [ll / len(choice) for ll, choice in zip(lls, choices, strict=True)]
        norms.append(float(max(range(len(lls)), key=normed.__getitem__) == gold))
    results = raw["results"]["arc_easy"]
    assert results["acc,none"] == pytest.approx(sum(accs) / 5)
    assert results["acc_norm,none"] == pytest.approx(sum(norms) / 5)

    question = encode("Question:")[0]
    assert seen and all(row[:sinks] == checkpoint.sink_token_ids for row in seen)
    assert all(row[sinks] == question for row in seen)  # text starts right after the sinks


@needs_shared
def test_rolling_and_generation_put_sinks_first(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tiny_checkpoint(tokenizer, 1, max_seq_len=9)  # 8 text tokens per window
    model = SinkLMEval(checkpoint, batch_size=2)
    seen = spy_on_inputs(model, monkeypatch)
    text = "The sink token comes first, then the text."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    eot, sink = model.eot_token_id, checkpoint.sink_token_ids

    short = ids[:8]  # one window: sink, end-of-text, then the text
    with torch.no_grad():
        logprobs = F.log_softmax(checkpoint.model(torch.tensor([[*sink, eot, *short]]))[0], -1)
    expected = sum(logprobs[j + 1, token].item() for j, token in enumerate(short))
    seen.clear()  # the line above ran the same network
    request = Instance("loglikelihood_rolling", {}, (tokenizer.decode(short),), 0)
    assert model.loglikelihood_rolling([request], disable_tqdm=True)[0] == pytest.approx(
        expected, abs=1e-4
    )
    several = model.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True
    )
    assert len(ids) > 8 and several[0] < 0
    assert all(row[:1] == sink and len(row) <= 9 for row in seen)

    seen.clear()
    prompt = "The quick brown"
    gen = {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": False}
    got = model.generate_until([Instance("generate_until", {}, (prompt, gen), 0)], True)[0]
    assert seen[0][:1] == sink
    tokens = sink + tokenizer.encode(prompt, add_special_tokens=False).ids[-5:]
    with torch.no_grad():  # greedy without a cache: the whole sequence each step
        for _ in range(4):
            tokens.append(int(checkpoint.model(torch.tensor([tokens]))[0, -1].argmax()))
    expected_text = tokenizer.decode(tokens[-4:], skip_special_tokens=True).split("\n\n")[0]
    assert got == expected_text
    with pytest.raises(ZeroshotError, match="greedily"):
        model.generate_until([Instance("generate_until", {}, (prompt, {"do_sample": True}), 0)])


@needs_shared
def test_every_paper_task_runs_from_local_files(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = SinkLMEval(tiny_checkpoint(tokenizer, 1), batch_size=8)
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lambada's bootstrap: one process
    raw = evaluate(model, task_specs(PAPER_TASKS, BENCHMARKS), limit=2, bootstrap_iters=100)
    summary = summarize(raw, model, {"limit": 2})
    assert summary["lm_eval_version"] == lm_eval.__version__
    assert summary["model"]["sink_token_ids"] == [50277]
    for task in PAPER_TASKS:
        row = summary["tasks"][task]
        assert row["samples"] == 2 and 0.0 <= row["acc"] <= 1.0 and "acc_stderr" in row
        assert str(BENCHMARKS.resolve()) in row["source"]
        has_norm = task not in ("lambada_openai", "winogrande")
        assert ("acc_norm" in row) == has_norm and ("acc_norm_stderr" in row) == has_norm
    assert summary["tasks"]["lambada_openai"]["perplexity"] > 1.0


@needs_shared
def test_adapters_give_lm_evals_own_prompts_and_targets() -> None:
    from lm_eval.tasks.winogrande import preprocess_winogrande as wino

    lines = next((BENCHMARKS / "winogrande").glob("*.jsonl")).read_text().splitlines()
    for line in lines:
        item = json.loads(line)
        doc = winogrande_record(item["context_options"], item["continuation"], item["gold"])
        assert wino.doc_to_choice(doc) == item["context_options"]
        assert wino.doc_to_target(doc) == item["continuation"].strip()
        assert wino.doc_to_text(doc) == item["gold"]

    labels = (BENCHMARKS / "piqa" / "valid-labels.first500.lst").read_text().split()
    piqa = piqa_dataset(
        {"validation": [str(next((BENCHMARKS / "piqa").glob("*.jsonl")))]},
        {"validation": [str(BENCHMARKS / "piqa" / "valid-labels.first500.lst")]},
    )["validation"]
    assert piqa["label"] == [int(label) for label in labels]

    tasks = task_manager().load(task_specs(["openbookqa", "arc_challenge"], BENCHMARKS))["tasks"]
    obqa = tasks["openbookqa"]
    first_line = next((BENCHMARKS / "openbookqa").glob("*.jsonl")).read_text().split("\n")[0]
    mosaic = json.loads(first_line)
    doc = obqa.test_docs()[0]
    assert obqa.doc_to_text(doc) == mosaic["query"]
    assert obqa.doc_to_choice(doc) == mosaic["choices"]
    assert obqa.doc_to_target(doc) == mosaic["gold"]
    arc = tasks["arc_challenge"]
    doc = arc.test_docs()[0]  # Mercury_7175875: answer C, the third choice
    assert arc.doc_to_text(doc).startswith("Question: An astronomer observes")
    assert arc.doc_to_target(doc) == 2


@needs_shared
def test_bad_task_names_and_data_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ZeroshotError, match="did you mean arc_easy"):
        task_specs(["arc_eazy"])
    (tmp_path / "arc_easy").mkdir()
    with pytest.raises(ZeroshotError, match=r"has no arc_easy/\*\.jsonl"):
        task_specs(["arc_easy"], tmp_path)
    with pytest.raises(ZeroshotError, match="no local definition"):
        task_specs(["sciq"], tmp_path)
    with pytest.raises(ZeroshotError, match="no such folder"):
        task_specs(["arc_easy"], tmp_path / "missing")


@needs_shared
def test_cli_writes_results_and_refuses_bad_input(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = export_model(tiny_checkpoint(tokenizer, 1), tmp_path / "model")
    output = tmp_path / "results.json"
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    args = ["zeroshot", "--checkpoint", str(folder), "--data-dir", str(BENCHMARKS),
            "--limit", "2", "--batch-size", "4", "--bootstrap-iters", "100"]
    assert sinklm_main([*args, "--tasks", "arc_easy,lambada_openai", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert results["lm_eval_version"] == lm_eval.__version__
    assert results["model"]["sink_token_ids"] == [50277]
    arc = results["tasks"]["arc_easy"]
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(arc) and arc["samples"] == 2
    assert {"acc", "acc_stderr", "perplexity"} <= set(results["tasks"]["lambada_openai"])
    capsys.readouterr()

    def refused(*extra: str) -> str:
        assert sinklm_main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sinklm zeroshot: ") and "Traceback" not in err
        return err

    assert "--overwrite" in refused("--tasks", "arc_easy", "--output", str(output))
    assert "did you mean" in refused("--tasks", "hellaswa", "--output", str(tmp_path / "b.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    err = refused("--tasks", "piqa", "--data-dir", str(empty), "--output", str(tmp_path / "c.json"))
    assert "piqa/*.jsonl" in err
    assert "--limit 0" in refused("--limit", "0", "--output", str(tmp_path / "d.json"))

    def unreachable(**kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub")

    monkeypatch.setattr(lm_eval, "simple_evaluate", unreachable)
    hub = ["zeroshot", "--checkpoint", str(folder), "--tasks", "arc_easy", "--output",
           str(tmp_path / "e.json")]
    assert sinklm_main(hub) == 1
    assert "--data-dir FOLDER reads local files" in capsys.readouterr().err


@needs_shared
def test_lm_eval_finds_the_model_by_name(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """``lm_eval.simple_evaluate(model="sinklm", model_args="checkpoint=...")`` builds it."""
    folder = export_model(tiny_checkpoint(tokenizer, 1), tmp_path / "model")
    model_class = lm_eval.api.registry.get_model("sinklm")
    assert model_class is SinkLMEval
    model = model_class.create_from_arg_string(f"checkpoint={folder},batch_size=2", {})
    assert model.sink_ids == [50277] and model.batch_size == 2 and model.max_length == 2047
    with pytest.raises(ZeroshotError, match="batch_size='auto'"):
        SinkLMEval(model.checkpoint, batch_size="auto")


def test_task_names_read_as_text_cover_lm_evals_index() -> None:
    """A superset of the index lm-eval builds (~10 s), so a name missing from it is surely not
    lm-eval's; and hardly more, so "did you mean" offers real tasks."""
    indexed = set(task_manager().all_tasks)
    names = lm_eval_task_names()
    assert indexed <= names
    assert len(names - indexed) <= 0.001 * len(indexed), sorted(names - indexed)


def test_task_names_and_local_files_are_checked_before_torch_loads(tmp_path: Path) -> None:
    """In a fresh interpreter: the refusals come without importing torch or lm-eval."""
    (tmp_path / "arc_easy").mkdir()
    cases = [(list(PAPER_TASKS), None), (["arc_easy", "hellaswa"], None),
             (["arc_easy"], str(tmp_path)), (["sciq"], str(tmp_path)),
             (["piqa"], str(tmp_path / "absent"))]
    script = (
        "import json, sys\nfrom sinklm.eval.zeroshot_tasks import ZeroshotError, check_tasks\n"
        f"errors = []\nfor names, data_dir in {cases!r}:\n"
        "    try:\n        check_tasks(names, data_dir)\n"
        "    except ZeroshotError as error:\n        errors.append(str(error))\n"
        "print(json.dumps([errors, [m for m in ('torch', 'lm_eval') if m in sys.modules]]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    errors, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert len(errors) == 4  # the paper's tasks pass
    assert errors[0].startswith("lm-eval has no task 'hellaswa'; did you mean hellaswag")
    assert "has no arc_easy/*.jsonl" in errors[1]
    assert "no local definition for 'sciq'" in errors[2]
    assert errors[3].endswith("absent: no such folder")
