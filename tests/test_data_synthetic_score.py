"""Bigram-Backcopy's ground-truth score of a token stream, against a hand computation on a
three-symbol chain, and on the chain's own samples (every copy right, nothing forbidden)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sinklm.data.synthetic import (
    EOD_ID,
    SYMBOL_ID_OFFSET,
    BigramBackcopySpec,
    Chain,
    build_chain,
    generate,
    score_stream,
)

# Symbols a (the trigger), b, c; b never follows c.
TABLE = np.array([[0.0, 0.5, 0.5], [0.5, 0.25, 0.25], [0.25, 0.0, 0.75]])
START = np.array([0.4, 0.3, 0.3])
A, B, C = (SYMBOL_ID_OFFSET + i for i in range(3))
SINK = SYMBOL_ID_OFFSET + 3  # an id past the symbols, as a sink id is


def test_a_stream_scored_by_hand() -> None:
    chain = Chain(TABLE, START, np.array([0]), None)
    stream = [C, A, C, A, B, EOD_ID, A, C, B, SINK, B]
    score = score_stream(chain, stream)
    # c: start 0.3 | a: c->a 0.25 | c: copy of c, right | a: c->a 0.25 | b: copy of c, wrong |
    # end of document | a: start 0.4 | c: a at position 0 copies nothing, a->c 0.5 |
    # b: c->b forbidden | sink: forbidden, a new document | b: start 0.3
    assert (score.copies, score.copied, score.others, score.forbidden) == (2, 1, 8, 2)
    assert score.copy_accuracy == 0.5
    assert score.forbidden_share == 0.25
    expected = (math.log(0.3) + 2 * math.log(0.25) + math.log(0.4) + math.log(0.5)
                + math.log(0.3)) / 6
    assert score.mean_loglik == pytest.approx(expected, rel=1e-12)
    # From index 4 on: the wrong copy, then the second document as above.
    later = score_stream(chain, stream, scored_from=4)
    assert (later.copies, later.copied, later.others, later.forbidden) == (1, 0, 5, 2)
    assert later.loglik == pytest.approx(math.log(0.4) + math.log(0.5) + math.log(0.3))


def test_the_chain_s_own_samples_copy_every_time() -> None:
    chain = build_chain(BigramBackcopySpec(vocab=16, triggers=2, successors=6))
    one, two = generate(chain, [3000, 2000], [[1], [2]])
    score = score_stream(chain, np.concatenate([one + SYMBOL_ID_OFFSET, [EOD_ID],
                                                two + SYMBOL_ID_OFFSET]))
    triggers = chain.is_trigger
    assert score.copies == triggers[one[1:-1]].sum() + triggers[two[1:-1]].sum() > 100
    assert score.copy_accuracy == 1.0 and score.forbidden == 0
    assert score.copies + score.others == 5000
    # Per non-copy token the log-likelihood averages minus the entropy of the row it is drawn
    # from (the start distribution for each document's first token).
    entropy = chain.entropy()
    rows = np.concatenate([entropy[d[:-1][~triggers[d[:-1]] | (np.arange(len(d) - 1) == 0)]]
                           for d in (one, two)])
    assert len(rows) + 2 == score.others
    stationary = chain.stationary[chain.stationary > 0]
    start = -(stationary * np.log(stationary)).sum()
    assert -score.mean_loglik == pytest.approx((rows.sum() + 2 * start) / score.others, rel=0.02)
