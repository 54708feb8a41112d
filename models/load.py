"""Load a model, its tokenizer and its sink ids from whatever a user points at.

One entry point, :func:`load_checkpoint`, so every evaluator accepts the same ``--checkpoint``;
:func:`locate` tells what such a string points at, for loading and for compare's cache.
Supported: a Lightning checkpoint written by ``sinklm fit`` (``.ckpt``: it carries the model
config, the tokenizer with its sink tokens and the sink ids), a folder written by
``sinklm export``, a transformers GPTNeoX folder (``save_pretrained`` output, e.g. a
downloaded Pythia) and a Hugging Face Hub id such as ``EleutherAI/pythia-160m``. For the
folders, sink metadata comes from the ``sinklm`` dict of config.json (``attention_softmax``,
``sink_tokens``, ``sink_token_ids``); a plain Pythia has none, i.e. vanilla softmax and no sink
ids.

transformers is imported only to load a folder or a Hub id: it takes seconds, which a .ckpt
evaluation, or a compare whose results are all cached, should not pay.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer

from sinklm.cli.main import UserError
from sinklm.cli.options import DTYPE_NAMES
from sinklm.models import CausalLM, ConfigError
from sinklm.models.checkpoint import (
    TOKENIZER_KEY,
    CheckpointFormatError,
    load_trained,
    probe_history,
    read_checkpoint,
)
from sinklm.models.config import variant_name
from sinklm.models.convert import (
    config_from_hf,
    from_hf_model,
    from_hf_state_dict,
    needs_remote_code,
    read_export_block,
)

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# The precisions an evaluator may load weights in, by their command-line names.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be loaded or does not fit its tokenizer; the message says which."""


@dataclass
class Checkpoint:
    """A model in eval mode with the tokenizer and sink ids it was trained with."""

    model: CausalLM
    tokenizer: Tokenizer
    sink_token_ids: list[int]
    name: str
    source: str
    # The sink probe's record from training (a `sinklm fit` .ckpt only): one dict per probe
    # with step, tokens, sink_rate (Sink_1^eps) and first_mass (attention to position 0 per
    # layer), so a report can show when sinks formed.
    training_sinks: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """What results files record about the model."""
        config = self.model.config
        return {
            "name": self.name,
            "source": self.source,
            "softmax": config.attention.softmax,
            "sink_tokens": config.sink_tokens,
            "max_seq_len": config.max_seq_len,
            "learned_positions": config.learned_positions,
            "params": self.model.num_params(),
        }


@dataclass(frozen=True)
class Location:
    """What a ``--checkpoint`` string points at: a `sinklm fit` .ckpt, a model folder or a Hub
    id. Found once, so loading and compare's cache identity accept the same strings."""

    kind: Literal["ckpt", "folder", "hub"]
    name: str  # the local path with ``~`` expanded, or the Hub id as given

    @property
    def path(self) -> Path:
        return Path(self.name)


def locate(spec: str | Path, missing: str = "folder") -> Location:
    """Where ``spec`` is, or a CheckpointError saying why it is no checkpoint.

    ``missing`` names what a path that is not there should have been in that error: each
    command keeps the message its users know.
    """
    text = str(spec)
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise CheckpointError(f"{local} has no config.json: {_folder_hint(local)}")
        return Location("folder", str(local))
    if local.is_file() and local.suffix == ".ckpt":
        return Location("ckpt", str(local))
    if local.exists():
        raise CheckpointError(
            f"{local} is a file but not a `sinklm fit` checkpoint (.ckpt): --checkpoint takes "
            "a .ckpt, an exported or transformers GPTNeoX folder, or a Hub id"
        )
    if HUB_ID.fullmatch(text):
        return Location("hub", text)
    raise CheckpointError(f"{text}: no such {missing}, and not a Hub id like org/name")


def _folder_hint(folder: Path) -> str:
    """What a folder without config.json holds: a run's checkpoints (name one), or nothing
    loadable."""
    found = sorted(folder.glob("*.ckpt")) or sorted(folder.glob("checkpoints/*.ckpt"))
    if not found:
        return "expected a transformers GPTNeoX folder (save_pretrained output)"
    last = [path for path in found if path.name == "last.ckpt"]
    pick = last[0] if last else max(found, key=lambda path: path.stat().st_mtime)
    return (f"it holds `sinklm fit` checkpoints ({len(found)}); pass one of them, "
            f"e.g. {pick}")


