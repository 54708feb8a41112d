"""Sink diagnostics on a model whose attention is known in closed form (uniform over the causal
prefix), token classes, windows and plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from sinklm.data.sinks import SinkPrefix
from sinklm.eval.sinks import (
    TOKEN_CLASSES,
    classify_positions,
    make_windows,
    markdown_summary,
    measure_sinks,
    plot_sinks,
    token_class,
)
from sinklm.models import CausalLM, ModelConfig


def uniform_model(softmax: str) -> CausalLM:
    """Queries and keys zeroed: every score is 0, so A[t, s] = 1 / (t + 1) for s <= t
    (1 / (t + 2) with softmax1's extra zero logit, the rest going to the implicit sink)."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, n_layer=2, n_head=2, d_model=16, max_seq_len=64,
                         attention={"softmax": softmax})
    model = CausalLM(config).eval()
    d = config.head_dim
    with torch.no_grad():
        for block in model.gpt_neox.layers:
            qkv = block.attention.query_key_value
            for head in range(config.n_head):
                rows = slice(head * 3 * d, head * 3 * d + 2 * d)
                qkv.weight[rows] = 0.0
                qkv.bias[rows] = 0.0
    return model


def word_tokenizer() -> Tokenizer:
    vocab = {"<s>": 0, "a": 1, ",": 2, "\n": 3, "b": 4, " .": 5, "  ": 6}
    return Tokenizer(WordLevel(vocab, unk_token="a"))


def test_token_classes() -> None:
    assert token_class("\n") == token_class(" \n\n") == "newline"
    assert token_class(",") == token_class(" .") == token_class("$") == "punctuation"
    assert token_class(" the") == token_class("  ") == token_class("") == "other"


def test_classify_positions_marks_first_and_sink_ids() -> None:
    ids = torch.tensor([0, 0, 1, 2, 3, 4, 5])
    classes = classify_positions(word_tokenizer(), ids, n_sink_ids=2)
    names = [TOKEN_CLASSES[i] for i in classes.tolist()]
    assert names == ["first", "sink_ids", "other", "punctuation", "newline", "other",
                     "punctuation"]
    without_sinks = classify_positions(word_tokenizer(), ids[2:], n_sink_ids=0)
    assert TOKEN_CLASSES[without_sinks[0]] == "first"


def test_windows_start_with_the_sink_ids() -> None:
    windows = make_windows(torch.arange(10, 30), SinkPrefix([7, 8]), window=6, count=3)
    assert [w.tolist() for w in windows] == [
        [7, 8, 10, 11, 12, 13], [7, 8, 14, 15, 16, 17], [7, 8, 18, 19, 20, 21],
    ]
    tail_dropped = make_windows(torch.arange(10, 15), SinkPrefix([]), window=4, count=9)
    assert len(tail_dropped) == 1  # the tail of one token cannot be scored
    with pytest.raises(ValueError, match="cannot hold"):
        make_windows(torch.arange(10), SinkPrefix([1, 2]), window=2, count=1)


