"""The `sinklm fit` checkpoint format: what sinklm adds to a Lightning checkpoint, and reading it.

Training writes these entries, a resume checks them and every evaluator loads a model from them.
They live here, below ``train`` and ``eval`` and without Lightning, so the three stay in step and
importing an evaluator does not import the trainer. The key strings are the on-disk format:
changing one orphans every checkpoint written so far.
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
    """Add sinklm's entries to a checkpoint being saved: the model config always; the tokenizer
    and sink ids when training had a tokenizer (evaluation needs them), with the data's identity
    (a resume checks it)."""
    checkpoint[CHECKPOINT_KEY] = config.to_dict()
    if tokenizer is not None:
        checkpoint[TOKENIZER_KEY] = tokenizer.to_str()
        checkpoint[SINK_IDS_KEY] = list(sink_ids)
    if data is not None:
        checkpoint[DATA_KEY] = data


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
