"""Export a sinklm model as a Hugging Face folder, and push it to the Hub.

The folder holds safetensors weights (Pythia's names), config.json, the tokenizer
(tokenizer.json, tokenizer_config.json, special_tokens_map.json), generation_config.json and a
model card (README.md, written by ``models/card.py``). config.json's ``sinklm`` dict records
``name``, ``attention_softmax``, ``sink_tokens``, ``sink_token_ids`` and ``learned_positions``.

- ``softmax`` models (vanilla, sink-token) are plain ``GPTNeoXForCausalLM`` folders: no remote
  code. For a sink-token model the tokenizer's post-processor puts the sink tokens in front of
  every encoded text, so ``model(**tokenizer(text))`` sees what sinklm saw in training.
- ``softmax1``, ``sink_logit`` and ``gated`` models, and models with ``learned_positions`` (a
  research option: a learned absolute position table GPT-NeoX has no slot for), get model type
  ``sinklm`` and an ``auto_map`` to ``modeling_sinklm.py``, shipped with verbatim copies of the
  models/ files it imports; they load with ``trust_remote_code=True``, offline.
- Every export ships ``custom_generate/generate.py`` (a copy of ``models/custom_generate.py``):
  transformers' ``generate(..., custom_generate=folder, start_size=x, recent_size=y)`` streams
  through StreamingLLM's start+recent cache as ``sinklm generate`` does.

The export is built in a temporary folder beside the output and moved in at the end, so a
failure leaves nothing half-written. Input is an in-memory :class:`Checkpoint` (model,
tokenizer, sink ids), whatever kind of checkpoint it was loaded from; the training recipe and
results files the card shows are found beside that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from tokenizers import Tokenizer

import sinklm.models
from sinklm.cli.main import UserError
from sinklm.cli.outputs import make_readable
from sinklm.data.errors import DataError
from sinklm.data.sinks import SinkPrefix
from sinklm.data.tokenizer import PAD_TOKEN, eod_token_id, sink_token_ids
from sinklm.models import ModelConfig
from sinklm.models.card import model_card
from sinklm.models.configuration_sinklm import MODEL_TYPE
from sinklm.models.convert import (
    EXPORT_BLOCK_KEY,
    export_block,
    hf_config_from,
    needs_remote_code,
    to_hf_state_dict,
)
from sinklm.models.load import Checkpoint

# sinklm's network files that modeling_sinklm.py imports (relatively), and the wrapper itself.
NETWORK_FILES = ("config.py", "compat.py", "attention.py", "model.py", "convert.py")
WRAPPER_FILES = ("configuration_sinklm.py", "modeling_sinklm.py")
# Where transformers looks for generation code in a model folder, and its source in models/.
CUSTOM_GENERATE = "custom_generate/generate.py"
CUSTOM_GENERATE_SOURCE = "custom_generate.py"
AUTO_MAP = {
    "AutoConfig": "configuration_sinklm.SinkLMConfig",
    "AutoModelForCausalLM": "modeling_sinklm.SinkLMForCausalLM",
}
RECIPE_FILE = "training_recipe.yaml"
# Where a training recipe may sit beside a checkpoint: a previous export's, LightningCLI's.
RECIPE_NAMES = (RECIPE_FILE, "config.yaml", "hparams.yaml")
SINK_NAME = re.compile(r"<\|sink(_\d+)?\|>")


class ExportError(UserError, ValueError):
    """The export cannot be written as asked; the message says why and what to do."""


class HubError(UserError, RuntimeError):
    """The Hub upload cannot happen (no token, no network); the export folder is intact."""

    code = 1  # a service failed, not the user's input


def export_model(
    checkpoint: Checkpoint,
    output: str | Path,
    *,
    training: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``checkpoint`` as a transformers folder at ``output``; returns its path.

    ``training`` is the recipe and ``results`` the evaluation files ({name: parsed JSON}) the
    model card shows; ``repo_id`` is the Hub id the card's example loads. An existing folder
    with files is refused unless ``overwrite``; then the export's files replace theirs and
    other files stay. The checkpoint itself is never written over.
    """
    model = checkpoint.model
    out = check_output(output, checkpoint.source, overwrite)
    tokenizer = export_tokenizer(checkpoint.tokenizer, checkpoint.sink_token_ids, model.config)
    try:
        eod = eod_token_id(tokenizer)
    except DataError as error:
        raise ExportError(str(error)) from error
    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside the output, so the final moves are renames; mkdir (unlike mkdtemp) keeps the
    # umask's permissions, which the renamed folder then has.
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        _write_weights(checkpoint, staging)
        _write_json(staging / "config.json", hf_config_dict(checkpoint, eod))
        write_tokenizer(tokenizer, eod, staging, model.config.max_seq_len)
        _write_generation_config(eod, model.config, staging)
        package = Path(sinklm.models.__file__).parent
        if needs_remote_code(model.config):
            for name in NETWORK_FILES + WRAPPER_FILES:
                shutil.copyfile(package / name, staging / name)
        (staging / CUSTOM_GENERATE).parent.mkdir()
        shutil.copyfile(package / CUSTOM_GENERATE_SOURCE, staging / CUSTOM_GENERATE)
        if training:
            (staging / RECIPE_FILE).write_text(yaml.safe_dump(dict(training), sort_keys=False))
        card = model_card(checkpoint, tokenizer, training, results or {}, repo_id or str(out))
        (staging / "README.md").write_text(card)
        if out.exists():
            _move_into(staging, out)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _move_into(source: Path, target: Path) -> None:
    """Move ``source``'s files into the folder ``target``, replacing same-named files and
    merging subfolders (a re-export's custom_generate/), so other files there stay."""
    for path in source.iterdir():
        if path.is_dir() and (target / path.name).is_dir():
            _move_into(path, target / path.name)
        else:
            os.replace(path, target / path.name)