def load_checkpoint(
    path: str | Path,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Checkpoint:
    """The model at ``path`` (a .ckpt, an exported or GPTNeoX folder, a Hub id) and tokenizer.

    ``tokenizer`` (a tokenizer.json) overrides the one stored with the checkpoint.
    """
    where = locate(path)
    training_sinks: list[dict[str, Any]] = []
    stored_tokenizer: Tokenizer | None = None
    if where.kind == "ckpt":
        model, sink_ids, name, stored_tokenizer, training_sinks = _load_lightning(where.path)
    else:
        model, sink_ids, name = _load_transformers(where)
    source = where.name if where.kind == "hub" else str(where.path.resolve())
    tok = _tokenizer(where, tokenizer, stored_tokenizer)
    check_tokenizer(model, tok, sink_ids)
    model = model.to(device=device, dtype=dtype).eval()
    return Checkpoint(model, tok, sink_ids, name, source, training_sinks)


def load_tokenizer(path: str | Path, tokenizer: str | Path | None = None) -> Tokenizer:
    """The tokenizer :func:`load_checkpoint` gives ``path``, without building the model: a
    comparison checks every checkpoint's tokenizer against its text before evaluating any."""
    where = locate(path)
    stored = None
    if where.kind == "ckpt" and tokenizer is None:
        try:
            stored_text = read_checkpoint(where.path).get(TOKENIZER_KEY)
        except CheckpointFormatError as error:
            raise CheckpointError(str(error)) from error
        if stored_text is None:
            raise CheckpointError(f"{where.path} was not written by `sinklm fit` (no tokenizer "
                                  "in it)")
        stored = Tokenizer.from_str(stored_text)
    return _tokenizer(where, tokenizer, stored)


def _tokenizer(where: Location, override: str | Path | None,
               stored: Tokenizer | None) -> Tokenizer:
    """``override`` (a tokenizer.json), else the one a .ckpt stores, a folder's tokenizer.json
    or the Hub repo's."""
    if override is not None:
        return _tokenizer_file(Path(override).expanduser())
    if stored is not None:
        return stored
    if where.kind == "folder":
        return _tokenizer_file(where.path / "tokenizer.json")
    return _hub_tokenizer(where.name)


def _load_lightning(
    path: Path,
) -> tuple[CausalLM, list[int], str, Tokenizer, list[dict[str, Any]]]:
    """A `sinklm fit` checkpoint (format: ``sinklm.models.checkpoint``): the network's weights,
    config, tokenizer, sink ids and the sink probe's record."""
    try:
        checkpoint = read_checkpoint(path)
        model, tokenizer, sink_ids = load_trained(checkpoint, path)
    except CheckpointFormatError as error:
        raise CheckpointError(str(error)) from error
    name = f"{model.config.name}-{variant_name(model.config)}"
    return model, sink_ids, name, tokenizer, probe_history(checkpoint)


def _load_transformers(where: Location) -> tuple[CausalLM, list[int], str]:
    """A GPTNeoX model by transformers' own loading (local folder or Hub), sink metadata kept.

    Exported variants GPT-NeoX cannot express have model_type ``sinklm``; their config is read
    with our own config class, so no remote code runs.
    """
    from transformers import AutoConfig, GPTNeoXForCausalLM, PretrainedConfig
    from transformers.utils import logging as hf_logging

    from sinklm.models.configuration_sinklm import MODEL_TYPE, SinkLMConfig

    hf_logging.disable_progress_bar()
    path = where.name
    try:
        data, _ = PretrainedConfig.get_config_dict(path)
        hf_config = (
            SinkLMConfig.from_dict(data) if data.get("model_type") == MODEL_TYPE
            else AutoConfig.from_pretrained(path)
        )
        config = config_from_hf(hf_config)
        block = read_export_block(hf_config)
    except (ConfigError, CheckpointFormatError) as error:
        raise CheckpointError(f"{path}: {error}") from error
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read a transformers config ({error})") from error
    sink_ids = block.sink_ids
    name = block.name or Path(path).name
    if not needs_remote_code(config):
        hf_model = GPTNeoXForCausalLM.from_pretrained(path, dtype=torch.float32)
        return from_hf_model(hf_model), sink_ids, name
    # What a plain GPTNeoX cannot hold (sink logits, gates, learned positions) is read as our
    # own state dict.
    model = CausalLM(config)
    model.load_state_dict(from_hf_state_dict(_read_safetensors(where)), strict=True)
    return model, sink_ids, name


def _read_safetensors(where: Location) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors (single file or an indexed set of shards)."""
    from huggingface_hub import snapshot_download
    from safetensors.torch import load_file

    folder = where.path
    if where.kind == "hub":
        folder = Path(snapshot_download(where.name, allow_patterns=["*.json", "*.safetensors"]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{where.name}: no model.safetensors for its sinklm attention variant"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state |= {k: v.float() for k, v in load_file(str(folder / file)).items()}
    return state


def _tokenizer_file(path: Path) -> Tokenizer:
    if not path.is_file():
        raise CheckpointError(f"no tokenizer at {path}; pass --tokenizer PATH/tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception on a malformed file
        raise CheckpointError(f"{path} is not a tokenizers tokenizer.json ({error})") from error


def _hub_tokenizer(hub_id: str) -> Tokenizer:
    try:
        return Tokenizer.from_pretrained(hub_id)
    except Exception as error:  # tokenizers raises plain Exception for Hub failures
        raise CheckpointError(f"cannot load the tokenizer of {hub_id} ({error})") from error


def check_tokenizer(model: CausalLM, tokenizer: Tokenizer, sink_ids: list[int]) -> None:
    """Refuse a tokenizer that cannot belong to the model (its ids or the sink ids collide)."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    rows = model.config.vocab_size
    if vocab > rows:
        raise CheckpointError(
            f"the tokenizer has {vocab} ids but the model embeds only {rows}: "
            "the tokenizer does not match the checkpoint"
        )
    added = tokenizer.get_added_tokens_decoder()
    for sink in sink_ids:
        if not 0 <= sink < rows:
            raise CheckpointError(f"sink id {sink} is outside the model's {rows}-row embedding")
        token = tokenizer.id_to_token(sink)
        if token is not None and not (sink in added and added[sink].special):
            raise CheckpointError(
                f"sink id {sink} is the ordinary token {token!r} in this tokenizer: "
                "the tokenizer does not match the checkpoint"
            )