@pytest.mark.parametrize("softmax", ["softmax", "softmax1"])
def test_uniform_attention_in_closed_form(softmax: str) -> None:
    model = uniform_model(softmax)
    t_len = 12
    windows = [torch.randint(1, 50, (t_len,)) for _ in range(2)]
    # first, then 8 newlines, 2 others and a punctuation mark
    classes = [torch.tensor([0] + [2] * 8 + [4, 4, 3]) for _ in windows]
    report = measure_sinks(model, windows, classes, first=3, eps=0.3, map_size=5)

    extra = 1 if softmax == "softmax1" else 0
    t = np.arange(t_len)
    for p in range(3):  # alpha_p = mean over queries t >= p of 1 / (t + 1 + extra)
        expected = np.mean(1.0 / (t[p:] + 1 + extra))
        assert np.allclose(report.to_position[:, :, p], expected, atol=1e-6)
    # Sink_1^0.3: mean_t 1/(t+1) over 12 queries is 0.259 (0.182 with softmax1), both < 0.3.
    assert report.sink_rate(1) == 0.0
    assert measure_sinks(model, windows, classes, eps=0.15).sink_rate(1) == 1.0

    queries = t[1:]  # class shares and the implicit sink average over queries t >= 1
    first_share = np.mean(1.0 / (queries + 1 + extra))
    assert np.allclose(report.class_share[..., TOKEN_CLASSES.index("first")], first_share,
                       atol=1e-6)
    total = report.class_share.sum(-1)
    if softmax == "softmax1":
        implicit = np.mean(1.0 / (queries + 2))
        assert report.implicit_sink is not None
        assert np.allclose(report.implicit_sink, implicit, atol=1e-6)
        assert np.allclose(total + report.implicit_sink, 1.0, atol=1e-6)
    else:
        assert report.implicit_sink is None
        assert np.allclose(total, 1.0, atol=1e-6)
    assert report.class_counts == {"first": 2, "sink_ids": 0, "newline": 16, "punctuation": 2,
                                   "other": 4}
    row = np.tril(np.ones((5, 5))) / (np.arange(5)[:, None] + 1 + extra)
    assert np.allclose(report.attention_map[0, 0], row, atol=1e-6)
    assert report.dominant()[0][0][0] == "newline"


def test_report_json_summary_and_plots(tmp_path: Path) -> None:
    model = uniform_model("softmax1")
    windows = [torch.randint(1, 50, (10,))]
    classes = [classify_positions(word_tokenizer(), windows[0] % 7, n_sink_ids=1)]
    report = measure_sinks(model, windows, classes, first=2)
    document = report.to_json()
    assert set(document["sink_rate"]) == {"1", "2"}
    assert len(document["attention_to_position"]) == 2  # layers
    assert document["token_classes"]["classes"] == list(TOKEN_CLASSES)
    assert len(document["token_classes"]["dominant"][0]) == 2  # heads
    summary = markdown_summary(report)
    assert "Sink_1^0.3" in summary and "| 1 |" in summary
    files = {name: tmp_path / f"sinks_{name}.png" for name in ("first", "maps", "classes")}
    paths = plot_sinks(report, files)
    assert paths == {name: str(path) for name, path in files.items()}
    assert all(path.stat().st_size > 0 for path in files.values())


@pytest.mark.parametrize("softmax", ["softmax", "softmax1"])
def test_targets_per_query_group_in_closed_form(softmax: str) -> None:
    """Uniform attention gives every target of query t the weight 1 / (t + 1) (+1 for the
    zero sink), so each group's mean is that over the group's queries t >= 2."""
    model = uniform_model(softmax)
    extra = softmax == "softmax1"
    ids = torch.tensor([[9, 3, 7, 3, 3, 8, 7, 1, 3, 2, 7, 5]])
    classes = [torch.zeros(12, dtype=torch.long)]
    report = measure_sinks(model, list(ids), classes, first=1, trigger_ids=[3, 7])
    t = np.arange(2, 12)
    weight = 1.0 / (t + 1 + extra)
    trigger = np.isin(ids[0, 2:].numpy(), [3, 7])
    for group, mask in (("all", np.ones_like(trigger)), ("non_trigger", ~trigger),
                        ("trigger", trigger)):
        assert np.allclose(report.targets[group], weight[mask].mean(), atol=1e-6), group
    assert np.allclose(report.non_trigger_first(), weight[~trigger].mean(), atol=1e-6)
    assert "non-trigger queries" in markdown_summary(report)
    plain = measure_sinks(model, list(ids), classes, first=1)  # natural text: no triggers
    assert set(plain.targets) == {"all"} and plain.non_trigger_first() is None
    assert set(report.to_json()["targets"]) == {"targets", "all", "non_trigger", "trigger"}
