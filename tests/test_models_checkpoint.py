"""The `sinklm fit` checkpoint format, outside the trainer: importing an evaluator imports no
Lightning, and damaged, foreign or inconsistent files are refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.checkpoint import (
    CheckpointFormatError,
    load_trained,
    read_checkpoint,
    write_entries,
)


def test_evaluation_imports_neither_lightning_nor_train() -> None:
    """The dependency arrows point one way: eval loads checkpoints through models/ alone."""
    code = (
        "import sys, sinklm.models.load\n"
        "assert 'lightning' not in sys.modules, 'lightning'\n"
        "train = [m for m in sys.modules if m == 'sinklm.train' or m.startswith('sinklm.train.')]\n"
        "assert not train, train\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def tiny_run(sink_tokens: int = 1) -> tuple[CausalLM, Tokenizer, list[int]]:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-1m", vocab_size=64, d_model=32, n_head=2,
                                     max_seq_len=32, sink_tokens=sink_tokens)
    vocab = {f"w{i}": i for i in range(60)} | {"<sink>": 60}
    return CausalLM(config).eval(), Tokenizer(WordLevel(vocab, unk_token="w0")), [60]


def save(path: Path, model: CausalLM, tokenizer: Tokenizer | None, sink_ids: list[int]) -> Path:
    """What the training module saves: Lightning's state_dict (``model.`` prefix) plus ours."""
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    write_entries(checkpoint, model.config, tokenizer, sink_ids,
                  {"tokenizer_hash": "abc", "source_fingerprint": None})
    torch.save(checkpoint, path)
    return path


def test_written_entries_load_back(tmp_path: Path) -> None:
    model, tokenizer, sink_ids = tiny_run()
    path = save(tmp_path / "run.ckpt", model, tokenizer, sink_ids)
    loaded = load_trained(read_checkpoint(path), path)
    assert loaded.sink_ids == sink_ids
    assert loaded.tokenizer.to_str() == tokenizer.to_str()
    ids = torch.tensor([[60, 3, 7, 11]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), model(ids))


def test_unusable_files_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="no such checkpoint file"):
        read_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n")
    with pytest.raises(CheckpointFormatError, match="cannot be read as a checkpoint") as caught:
        read_checkpoint(tmp_path / "text.ckpt")
    assert "\n" not in str(caught.value)
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(CheckpointFormatError, match=r"not written by `sinklm fit` \(no model"):
        read_checkpoint(tmp_path / "foreign.ckpt")
    model, _, _ = tiny_run()
    untokenized = save(tmp_path / "untokenized.ckpt", model, None, [])
    checkpoint = read_checkpoint(untokenized)
    with pytest.raises(CheckpointFormatError, match="no tokenizer in it"):
        load_trained(checkpoint, untokenized)


def test_sink_ids_must_match_the_models_sink_count(tmp_path: Path) -> None:
    model, tokenizer, _ = tiny_run(sink_tokens=1)
    path = save(tmp_path / "inconsistent.ckpt", model, tokenizer, [])
    with pytest.raises(CheckpointFormatError, match="sink_tokens=1 but was trained with 0"):
        load_trained(read_checkpoint(path), path)
