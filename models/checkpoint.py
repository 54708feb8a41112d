"""sinklm's formats on disk: the `sinklm fit` checkpoint and the ``sinklm`` block of an export.

Training writes the checkpoint entries (the training module its model and schedule, the data
module its tokenizer, sink ids and identity), a resume checks them and every evaluator loads a
model from them. Every key of the checkpoint lives here, below ``train`` and ``eval`` and without
Lightning, so they stay in step and importing an evaluator does not import the trainer. The
export's config.json ``sinklm`` block is the one format kept elsewhere: ``convert.py`` defines it
(``export_block``, ``read_export_block``), since exported folders ship that module and their
code reads the block without sinklm. The key strings are the on-disk format: changing one
orphans every checkpoint and export written so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tokenizers import Tokenizer

from sinklm.cli.main import UserError

from .config import ModelConfig
from .model import CausalLM

# Where a checkpoint records the model it holds, so a resume into another model is refused.
CHECKPOINT_KEY = "sinklm_model_config"
# Where it records the tokenizer (with its sink tokens) and the sink ids, for evaluation.
TOKENIZER_KEY = "sinklm_tokenizer"
SINK_IDS_KEY = "sinklm_sink_token_ids"
# Where it records its data (tokenizer hash, source fingerprint), so a resume on other data is
# refused; checkpoints written before this key existed lack it.
DATA_KEY = "sinklm_data"
# Where it records the trainer.max_steps its lr schedule spans, so a resume that changes it
# (and with it the cosine's shape from the resumed step on) says so.
SCHEDULE_KEY = "sinklm_schedule"
# The training module holds the network as ``self.model``: its weights' prefix in state_dict.
STATE_PREFIX = "model."
# Lightning's own entries that sinklm reads: the step, and each callback's state by its
# ``state_key`` (the sink probe's is fixed to PROBE_STATE_KEY, so renaming the class keeps it).
GLOBAL_STEP_KEY = "global_step"
CALLBACKS_KEY = "callbacks"
PROBE_STATE_KEY = "SinkProbe"


class CheckpointFormatError(UserError, ValueError):
    """A file is not a usable `sinklm fit` checkpoint; the one-line message starts with its path,
    so a caller can prefix it (``ckpt_path=``) or add its own fix."""


class TrainedModel(NamedTuple):
    """The network a checkpoint holds, with the tokenizer and sink ids it was trained with."""

    model: CausalLM
    tokenizer: Tokenizer
    sink_ids: list[int]


def write_entries(
    checkpoint: dict[str, Any],
    config: ModelConfig,
    tokenizer: Tokenizer | None = None,
    sink_ids: Sequence[int] = (),
    data: dict[str, str | None] | None = None,
) -> None:
    """Add sinklm's entries to a checkpoint being saved: the model config, and the data's
    entries (:func:`write_data_entries`) where given."""
    checkpoint[CHECKPOINT_KEY] = config.to_dict()
    write_data_entries(checkpoint, tokenizer, sink_ids, data)


def write_data_entries(
    checkpoint: dict[str, Any],
    tokenizer: Tokenizer | None,
    sink_ids: Sequence[int] = (),
    data: dict[str, str | None] | None = None,
) -> None:
    """The tokenizer and sink ids when training had a tokenizer (evaluation needs them), and the
    data's identity (a resume checks it)."""
    if tokenizer is not None:
        checkpoint[TOKENIZER_KEY] = tokenizer.to_str()
        checkpoint[SINK_IDS_KEY] = list(sink_ids)
    if data is not None:
        checkpoint[DATA_KEY] = data


def write_schedule(checkpoint: dict[str, Any], max_steps: int) -> None:
    """The trainer.max_steps the lr schedule spans (the cosine's shape depends on it)."""
    checkpoint[SCHEDULE_KEY] = {"max_steps": max_steps}


def schedule_steps(checkpoint: dict[str, Any]) -> int | None:
    """The trainer.max_steps the checkpoint's schedule spanned; None if it predates the record."""
    return (checkpoint.get(SCHEDULE_KEY) or {}).get("max_steps")


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (on CPU, memory-mapped), refusing files `sinklm fit` did not
    write. A .ckpt is a pickle, read in full (Lightning stores more than tensors): only load
    trusted files."""
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:  # torch raises several kinds for a damaged or foreign file
        # Not torch's own words: long, and for a text file they advise re-saving without mmap.
        raise CheckpointFormatError(
            f"{path}: cannot be read as a checkpoint (damaged, cut short, or another kind of "
            "file)"
        ) from error
    if not isinstance(checkpoint, dict) or CHECKPOINT_KEY not in checkpoint:
        raise CheckpointFormatError(
            f"{path} was not written by `sinklm fit` (no model config in it)"
        )
    return checkpoint


def global_step(path: Path) -> int:
    """The optimizer steps the checkpoint at ``path`` was saved after."""
    return int(read_checkpoint(path)[GLOBAL_STEP_KEY])


def probe_history(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The sink probe's record from training: one dict per probe (step, tokens, sink_rate,
    first_mass per layer); empty when the run had no probe."""
    probe = checkpoint.get(CALLBACKS_KEY, {}).get(PROBE_STATE_KEY, {})
    return [dict(row) for row in probe.get("history", [])]


def load_trained(checkpoint: dict[str, Any], path: Path) -> TrainedModel:
    """The network with the checkpoint's weights (fp32, sdpa kernel: the saved kernel is not
    part of the model and may need hardware the reader lacks), its tokenizer and sink ids.

    ``path`` only names the file in errors. Refuses a checkpoint without a tokenizer, and one
    whose sink ids disagree with the model's sink count.
    """
    if TOKENIZER_KEY not in checkpoint:
        raise CheckpointFormatError(
            f"{path} was not written by `sinklm fit` (no tokenizer in it)"
        )
    config = ModelConfig.from_dict(checkpoint[CHECKPOINT_KEY]).replace(
        attention={"backend": "sdpa"}
    )
    sink_ids = [int(i) for i in checkpoint[SINK_IDS_KEY]]
    if len(sink_ids) != config.sink_tokens:
        raise CheckpointFormatError(
            f"{path}: the model has sink_tokens={config.sink_tokens} but was trained with "
            f"{len(sink_ids)} sink ids {sink_ids}: the checkpoint is inconsistent (written by a "
            "sinklm before model and data shared one sink count); retrain it"
        )
    model = CausalLM(config)
    state = {key[len(STATE_PREFIX):]: value for key, value in checkpoint["state_dict"].items()
             if key.startswith(STATE_PREFIX)}
    model.load_state_dict(state, strict=True)
    return TrainedModel(model, Tokenizer.from_str(checkpoint[TOKENIZER_KEY]), sink_ids)
