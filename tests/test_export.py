"""`sinklm export`: transformers loads every variant with our logits; tokenizer, card, Hub, safety.

Checkpoints are tiny random models with a tiny BPE trained in the test (helpers/export_models).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from helpers.export_models import (  # noqa: E402
    TEXT,
    load_export,
    make_checkpoint,
    run_without_sinklm,
    tiny_tokenizer,
)
from tokenizers import Tokenizer  # noqa: E402

from sinklm.cli.main import main as sinklm_main  # noqa: E402
from sinklm.models.hub import (  # noqa: E402
    CUSTOM_GENERATE,
    NETWORK_FILES,
    WRAPPER_FILES,
    ExportError,
    HubError,
    export_model,
    find_results,
    find_training_recipe,
    push_to_hub,
)
from sinklm.models.load import load_checkpoint  # noqa: E402

VARIANTS = [("softmax", 0), ("softmax", 1), ("softmax1", 0), ("sink_logit", 0), ("gated", 2)]


@pytest.fixture(scope="module")
def base_tokenizer() -> Tokenizer:
    return tiny_tokenizer()


@pytest.mark.parametrize(("softmax", "sinks"), VARIANTS)
def test_transformers_loads_every_variant_with_our_logits(
    tmp_path: Path, base_tokenizer: Tokenizer, softmax: str, sinks: int
) -> None:
    checkpoint = make_checkpoint(base_tokenizer, softmax, sinks)
    folder = export_model(checkpoint, tmp_path / "export")
    remote = softmax != "softmax"
    config = json.loads((folder / "config.json").read_text())
    assert config["sinklm"]["attention_softmax"] == softmax
    assert config["sinklm"]["sink_token_ids"] == checkpoint.sink_token_ids
    assert ("auto_map" in config) == remote
    assert config["model_type"] == ("sinklm" if remote else "gpt_neox")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "README.md",
                 CUSTOM_GENERATE):
        assert (folder / name).is_file(), name
    assert all((folder / name).is_file() == remote for name in NETWORK_FILES + WRAPPER_FILES)

    hf_model, hf_tokenizer = load_export(folder, remote)
    expected_class = "SinkLMForCausalLM" if remote else "GPTNeoXForCausalLM"
    assert type(hf_model).__name__ == expected_class
    if remote:  # the folder's copy of our code, not the installed sinklm package
        assert type(hf_model).__module__.startswith("transformers_modules.")

    encoded = hf_tokenizer(TEXT, return_tensors="pt")
    text_ids = checkpoint.tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert encoded["input_ids"][0].tolist() == checkpoint.sink_token_ids + text_ids
    plain = hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert plain == text_ids
    with torch.no_grad():
        theirs = hf_model(**encoded).logits
        ours = checkpoint.model(encoded["input_ids"])
    assert (theirs - ours).abs().max().item() < 1e-4


def test_remote_code_generates_like_our_greedy_decoding(
    tmp_path: Path, base_tokenizer: Tokenizer
) -> None:
    checkpoint = make_checkpoint(base_tokenizer, "sink_logit", 1, seed=1)
    hf_model, hf_tokenizer = load_export(export_model(checkpoint, tmp_path / "e"), remote=True)
    prompt = hf_tokenizer("the lazy", return_tensors="pt")["input_ids"]
    generated = hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, checkpoint.model(ids)[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == ids.tolist()
    with pytest.raises(ValueError, match="padding mask"):
        hf_model(prompt, attention_mask=torch.zeros_like(prompt))


def test_remote_code_loads_offline_in_a_fresh_process(
    tmp_path: Path, base_tokenizer: Tokenizer
) -> None:
    """HF_HUB_OFFLINE=1, an empty module cache and sinklm not importable (a transformers user
    has only the folder): the folder alone is enough."""
    checkpoint = make_checkpoint(base_tokenizer, "gated", 1)
    folder = export_model(checkpoint, tmp_path / "offline")
    ids = torch.tensor([[*checkpoint.sink_token_ids, 5, 17, 42, 99]])
    with torch.no_grad():
        torch.save({"ids": ids, "logits": checkpoint.model(ids)}, tmp_path / "expected.pt")
    output = run_without_sinklm(f"""
        import torch, transformers
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        model = transformers.AutoModelForCausalLM.from_pretrained(
            {str(folder)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
        print(type(model).__module__, diff)
    """, tmp_path)
    module, diff = output.split()[-2:]
    assert module.startswith("transformers_modules.") and float(diff) < 1e-4


def test_shipped_code_is_everything_its_imports_need(
    tmp_path: Path, base_tokenizer: Tokenizer
) -> None:
    from transformers.dynamic_module_utils import get_relative_import_files

    folder = export_model(make_checkpoint(base_tokenizer, "softmax1", 0), tmp_path / "e")
    needed = {Path(f).name for f in get_relative_import_files(str(folder / "modeling_sinklm.py"))}
    assert needed == set(NETWORK_FILES) | {"configuration_sinklm.py"}


def test_reexport_keeps_one_sink_template_and_carries_recipe_and_results(
    tmp_path: Path, base_tokenizer: Tokenizer
) -> None:
    checkpoint = make_checkpoint(base_tokenizer, "softmax", 1)
    first = export_model(checkpoint, tmp_path / "first", training={"lr": 6e-4, "steps": 100})
    (first / "zeroshot_results.json").write_text(json.dumps({
        "kind": "sinklm-zeroshot", "lm_eval_version": "0.4.13",
        "tasks": {"arc_easy": {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.25,
                               "acc_norm_stderr": 0.05, "samples": 20, "version": 1.0}},
    }))
    (first / "stream_results.json").write_text(json.dumps({"window": {"ppl": 12.5}}))
    reloaded = load_checkpoint(first)
    assert reloaded.sink_token_ids == checkpoint.sink_token_ids
    second = export_model(
        reloaded, tmp_path / "second",
        training=find_training_recipe(first), results=find_results(first),
    )
    tokenizer = Tokenizer.from_file(str(second / "tokenizer.json"))
    text_ids = tokenizer.encode("dog", add_special_tokens=False).ids
    assert tokenizer.encode("dog").ids == checkpoint.sink_token_ids + text_ids  # one sink, not two
    card = (second / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and "sink-token" in front["tags"]
    assert "lr: 0.0006" in card and "steps: 100" in card
    assert "| arc_easy | acc | 0.5000 | 0.1000 | 20 |" in card
    assert "| arc_easy | acc_norm | 0.2500 | 0.0500 | 20 |" in card
    assert "| window.ppl | 12.5 |" in card


def test_output_folder_rules(tmp_path: Path, base_tokenizer: Tokenizer) -> None:
    checkpoint = make_checkpoint(base_tokenizer, "softmax", 0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="--overwrite"):
        export_model(checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    export_model(checkpoint, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]  # no staging left
    # The checkpoint folder itself, or a folder holding it, is never written, even if asked.
    on_disk = load_checkpoint(out)
    for target in (out, tmp_path):
        with pytest.raises(ExportError, match="never writes over its checkpoint"):
            export_model(on_disk, target, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_model(checkpoint, tmp_path / "file", overwrite=True)


def test_push_to_hub_uploads_the_folder_or_says_why_not(
    tmp_path: Path, base_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    folder = export_model(make_checkpoint(base_tokenizer, "softmax", 1), tmp_path / "e")
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(HubError, match="no Hugging Face token"):
        push_to_hub(folder, "me/tiny")
    with pytest.raises(HubError, match="not a Hub repo id"):
        push_to_hub(folder, "not a repo id", token="hf_x")

    def create_repo(self: object, repo_id: str, **kwargs: object) -> str:
        calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self: object, **kwargs: object) -> None:
        calls.append(("upload_folder", kwargs))

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    url = push_to_hub(folder, "me/tiny", private=True, token="hf_x")
    assert url == "https://huggingface.co/me/tiny"
    assert calls[0] == ("create_repo", {"repo_id": "me/tiny", "private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == str(folder) and calls[1][1]["repo_id"] == "me/tiny"

    def unreachable(self: object, repo_id: str, **kwargs: object) -> str:
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    with pytest.raises(HubError, match=r"cannot upload to me/tiny .*Name or service not known"):
        push_to_hub(folder, "me/tiny", token="hf_x")


def test_cli_export_and_its_errors(
    tmp_path: Path, base_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import huggingface_hub

    source = export_model(make_checkpoint(base_tokenizer, "softmax", 1), tmp_path / "source")
    out = tmp_path / "cli"
    assert sinklm_main(["export", "--checkpoint", str(source), "--output", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    half = tmp_path / "bf16"
    assert sinklm_main(["export", "--checkpoint", str(source), "--output", str(half),
                        "--dtype", "bfloat16"]) == 0
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"

    def run(*args: str) -> tuple[int, str]:
        code = sinklm_main(["export", *args])
        return code, capsys.readouterr().err

    code, err = run("--checkpoint", str(source), "--output", str(out))
    assert code == 2 and err.startswith("sinklm export: ") and "--overwrite" in err
    code, err = run("--checkpoint", str(tmp_path / "missing"), "--output", str(tmp_path / "x"))
    assert code == 2 and "no such folder" in err and "Traceback" not in err
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    code, err = run("--checkpoint", str(source), "--output", str(tmp_path / "y"),
                    "--push-to-hub", "me/tiny")
    assert code == 2 and "no Hugging Face token" in err
    assert not (tmp_path / "y").exists()  # checked before any work
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_x")

    def unreachable(self: object, repo_id: str, **kwargs: object) -> str:
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    code, err = run("--checkpoint", str(source), "--output", str(tmp_path / "z"),
                    "--push-to-hub", "me/tiny", "--private")
    assert code == 1 and "cannot upload to me/tiny" in err and "hf upload" in err
    assert (tmp_path / "z" / "model.safetensors").is_file()  # the export itself is complete
