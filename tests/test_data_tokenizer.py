"""Tokenizers: the real Pythia tokenizer, sink ids inside the padded vocabulary, training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sinklm.data import (
    DataError,
    eod_token_id,
    load_tokenizer,
    save_tokenizer,
    sink_token_ids,
    sink_token_names,
    tokenizer_hash,
    train_tokenizer,
)
from sinklm.data.tokenizer import token_dtype
from sinklm.models import ModelConfig

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity. "
) * 20


def test_pythia_tokenizer_facts(data_neox_path: Path) -> None:
    tokenizer = load_tokenizer(data_neox_path)
    assert tokenizer.get_vocab_size() == 50277
    assert tokenizer.encode("Hello world").ids == [12092, 1533]
    assert eod_token_id(tokenizer) == 0
    assert load_tokenizer(data_neox_path.parent).get_vocab_size() == 50277  # a folder works


def test_sink_ids_are_first_free_ids_inside_pythias_padding(data_neox_path: Path) -> None:
    vocab_size = ModelConfig.from_preset("pythia-160m").vocab_size
    assert vocab_size == 50304
    tokenizer = load_tokenizer(data_neox_path)
    assert sink_token_ids(tokenizer, 1, vocab_size) == [50277]
    assert tokenizer.id_to_token(50277) == "<|sink|>"
    # Idempotent, and a second sink extends the first.
    assert sink_token_ids(tokenizer, 1, vocab_size) == [50277]
    assert sink_token_ids(tokenizer, 2, vocab_size) == [50277, 50278]
    assert tokenizer.id_to_token(50278) == "<|sink_1|>"
    assert sink_token_ids(tokenizer, 0, vocab_size) == []
    # Special tokens: never split, and ordinary text never produces them.
    assert tokenizer.encode("<|sink|>").ids == [50277]
    assert 50277 not in tokenizer.encode(TEXT).ids
    assert tokenizer.get_vocab_size() == 50279


def test_all_27_free_ids_fit_and_the_28th_is_an_error(data_neox_path: Path) -> None:
    tokenizer = load_tokenizer(data_neox_path)
    assert sink_token_ids(tokenizer, 27, 50304) == list(range(50277, 50304))
    fresh = load_tokenizer(data_neox_path)
    with pytest.raises(DataError, match="no room for 28 sink token") as error:
        sink_token_ids(fresh, 28, 50304)
    assert "vocab_size >= 50305" in str(error.value)
    assert fresh.get_vocab_size() == 50277  # nothing added on failure


def test_sink_token_names() -> None:
    assert sink_token_names(3) == ["<|sink|>", "<|sink_1|>", "<|sink_2|>"]
    assert sink_token_names(0) == []


def test_hash_is_stable_and_discriminating(data_neox_path: Path, tmp_path: Path) -> None:
    first = load_tokenizer(data_neox_path)
    reference = tokenizer_hash(first)
    assert tokenizer_hash(load_tokenizer(data_neox_path)) == reference
    sink_token_ids(first, 2, 50304)
    assert tokenizer_hash(first) == reference  # sink ids never appear in packed text
    saved = save_tokenizer(first, tmp_path / "copy")
    assert tokenizer_hash(load_tokenizer(saved)) == reference
    changed = load_tokenizer(data_neox_path)
    changed.add_special_tokens(["<|other|>"])
    assert tokenizer_hash(changed) != reference
    assert tokenizer_hash(train_tokenizer([TEXT], vocab_size=300)) != reference


def test_trained_tokenizer_round_trips_and_gets_sinks(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(
        [TEXT, "Ünïcode and emoji 🙂 survive byte-level BPE."], 320, min_frequency=1
    )
    assert tokenizer.get_vocab_size() == 320
    assert eod_token_id(tokenizer) == 0
    assert tokenizer.token_to_id("<|padding|>") == 1
    for text in (TEXT, "Ünïcode and emoji 🙂 survive byte-level BPE.", "  two  spaces\n\n"):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(tokenizer.encode(TEXT).ids) < len(TEXT.encode()) / 3  # it learned merges
    assert sink_token_ids(tokenizer, 2, 384) == [320, 321]
    path = save_tokenizer(tokenizer, tmp_path / "tok")
    assert load_tokenizer(path).token_to_id("<|sink_1|>") == 321
    with pytest.raises(DataError, match="at least 258 ids"):
        train_tokenizer([TEXT], 100)


def test_bad_tokenizer_paths(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(DataError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match=r"bad\.json: not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "bad.json")


def test_token_dtype_boundary() -> None:
    assert token_dtype(50277) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32
