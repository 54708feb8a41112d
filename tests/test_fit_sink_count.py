"""One sink count for model and data: however the model's config gets its sink tokens (variant,
model.sink_tokens or model_overrides), the collator prepends exactly that many sink ids, and
the checkpoint loads for evaluation and export with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_data import TinyData, tiny_config

from sinklm.models.checkpoint import SINK_IDS_KEY
from sinklm.models.load import CheckpointError, load_checkpoint
from sinklm.train.fit import run_fit


@pytest.mark.parametrize(("variant", "setting", "expected"), [
    ("vanilla", ["--model.model_overrides",
                 "{vocab_size: 640, d_model: 32, n_head: 2, n_layer: 2, max_seq_len: 64, "
                 "sink_tokens: 1}"], 1),
    ("vanilla", ["--model.sink_tokens", "2"], 2),
    ("two_sink_tokens", [], 2),
])
def test_data_prepends_the_models_sink_count(
    train_data: TinyData, tmp_path: Path, variant: str, setting: list[str], expected: int
) -> None:
    config = tiny_config(train_data, tmp_path / "run", variant=variant, steps=1,
                         checkpoint_every=1)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run_fit(["--config", str(path), *setting]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = load_checkpoint(ckpt)
    assert checkpoint.model.config.sink_tokens == expected
    assert len(checkpoint.sink_token_ids) == expected
    # A checkpoint whose model and sink ids disagree (as such runs wrote before) is refused.
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state[SINK_IDS_KEY] = []
    torch.save(state, tmp_path / "broken.ckpt")
    with pytest.raises(CheckpointError, match=f"sink_tokens={expected} but was trained with 0"):
        load_checkpoint(tmp_path / "broken.ckpt")
