"""SinkPrefix: the one helper that puts the sink ids in front, and the export template == it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from sinklm.data import DataError, load_tokenizer, sink_token_ids
from sinklm.data.sinks import SinkPrefix
from sinklm.models import ModelConfig
from sinklm.models.hub import export_tokenizer

TEXT = "Hello world. It was the best of times,\n\tit was the worst of times <|endoftext|> 12345"


def test_prepend_lists_tensors_and_batches_by_hand() -> None:
    sinks = SinkPrefix([50277, 50278])
    assert sinks.ids == (50277, 50278) and len(sinks) == 2
    assert sinks.prepend([12092, 1533]) == [50277, 50278, 12092, 1533]
    assert sinks.prepend([]) == [50277, 50278]
    assert sinks.prepend(torch.tensor([5, 6, 7])).tolist() == [50277, 50278, 5, 6, 7]
    batch = sinks.prepend(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert batch.tolist() == [[50277, 50278, 1, 2, 3], [50277, 50278, 4, 5, 6]]
    assert batch.dtype == torch.long
    assert sinks.is_sink(torch.tensor([[50278, 3], [1, 50277]])).tolist() == [
        [True, False], [False, True],
    ]


def test_no_sinks_prepends_nothing() -> None:
    sinks = SinkPrefix([])
    assert len(sinks) == 0
    assert sinks.prepend([3, 4]) == [3, 4]
    assert sinks.prepend(torch.tensor([3, 4])).tolist() == [3, 4]
    assert sinks.prepend(torch.tensor([[3, 4]])).tolist() == [[3, 4]]
    assert not sinks.is_sink(torch.tensor([0, 1])).any()


def test_a_prefix_is_a_value() -> None:
    assert SinkPrefix([7]) == SinkPrefix((7,)) == SinkPrefix(torch.tensor([7]).tolist())
    assert hash(SinkPrefix([7, 8])) == hash(SinkPrefix((7, 8)))
    with pytest.raises(AttributeError):
        SinkPrefix([7]).ids = (8,)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("n_sink_ids", "expected"),
    [(0, [12092, 1533]), (1, [50277, 12092, 1533]), (2, [50277, 50278, 12092, 1533])],
)
def test_exported_tokenizer_encodes_as_prepend(
    data_neox_path: Path, n_sink_ids: int, expected: list[int]
) -> None:
    config = ModelConfig.from_preset("pythia-160m", sink_tokens=n_sink_ids)
    tokenizer = load_tokenizer(data_neox_path)
    sink_ids = sink_token_ids(load_tokenizer(data_neox_path), n_sink_ids, config.vocab_size)
    exported = export_tokenizer(tokenizer, sink_ids, config)
    sinks = SinkPrefix(sink_ids)
    assert exported.encode("Hello world").ids == expected
    for text in (TEXT, "", "<|sink|> spelled out"):
        text_ids = exported.encode(text, add_special_tokens=False).ids
        assert exported.encode(text).ids == sinks.prepend(text_ids)
    # The template alone, on a tokenizer without any post-processor, does the same.
    bare = Tokenizer.from_str(exported.to_str())
    bare.post_processor = sinks.template(bare)
    assert bare.encode(TEXT).ids == sinks.prepend(bare.encode(TEXT, add_special_tokens=False).ids)


def test_template_needs_the_sink_tokens(data_neox_path: Path) -> None:
    with pytest.raises(DataError, match="sink id 50277 is not in the tokenizer"):
        SinkPrefix([50277]).template(load_tokenizer(data_neox_path))