def check_output(output: str | Path, source: str, overwrite: bool) -> Path:
    """The resolved output folder, refused if it is (or holds) the checkpoint or is in use."""
    out = Path(output).expanduser().resolve()
    src = Path(source).expanduser()
    if src.exists() and (out == src.resolve() or out in src.resolve().parents):
        raise ExportError(
            f"--output {out} is (or holds) the checkpoint {src}: pick another folder, an "
            "export never writes over its checkpoint"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output {out} is a file; give a folder")
    present = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise ExportError(
            f"--output {out} exists and holds {len(present)} entries ({shown}): pass "
            "--overwrite to replace the export's files there (other files stay), or pick "
            "another folder"
        )
    return out


def export_tokenizer(
    tokenizer: Tokenizer, sink_ids: list[int], config: ModelConfig
) -> Tokenizer:
    """A copy of ``tokenizer`` with the sink tokens and a post-processor that prepends them.

    Missing sink tokens are added at their training ids (the first free ids); a sink template
    from an earlier export is replaced, never stacked, and a model without sinks gets none.
    """
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    try:
        ids = sink_token_ids(tokenizer, len(sink_ids), config.vocab_size)
    except DataError as error:
        raise ExportError(str(error)) from error
    if ids != list(sink_ids):
        raise ExportError(
            f"the tokenizer's sink tokens have ids {ids} but the checkpoint's sink ids are "
            f"{list(sink_ids)}: the tokenizer does not belong to this checkpoint"
        )
    data = json.loads(tokenizer.to_str())
    current = data.get("post_processor")
    steps = current["processors"] if current and current["type"] == "Sequence" else [current]
    steps = [step for step in steps if step and not _is_sink_template(step)]
    if ids:  # the template's JSON as the tokenizer writes it (processors have no public one)
        tokenizer.post_processor = SinkPrefix(ids).template(tokenizer)
        steps.append(json.loads(tokenizer.to_str())["post_processor"])
    if len(steps) > 1:
        data["post_processor"] = {"type": "Sequence", "processors": steps}
    else:
        data["post_processor"] = steps[0] if steps else None
    return Tokenizer.from_str(json.dumps(data))


def _is_sink_template(step: Mapping[str, Any]) -> bool:
    specials = step.get("special_tokens") or {}
    return step.get("type") == "TemplateProcessing" and bool(specials) and all(
        SINK_NAME.fullmatch(name) for name in specials
    )


def hf_config_dict(checkpoint: Checkpoint, eod: int) -> dict[str, Any]:
    """config.json: GPT-NeoX's fields, the ``sinklm`` dict, and for variants the auto_map."""
    model = checkpoint.model
    config = model.config
    hf_config = hf_config_from(config)
    hf_config.bos_token_id = hf_config.eos_token_id = eod
    data: dict[str, Any] = json.loads(hf_config.to_json_string())
    data.update(
        architectures=["GPTNeoXForCausalLM"],
        # transformers 4 reads these; 5 reads rope_parameters, which says the same.
        rotary_pct=config.rotary_pct,
        rotary_emb_base=config.rotary_base,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    data[EXPORT_BLOCK_KEY] = export_block(checkpoint.name, config, checkpoint.sink_token_ids,
                                          metadata.version("sinklm"))
    if needs_remote_code(config):
        data.update(model_type=MODEL_TYPE, architectures=["SinkLMForCausalLM"], auto_map=AUTO_MAP)
    return dict(sorted(data.items()))


def _write_weights(checkpoint: Checkpoint, folder: Path) -> None:
    from safetensors.torch import save_file

    model = checkpoint.model
    state = model.state_dict() if needs_remote_code(model.config) else to_hf_state_dict(model)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    path = folder / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    make_readable(path)  # safetensors writes through a private (0600) temporary file


def write_tokenizer(tokenizer: Tokenizer, eod_id: int, folder: Path, max_length: int) -> None:
    """tokenizer.json plus the two small files transformers 4 and 5 both read.

    ``PreTrainedTokenizerFast`` takes tokenizer.json as it is; GPTNeoXTokenizer would rebuild
    the post-processor and drop the sink template.
    """
    tokenizer.save(str(folder / "tokenizer.json"))
    eod = str(tokenizer.id_to_token(eod_id))
    special: dict[str, Any] = {"bos_token": eod, "eos_token": eod, "unk_token": eod}
    if tokenizer.token_to_id(PAD_TOKEN) is not None:
        special["pad_token"] = PAD_TOKEN
    added = tokenizer.get_added_tokens_decoder()
    special["additional_special_tokens"] = [
        token.content for _, token in sorted(added.items()) if SINK_NAME.fullmatch(token.content)
    ]
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
            **special,
        },
    )


