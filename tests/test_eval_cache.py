"""Cache specs: parsing, refusals with clear messages, and which entries x+y keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinklm.eval.cache import (
    CacheSpecError,
    Dense,
    Recompute,
    StartRecent,
    paper_caches,
    parse_cache,
    parse_caches,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0+1024", StartRecent(0, 1024)),
        (" 4+1020 ", StartRecent(4, 1020)),
        ("3+0", StartRecent(3, 0)),
        ("dense", Dense()),
        ("recompute:512", Recompute(512, 1)),
        ("recompute:512:64", Recompute(512, 64)),
    ],
)
def test_parse(spec: str, expected: object) -> None:
    assert parse_cache(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("4+", "expected X\\+Y"),
        ("a+b", "expected X\\+Y"),
        ("+4", "expected X\\+Y"),
        ("-1+4", "sizes must be >= 0"),
        ("4+-2", "sizes must be >= 0"),
        ("0+0", "keeps no token"),
        ("recompute", "expected X\\+Y"),
        ("recompute:1", "at least 2"),
        ("recompute:8:8", "stride must lie in 1..7"),
        ("sparse", "expected X\\+Y"),
    ],
)
def test_malformed_specs_say_what_is_accepted(spec: str, message: str) -> None:
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache(spec)
    assert repr(spec) in str(error.value)


def test_lists_keep_order_and_refuse_repeats() -> None:
    policies = parse_caches("0+8,1+7,dense,recompute:8")
    assert [p.label for p in policies] == ["0+8", "1+7", "dense", "recompute:8"]
    with pytest.raises(CacheSpecError, match="repeats 1\\+7"):
        parse_caches("1+7,dense,1+7")
    with pytest.raises(CacheSpecError, match="empty"):
        parse_caches(" , ")


def test_paper_grid_is_table_3() -> None:
    assert [p.label for p in paper_caches(1024)] == [
        "0+1024", "1+1023", "2+1022", "4+1020", "dense",
    ]


def test_start_recent_keeps_first_x_and_last_y() -> None:
    policy = StartRecent(2, 3)
    assert policy.keep_index(5) is None  # not full yet: keep everything
    assert policy.keep_index(6).tolist() == [0, 1, 3, 4, 5]
    assert StartRecent(0, 3).keep_index(4).tolist() == [1, 2, 3]
    assert StartRecent(3, 0).keep_index(4).tolist() == [0, 1, 2]
    assert isinstance(policy.keep_index(6), torch.Tensor)


def test_max_position() -> None:
    assert StartRecent(4, 1020).max_position(100_000) == 1024  # the query sits at x + y
    assert StartRecent(4, 1020).max_position(100) == 99
    assert Dense().max_position(100) == 99
    assert Recompute(64).max_position(1000) == 63


@pytest.mark.parametrize("command", ["stream-eval", "sinks", "compare"])
def test_value_errors_answer_before_torch_loads(tmp_path: Path, command: str) -> None:
    """Importing torch takes seconds: a typo in --cache (or a text that is a folder) is
    refused without it. A fresh interpreter, since this one has imported torch."""
    argv = {
        "stream-eval": ["stream-eval", "--checkpoint", "x", "--text", str(tmp_path),
                        "--cache", "4-4"],
        "sinks": ["sinks", "--checkpoint", "x", "--text", str(tmp_path)],
        "compare": ["compare", "x", "--text", str(tmp_path), "--cache", "4-4",
                    "--output", str(tmp_path / "report")],
    }[command]
    code = ("import contextlib, io, json, sys\nfrom sinklm.cli.main import main\n"
            "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
            f"    status = main({argv!r})\n"
            "print(json.dumps([status, err.getvalue(), 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=tmp_path)
    status, err, torch_loaded = json.loads(done.stdout.splitlines()[-1])
    assert status == 2 and err.startswith(f"sinklm {command}: ")
    assert ("cache '4-4'" if command != "sinks" else "is a folder") in err
    assert not torch_loaded
