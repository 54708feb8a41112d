"""Export a sinklm model as a Hugging Face folder, and push it to the Hub.

The folder holds safetensors weights (Pythia's names), config.json, the tokenizer
(tokenizer.json, tokenizer_config.json, special_tokens_map.json), generation_config.json and a
model card (README.md). config.json's ``sinklm`` dict records ``name``, ``attention_softmax``,
``sink_tokens`` and ``sink_token_ids``.

- ``softmax`` models (vanilla, sink-token) are plain ``GPTNeoXForCausalLM`` folders: no remote
  code. For a sink-token model the tokenizer's post-processor puts the sink tokens in front of
  every encoded text, so ``model(**tokenizer(text))`` sees what sinklm saw in training.
- ``softmax1``, ``sink_logit`` and ``gated`` models get model type ``sinklm`` and an ``auto_map``
  to ``modeling_sinklm.py``, shipped with verbatim copies of the models/ files it imports; they
  load with ``trust_remote_code=True``, offline.

The export is built in a temporary folder beside the output and moved in at the end, so a
failure leaves nothing half-written. Input is an in-memory :class:`Checkpoint` (model,
tokenizer, sink ids), whatever kind of checkpoint it was loaded from.
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
from sinklm.eval.zeroshot_tasks import RESULTS_KIND
from sinklm.models import ModelConfig
from sinklm.models.checkpoint import EXPORT_BLOCK_KEY, export_block
from sinklm.models.configuration_sinklm import MODEL_TYPE
from sinklm.models.convert import hf_config_from, to_hf_state_dict
from sinklm.models.load import Checkpoint

# sinklm's network files that modeling_sinklm.py imports (relatively), and the wrapper itself.
NETWORK_FILES = ("config.py", "attention.py", "model.py", "convert.py")
WRAPPER_FILES = ("configuration_sinklm.py", "modeling_sinklm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_sinklm.SinkLMConfig",
    "AutoModelForCausalLM": "modeling_sinklm.SinkLMForCausalLM",
}
RECIPE_FILE = "training_recipe.yaml"
# Where a training recipe may sit beside a checkpoint: a previous export's, LightningCLI's.
RECIPE_NAMES = (RECIPE_FILE, "config.yaml", "hparams.yaml")
SINK_NAME = re.compile(r"<\|sink(_\d+)?\|>")
ATTENTION = {
    "softmax": "vanilla softmax",
    "softmax1": "softmax-off-by-one (a zero sink in every head's denominator)",
    "sink_logit": "one learned sink logit per head in the softmax denominator (as gpt-oss)",
    "gated": "a sigmoid gate on each head's output (Gated Attention)",
}


class ExportError(UserError, ValueError):
    """The export cannot be written as asked; the message says why and what to do."""


class HubError(UserError, RuntimeError):
    """The Hub upload cannot happen (no token, no network); the export folder is intact."""

    code = 1  # a service failed, not the user's input


def needs_remote_code(config: ModelConfig) -> bool:
    """Whether transformers needs sinklm's modeling code: GPT-NeoX computes plain softmax only."""
    return config.attention.softmax != "softmax"


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
        if needs_remote_code(model.config):
            package = Path(sinklm.models.__file__).parent
            for name in NETWORK_FILES + WRAPPER_FILES:
                shutil.copyfile(package / name, staging / name)
        if training:
            (staging / RECIPE_FILE).write_text(yaml.safe_dump(dict(training), sort_keys=False))
        card = model_card(checkpoint, tokenizer, training, results or {}, repo_id or str(out))
        (staging / "README.md").write_text(card)
        if out.exists():
            for path in staging.iterdir():
                os.replace(path, out / path.name)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


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
    if ids:
        steps.append(json.loads(SinkPrefix(ids).template(tokenizer).__getstate__()))
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