def _write_generation_config(eod: int, config: ModelConfig, folder: Path) -> None:
    from transformers import GenerationConfig

    # modeling_sinklm keeps no transformers cache: generation recomputes the whole sequence.
    extra = {"use_cache": False} if needs_remote_code(config) else {}
    GenerationConfig(bos_token_id=eod, eos_token_id=eod, **extra).save_pretrained(folder)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def beside(source: str | Path) -> list[Path]:
    """Folders that belong to a checkpoint: a folder itself; a file's folder and its parent
    (LightningCLI writes ``runs/NAME/config.yaml`` next to ``runs/NAME/checkpoints/``)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return [path]
    if path.is_file():
        return [path.parent, path.parent.parent]
    return []


def find_results(source: str | Path) -> dict[str, Any]:
    """Evaluation results beside a checkpoint: ``*result*.json`` there or one folder down."""
    found: dict[str, Any] = {}
    for folder in beside(source):
        for path in sorted([*folder.glob("*result*.json"), *folder.glob("*/*result*.json")]):
            try:
                found[str(path.relative_to(folder))] = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue  # not a results file after all
    return found


def find_training_recipe(source: str | Path) -> dict[str, Any] | None:
    """The training recipe beside a checkpoint (an earlier export's or LightningCLI's)."""
    for folder in beside(source):
        for name in RECIPE_NAMES:
            path = folder / name
            if path.is_file():
                recipe = yaml.safe_load(path.read_text())
                if isinstance(recipe, dict):
                    return recipe
    return None


def check_hub_token(repo_id: str, token: str | None = None) -> str:
    """The token to push with; refuses a malformed repo id or a missing token up front."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubError(f"--push-to-hub {repo_id!r}: not a Hub repo id like org/name") from error
    token = token or get_token()
    if not token:
        raise HubError(
            "no Hugging Face token: run `hf auth login` or set HF_TOKEN, then push again"
        )
    return token


def push_to_hub(
    folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None
) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it; returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=check_hub_token(repo_id, token))
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, commit_message="Upload sinklm export"
        )
    # huggingface_hub raises its own errors, OSError, and its HTTP library's (requests, httpx)
    # depending on the version; any of them means the upload did not happen.
    except Exception as error:
        raise HubError(
            f"cannot upload to {repo_id} ({type(error).__name__}: {error}); the export in "
            f"{folder} is complete, push it later with `hf upload {repo_id} {folder}`"
        ) from error
    return str(url)
