"""Bigram-Backcopy: the chain's rules, determinism, its tokenizer and the prepare-data path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sinklm.cli.main import main as sinklm_main
from sinklm.data import DataError, PrepareConfig, prepare_data, sink_token_ids
from sinklm.data.packing import read_split
from sinklm.data.synthetic import (
    BigramBackcopySpec,
    SyntheticSource,
    build_chain,
    generate,
    optimal_nll,
    trigger_token_ids,
)
from sinklm.data.tokenizer import tokenizer_hash

SMALL = {"synthetic": "bigram-backcopy", "vocab": 16, "triggers": 2, "successors": 6,
         "doc_tokens": 500, "tokens": 5_000}


def spec(**changes: object) -> BigramBackcopySpec:
    return BigramBackcopySpec.from_dict({**SMALL, **changes})


def test_every_token_follows_the_bigram_or_the_backcopy_rule() -> None:
    chain = build_chain(spec())
    assert chain.triggers.tolist() == np.argsort(-chain.stationary, kind="stable")[:2].tolist()
    assert chain.table[np.ix_(chain.triggers, chain.triggers)].sum() == 0  # no absorbing loops
    assert np.allclose(chain.table.sum(1), 1.0)
    (document,) = generate(chain, [20_000], [[7, 0]])
    is_trigger = chain.is_trigger
    for t in range(2, len(document)):
        if is_trigger[document[t - 1]]:
            assert document[t] == document[t - 2], t  # the copy
        else:
            assert chain.table[document[t - 1], document[t]] > 0, t  # a bigram step
    assert not (is_trigger[document[:-1]] & is_trigger[document[1:]]).any()
    # Empirical transitions out of non-triggers match the table.
    previous, nxt = document[:-1], document[1:]
    plain = ~is_trigger[previous] | (np.arange(len(previous)) == 0)
    row = int(np.bincount(previous[plain]).argmax())
    counts = np.bincount(nxt[plain & (previous == row)], minlength=16)
    assert np.abs(counts / counts.sum() - chain.table[row]).max() < 0.05


def test_documents_are_fixed_by_seed_and_index() -> None:
    one = list(SyntheticSource(spec()).documents(batch_size=3))
    two = list(SyntheticSource(spec(tokens=12_000)).documents(batch_size=4))
    flat_one = [d for block in one for d in block]
    flat_two = [d for block in two for d in block]
    assert all(np.array_equal(a, b) for a, b in zip(flat_one, flat_two[:10], strict=False))
    other = [d for block in SyntheticSource(spec(seed=1)).documents() for d in block]
    assert not np.array_equal(other[0], flat_one[0])
    assert [len(d) for d in flat_one] == [500] * 10
    assert SyntheticSource(spec()).fingerprint != SyntheticSource(spec(seed=1)).fingerprint
    same_table = build_chain(spec(seed=1)).table
    assert np.array_equal(same_table, build_chain(spec()).table)
    assert not np.array_equal(build_chain(spec(table_seed=3)).table, same_table)


def test_optimal_nll_is_zero_on_copies_and_the_row_entropy_elsewhere() -> None:
    chain = build_chain(spec())
    (document,) = generate(chain, [300], [[1, 2]])
    floor = optimal_nll(chain, document)
    for i, t in enumerate(range(1, len(document) - 1)):  # target t + 1 given tokens up to t
        row = chain.table[document[t]]
        entropy = -sum(p * math.log(p) for p in row if p > 0)
        assert floor[i] == pytest.approx(0.0 if chain.is_trigger[document[t]] else entropy)


def test_tokenizer_spells_symbols_and_marks_triggers() -> None:
    source = SyntheticSource(spec())
    tokenizer = source.tokenizer
    text = next(source.iter_texts(batch_size=1))[0]
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    document = next(source.documents(batch_size=1))[0]
    assert ids == (document + 2).tolist()  # symbol i is id i + 2, after <|endoftext|> and unk
    assert trigger_token_ids(tokenizer) == sorted(int(i) + 2 for i in source.chain.triggers)
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    # Sink ids come after the 18 ids and must fit the model's rows.
    assert sink_token_ids(tokenizer, 1, 24) == [18]
    with pytest.raises(DataError, match="no room for 1 sink token"):
        sink_token_ids(SyntheticSource(spec()).tokenizer, 1, 18)


def test_natural_text_tokenizers_have_no_triggers(data_neox_path: Path) -> None:
    from tokenizers import Tokenizer

    assert trigger_token_ids(Tokenizer.from_file(str(data_neox_path))) == []


def test_table_from_a_book_counts_its_bigrams(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("abab abc" * 50 + "xyz")
    chain = build_chain(spec(table=str(book), vocab=4, triggers=1))
    assert chain.units == ["a", "b", " ", "<other>"]  # the 3 most frequent, then the rest
    assert chain.table[0, 1] == pytest.approx(1.0)  # "a" is always followed by "b"
    with pytest.raises(DataError, match="distinct chars, fewer than vocab=40"):
        build_chain(spec(table=str(book), vocab=40))


@pytest.mark.parametrize(("changes", "message"), [
    ({"vocabb": 3}, r"unknown bigram-backcopy parameters \['vocabb'\]; allowed"),
    ({"triggers": 16}, "triggers=16 with vocab=16: .* use triggers < 16"),
    ({"successors": 17}, "successors=17 exceeds vocab=16"),
    ({"vocab": 1}, "vocab=1: must be an integer >= 2"),
    ({"table": "missing.txt"}, "neither 'random' nor a text file"),
    ({"unit": "byte"}, "unit='byte': use char or word"),
    ({"synthetic": "markov"}, "'markov' is not a generator"),
])
def test_bad_parameters_are_one_clear_line(changes: dict[str, object], message: str) -> None:
    with pytest.raises(DataError, match=message):
        BigramBackcopySpec.from_dict({**SMALL, **changes})


def test_prepare_data_packs_the_generator(tmp_path: Path) -> None:
    config = PrepareConfig.from_dict({"source": SMALL, "output": str(tmp_path / "bb"),
                                      "val_fraction": 0.2, "seed": 3})
    meta = prepare_data(config, log=None)
    source = SyntheticSource(spec())
    assert meta["tokenizer_hash"] == tokenizer_hash(source.tokenizer)
    assert meta["source"] == spec().to_dict()
    assert meta["generator"]["trigger_token_ids"] == trigger_token_ids(source.tokenizer)
    assert 1.0 < meta["generator"]["optimal_ppl"] < 16
    assert meta["splits"]["validation"]["documents"] == 2
    documents = [d + 2 for block in source.documents() for d in block]
    packed = np.concatenate([read_split(tmp_path / "bb", "train"),
                             read_split(tmp_path / "bb", "validation")])
    expected = np.concatenate([np.append(d, 0) for d in documents])  # each closed by eod
    assert sorted(packed.tolist()) == sorted(expected.tolist())
    assert prepare_data(config, log=None) == meta  # reused
    with pytest.raises(DataError, match="a synthetic source brings its own vocabulary"):
        PrepareConfig.from_dict({"source": SMALL, "output": "x", "tokenizer": "t.json"})


def test_prepare_data_command_takes_generator_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bb"
    args = ["prepare-data", "--synthetic", "bigram-backcopy", "--param", "vocab=16",
            "--param", "triggers=2", "--param", "tokens=4000", "--param", "doc_tokens=400",
            "--val-fraction", "0.1", "--output", str(out)]
    assert sinklm_main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["source"]["vocab"], meta["source"]["tokens"]) == (16, 4000)
    capsys.readouterr()
    for bad, message in (
        (["--param", "vocab"], "write KEY=VALUE"),
        (["--param", "triggers=20"], "triggers=20 with vocab=16"),
        (["--source", "x.txt"], "--source describe documents, not a generator"),
    ):
        assert sinklm_main([*args[:-2], *bad, "--output", str(tmp_path / "other")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "other").exists()