def model_card(
    checkpoint: Checkpoint,
    tokenizer: Tokenizer,
    training: Mapping[str, Any] | None,
    results: Mapping[str, Any],
    where: str,
) -> str:
    """README.md: Hub metadata, how to load it, the model, its recipe and its results."""
    config = checkpoint.model.config
    softmax, remote = config.attention.softmax, needs_remote_code(config)
    names = SinkPrefix(checkpoint.sink_token_ids).names(tokenizer)
    tags = ["sinklm", "gpt_neox", "pythia", "attention-sinks", f"attention-{softmax}"]
    if config.sink_tokens:
        tags.append("sink-token")
    if remote:
        tags.append("custom_code")
    front = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}
    trust = ", trust_remote_code=True" if remote else ""
    pairs = zip(names, checkpoint.sink_token_ids, strict=True)
    sinks = ", ".join(f"`{name}` (id {i})" for name, i in pairs)
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {checkpoint.name}",
        "",
        f"A Pythia-style (GPT-NeoX) language model trained with sinklm: attention "
        f"`{softmax}` ({ATTENTION[softmax]}), {config.sink_tokens} sink token(s).",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{where}"{trust})',
        f'model = AutoModelForCausalLM.from_pretrained("{where}"{trust})',
        'inputs = tokenizer("The first token of a text", return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=20)",
        "print(tokenizer.decode(output[0], skip_special_tokens=True))",
        "```",
        "",
    ]
    if names:
        lines += [
            f"The model was trained with {sinks} in front of every sequence, and the tokenizer "
            "puts them there for you: `tokenizer(text)` starts with the sink id(s), so the "
            "model's losses are those it had in training. `add_special_tokens=False` gives the "
            "text alone.",
            "",
        ]
    if remote:
        lines += [
            f"`{softmax}` attention is not something `GPTNeoXForCausalLM` computes, so this "
            "folder ships sinklm's network (`model.py`, `attention.py`, `config.py`, "
            "`convert.py`) with a thin transformers wrapper (`modeling_sinklm.py`); loading "
            "(model and tokenizer: transformers reads the config for both) needs "
            "`trust_remote_code=True` and works offline. Generation recomputes the whole "
            "sequence at each step and padded batches are refused; sinklm's own KV cache is "
            "the fast path.",
            "",
        ]
    lines += [*_model_table(checkpoint), "", "## Training recipe", ""]
    if training:
        lines += ["```yaml", yaml.safe_dump(dict(training), sort_keys=False).rstrip(), "```"]
    else:
        lines.append("No training recipe was found beside the checkpoint.")
    lines += ["", "## Evaluation", ""]
    if not results:
        lines.append("No evaluation results were found beside the checkpoint.")
    for name, data in results.items():
        lines += [*_results_section(name, data), ""]
    return "\n".join(lines).rstrip() + "\n"


def _model_table(checkpoint: Checkpoint) -> list[str]:
    model = checkpoint.model
    config = model.config
    rows = {
        "parameters": f"{model.num_params():,}",
        "layers / d_model / heads": f"{config.n_layer} / {config.d_model} / {config.n_head}",
        "context": f"{config.max_seq_len} tokens, sink tokens included",
        "rotary": f"{config.rotary_pct:g} of each head's dims, base {config.rotary_base:g}",
        "attention": f"`{config.attention.softmax}`",
        "sink token ids": str(list(checkpoint.sink_token_ids) or "none"),
        "vocabulary": f"{config.vocab_size} embedding rows",
        "weights": f"{str(next(model.parameters()).dtype).removeprefix('torch.')} safetensors",
    }
    return ["## Model", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows.items()]


def _results_section(name: str, data: Any) -> list[str]:
    """A zero-shot results file as a table; any other results file as its numeric fields."""
    if isinstance(data, dict) and data.get("kind") == RESULTS_KIND:
        lines = [
            f"Zero-shot, lm-eval {data.get('lm_eval_version')} (`{name}`):",
            "",
            "| task | metric | value | stderr | n |",
            "|---|---|---|---|---|",
        ]
        for task, row in data.get("tasks", {}).items():
            metrics = [
                m for m, value in row.items()
                if isinstance(value, float) and m != "version" and not m.endswith("_stderr")
            ]
            for metric in metrics:
                value, stderr = row[metric], row.get(f"{metric}_stderr")
                shown = f"{stderr:.4f}" if isinstance(stderr, float | int) else ""
                lines.append(f"| {task} | {metric} | {value:.4f} | {shown} | {row['samples']} |")
        return lines
    numbers = list(_numeric_leaves(data, ""))
    lines = [f"`{name}`:", "", "| field | value |", "|---|---|"]
    lines += [f"| {key} | {value:g} |" for key, value in numbers[:50]]
    if len(numbers) > 50:
        lines.append(f"| ... | {len(numbers) - 50} more in the file |")
    return lines


def _numeric_leaves(data: Any, prefix: str) -> Any:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, float | int) and not isinstance(data, bool):
        yield prefix, data


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
