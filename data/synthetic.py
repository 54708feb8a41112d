"""Synthetic sources: Bigram-Backcopy, the task on which attention sinks form in minutes.

Bigram-Backcopy (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv 2410.13835): tokens
follow a bigram chain, except after one of k *trigger* symbols (the k most frequent), where the
next token copies the token before the trigger. A head that does the copy is active on triggers
and has nothing to do elsewhere; with a fixed first token in every training window (sinklm's
sink-token variant) it can park its attention there. So the task isolates the mechanism that
natural text shows only after about a billion tokens.

A generator is a source like any other: ``sinklm prepare-data`` packs it into shards with
``meta.json`` (its parameters and fingerprint), splits train/validation by document and writes
its tokenizer, so ``fit``, ``stream-eval``, ``sinks`` and ``compare`` run on it unchanged.
Documents are long streams separated by end-of-document, so a vanilla training window starts
mid-stream, as Pythia's do. Symbols are words of a WordLevel tokenizer (``sym12``; triggers
``trig3``), so the tokenizer that travels with a checkpoint says which ids are triggers.

Two rules keep the chain well defined: a trigger's bigram row never leads to a trigger (two
adjacent triggers would copy each other forever, an absorbing loop), and a trigger at the start
of a document, having nothing before it to copy, is followed by a draw from its bigram row.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from .errors import DataError
from .keys import reject_unknown_keys
from .tokenizer import EOD_TOKEN

BIGRAM_BACKCOPY = "bigram-backcopy"
GENERATORS = (BIGRAM_BACKCOPY,)
# Bump when the generated streams change for the same parameters, so old shards are refused.
GENERATOR_VERSION = 1
UNK_TOKEN = "<|unk|>"
# The tokenizer's ids: end-of-document 0, unknown 1, then symbol i at i + SYMBOL_ID_OFFSET.
EOD_ID, SYMBOL_ID_OFFSET = 0, 2
_SYMBOL, _TRIGGER = "sym", "trig"
_TRIGGER_NAME = re.compile(rf"{_TRIGGER}\d+")
# Documents generated together (one vectorised step over all of them per position).
_BLOCK_DOCUMENTS = 64
# Documents of the sample on which meta.json's loss floor and trigger share are estimated.
_FLOOR_DOCUMENTS = 8


def symbol_name(index: int, trigger: bool) -> str:
    """The word that spells symbol ``index`` in the generated text: ``sym12`` or ``trig3``."""
    return f"{_TRIGGER if trigger else _SYMBOL}{index}"


def trigger_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of a Bigram-Backcopy tokenizer's trigger symbols (none for any other tokenizer)."""
    if json.loads(tokenizer.to_str())["model"]["type"] != "WordLevel":
        return []
    return sorted(
        token_id for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()
        if _TRIGGER_NAME.fullmatch(token)
    )


@dataclass(frozen=True)
class BigramBackcopySpec:
    """The parameters of a Bigram-Backcopy source (``source:`` of a data config).

    vocab:       symbols of the chain (the tokenizer adds end-of-document and unknown).
    triggers:    how many of the most frequent symbols (stationary distribution) are triggers.
    table:       ``random`` (seeded by ``table_seed``), or a UTF-8 text file whose bigram
                 statistics give the table: its ``vocab - 1`` most frequent units, the rest
                 merged into one symbol.
    unit:        for a text table, ``char`` or ``word`` (whitespace-separated).
    successors:  for a random table, nonzero entries per row (a sparse chain; default half
                 the vocabulary).
    zipf:        for a random table, symbol weights ~ rank^-zipf: rows favour frequent symbols.
    dirichlet:   for a random table, the concentration of each row's weights.
    doc_tokens:  tokens per document (the last one takes the remainder).
    tokens:      tokens in all, both splits.
    seed:        the streams (another seed: another stream of the same chain, held out).
    table_seed:  the random table.
    """

    synthetic: str = BIGRAM_BACKCOPY
    vocab: int = 64
    triggers: int = 3
    table: str = "random"
    unit: str = "char"
    successors: int | None = None
    zipf: float = 1.0
    dirichlet: float = 1.0
    doc_tokens: int = 8192
    tokens: int = 4_000_000
    seed: int = 0
    table_seed: int = 0

    def __post_init__(self) -> None:
        if self.synthetic not in GENERATORS:
            raise DataError(f"synthetic: {self.synthetic!r} is not a generator; have {GENERATORS}")
        for name, low in (("vocab", 2), ("triggers", 1), ("successors", 1), ("doc_tokens", 2),
                          ("tokens", 2)):
            value = getattr(self, name)
            if name == "successors" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise DataError(f"bigram-backcopy {name}={value!r}: must be an integer >= {low}")
        if self.triggers >= self.vocab:
            raise DataError(
                f"bigram-backcopy triggers={self.triggers} with vocab={self.vocab}: triggers are "
                f"among the symbols and at least one must stay a plain symbol; use triggers < "
                f"{self.vocab}"
            )
        if self.table == "random" and self.successors is not None and self.successors > self.vocab:
            raise DataError(
                f"bigram-backcopy successors={self.successors} exceeds vocab={self.vocab}; use "
                f"successors <= {self.vocab}"
            )
        if self.unit not in ("char", "word"):
            raise DataError(f"bigram-backcopy unit={self.unit!r}: use char or word")
        for name in ("zipf", "dirichlet"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise DataError(f"bigram-backcopy {name}={value!r}: must be a number >= 0")
        if self.dirichlet == 0:
            raise DataError("bigram-backcopy dirichlet=0: the concentration must be > 0")
        if self.table != "random" and not Path(self.table).expanduser().is_file():
            raise DataError(
                f"bigram-backcopy table={self.table!r}: neither 'random' nor a text file; give "
                "a UTF-8 text (e.g. a book under ../shared/data/books) or 'random'"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BigramBackcopySpec:
        reject_unknown_keys(
            data, cls, "bigram-backcopy parameters", DataError, hidden=("synthetic",)
        )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def row_successors(self) -> int:
        """Nonzero entries per row of a random table."""
        return self.successors if self.successors is not None else max(1, self.vocab // 2)


@dataclass(frozen=True)
class Chain:
    """A Bigram-Backcopy chain: the bigram table, its stationary distribution, the triggers."""

    table: np.ndarray  # [V, V] rows sum to one; trigger rows never lead to a trigger
    stationary: np.ndarray  # [V] of the bigram chain before the trigger rows were cut
    triggers: np.ndarray  # [k] symbol indices, most frequent first
    units: list[str] | None  # for a text table: what each symbol stands for

    @property
    def is_trigger(self) -> np.ndarray:
        mask = np.zeros(len(self.table), dtype=bool)
        mask[self.triggers] = True
        return mask

    def entropy(self) -> np.ndarray:
        """Entropy (nats) of each bigram row: the loss floor after a non-trigger."""
        p = self.table
        return -(p * np.log(np.where(p > 0, p, 1.0))).sum(1)


def _stationary(table: np.ndarray) -> np.ndarray:
    """The chain's stationary distribution (power iteration from uniform; a start-uniform
    average, so periodic or reducible chains still give a distribution)."""
    state = np.full(len(table), 1.0 / len(table))
    total = np.zeros_like(state)
    for _ in range(1000):
        state = state @ table
        total += state
    return total / total.sum()


def _random_table(spec: BigramBackcopySpec) -> np.ndarray:
    rng = np.random.default_rng([spec.table_seed, 0x7AB1E])
    weight = 1.0 / np.arange(1, spec.vocab + 1) ** spec.zipf
    weight /= weight.sum()
    table = np.zeros((spec.vocab, spec.vocab))
    for row in range(spec.vocab):
        successors = rng.choice(spec.vocab, size=spec.row_successors, replace=False, p=weight)
        probs = rng.dirichlet(np.full(len(successors), float(spec.dirichlet))) * weight[successors]
        table[row, successors] = probs / probs.sum()
    return table


def _text_table(spec: BigramBackcopySpec) -> tuple[np.ndarray, list[str]]:
    """Bigram counts of a text's units: the vocab - 1 most frequent, the rest in one symbol."""
    path = Path(spec.table).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"bigram-backcopy table={path}: not UTF-8 text ({error})") from None
    units = list(text) if spec.unit == "char" else text.split()
    counts = Counter(units)
    if len(counts) < spec.vocab:
        raise DataError(
            f"bigram-backcopy table={path}: {len(counts)} distinct {spec.unit}s, fewer than "
            f"vocab={spec.vocab}; use vocab <= {len(counts)} or unit=char/word"
        )
    kept = [unit for unit, _ in counts.most_common(spec.vocab - 1)]
    index = {unit: i for i, unit in enumerate(kept)}
    other = spec.vocab - 1
    ids = np.array([index.get(unit, other) for unit in units], dtype=np.int64)
    table = np.zeros((spec.vocab, spec.vocab))
    np.add.at(table, (ids[:-1], ids[1:]), 1.0)
    unigram = np.bincount(ids, minlength=spec.vocab).astype(float)
    empty = table.sum(1) == 0  # a unit seen only last: it follows the unigram distribution
    table[empty] = unigram
    return table / table.sum(1, keepdims=True), [*kept, "<other>"]


def build_chain(spec: BigramBackcopySpec) -> Chain:
    """The table and triggers of ``spec``: deterministic for its table parameters."""
    table, units = (_random_table(spec), None) if spec.table == "random" else _text_table(spec)
    stationary = _stationary(table)
    triggers = np.argsort(-stationary, kind="stable")[: spec.triggers]
    table = table.copy()
    table[np.ix_(triggers, triggers)] = 0.0
    plain = np.ones(spec.vocab, dtype=bool)
    plain[triggers] = False
    for row in triggers:
        if table[row].sum() == 0:  # the row led only to triggers: the plain symbols' weights
            table[row, plain] = stationary[plain]
    return Chain(table / table.sum(1, keepdims=True), stationary, triggers, units)


def generate(chain: Chain, lengths: list[int], seeds: list[list[int]]) -> list[np.ndarray]:
    """Documents of the given lengths, document i from ``np.random.default_rng(seeds[i])``.

    One vectorised step per position over all documents: position t + 1 copies position t - 1
    after a trigger at t (t >= 1), else is drawn from the bigram row of position t.
    """
    n, longest = len(lengths), max(lengths)
    cdf = np.cumsum(chain.table, axis=1)
    cdf[:, -1] = 1.0  # no draw past the last symbol through rounding
    is_trigger = chain.is_trigger
    uniforms = np.zeros((n, longest))
    first = np.empty(n, dtype=np.int64)
    start_cdf = np.cumsum(chain.stationary)
    for i, seed in enumerate(seeds):
        rng = np.random.default_rng(seed)
        first[i] = min(int(np.searchsorted(start_cdf, rng.random(), side="right")),
                       len(cdf) - 1)
        uniforms[i, 1 : lengths[i]] = rng.random(lengths[i] - 1)
    out = np.empty((n, longest), dtype=np.int64)
    out[:, 0] = first
    for t in range(1, longest):
        previous = out[:, t - 1]
        drawn = (cdf[previous] < uniforms[:, t, None]).sum(1)
        if t >= 2:
            drawn = np.where(is_trigger[previous], out[:, t - 2], drawn)
        out[:, t] = drawn
    return [out[i, : lengths[i]] for i in range(n)]


def optimal_nll(chain: Chain, document: np.ndarray) -> np.ndarray:
    """The loss floor (nats) of each target of ``document`` (tokens 2..): zero for a copy after
    a trigger, the bigram row's entropy otherwise. Its mean is the best any model can do."""
    previous = document[1:-1]
    return np.where(chain.is_trigger[previous], 0.0, chain.entropy()[previous])


@dataclass(frozen=True)
class StreamScore:
    """A token stream judged by the true chain (:func:`score_stream`): a generated stream has
    no reference text, but the process that a Bigram-Backcopy model learned is known."""

    copies: int  # copy positions: after a trigger that follows a symbol of the same document
    copied: int  # of them, tokens that repeat the symbol before the trigger
    others: int  # the other scored positions, drawn from the chain's bigram row (or its start)
    forbidden: int  # of them, tokens the chain gives probability zero
    loglik: float  # the chain's log-probability (nats) of the other, allowed tokens, summed

    @property
    def copy_accuracy(self) -> float:
        return self.copied / self.copies if self.copies else math.nan

    @property
    def mean_loglik(self) -> float:
        """Per allowed non-copy token; minus the bigram entropy on average for the chain's own
        samples (a forbidden token's -inf is counted in ``forbidden`` instead)."""
        allowed = self.others - self.forbidden
        return self.loglik / allowed if allowed else math.nan

    @property
    def forbidden_share(self) -> float:
        return self.forbidden / self.others if self.others else math.nan


def score_stream(chain: Chain, ids: np.ndarray | list[int], scored_from: int = 0) -> StreamScore:
    """Score token ids of the chain's tokenizer as the chain would have produced them, from
    index ``scored_from`` on (the ids before it only set the chain's state).

    The stream starts a document, as does every end-of-document id (a packed stream goes on
    past it; the id itself is not scored). A document's first symbol is scored by the start
    distribution, a symbol after a trigger at document position >= 1 as a copy, every other
    by its bigram row. Any other id (unknown, a sink id) is forbidden, and starts a document
    too: the chain has no state after it.
    """
    with np.errstate(divide="ignore"):
        log_table, log_start = np.log(chain.table), np.log(chain.stationary)
    is_trigger = chain.is_trigger
    copies = copied = others = forbidden = 0
    loglik = 0.0
    before: list[int] = []  # the current document's last two symbols
    for index, token in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
        if token == EOD_ID:
            before = []
            continue
        symbol = token - SYMBOL_ID_OFFSET
        known = 0 <= symbol < len(chain.table)
        scored = index >= scored_from
        if len(before) == 2 and is_trigger[before[1]]:
            copies += scored
            copied += scored and known and symbol == before[0]
        elif scored:
            others += 1
            logp = -math.inf if not known else float(
                log_table[before[-1], symbol] if before else log_start[symbol])
            if logp == -math.inf:
                forbidden += 1
            else:
                loglik += logp
        before = [*before[-1:], symbol] if known else []
    return StreamScore(copies, copied, others, forbidden, loglik)


def build_tokenizer(spec: BigramBackcopySpec, chain: Chain) -> Tokenizer:
    """A WordLevel tokenizer: end-of-document (id 0), unknown (1), then one word per symbol."""
    is_trigger = chain.is_trigger
    vocab = {EOD_TOKEN: EOD_ID, UNK_TOKEN: 1}
    for index in range(spec.vocab):
        vocab[symbol_name(index, bool(is_trigger[index]))] = index + SYMBOL_ID_OFFSET
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True),
                                  AddedToken(UNK_TOKEN, special=True)])
    return tokenizer


class SyntheticSource:
    """A generator as a ``Source``: fingerprint, documents as text, its own tokenizer."""

    def __init__(self, spec: BigramBackcopySpec) -> None:
        self.spec = spec
        self.chain = build_chain(spec)
        table_content = None
        if spec.table != "random":
            table_content = hashlib.sha256(Path(spec.table).expanduser().read_bytes()).hexdigest()
        identity = {"generator": GENERATOR_VERSION,
                    "spec": {**spec.to_dict(), "table": "random" if table_content is None
                             else Path(spec.table).name},
                    "table_content": table_content}
        self.fingerprint = hashlib.sha256(
            json.dumps(identity, sort_keys=True).encode()
        ).hexdigest()
        self.tokenizer = build_tokenizer(spec, self.chain)
        self._names = np.array([symbol_name(i, bool(t)) for i, t in
                                enumerate(self.chain.is_trigger)])

    @property
    def num_documents(self) -> int:
        return -(-self.spec.tokens // self.spec.doc_tokens)

    def lengths(self) -> list[int]:
        spec = self.spec
        full, rest = divmod(spec.tokens, spec.doc_tokens)
        return [spec.doc_tokens] * full + ([rest] if rest else [])

    def describe(self) -> str:
        spec = self.spec
        table = "random table" if spec.table == "random" else f"table from {spec.table}"
        return (f"bigram-backcopy ({spec.vocab} symbols, {spec.triggers} triggers, {table}, "
                f"seed {spec.seed}, {spec.tokens:,} tokens)")

    def documents(self, batch_size: int = _BLOCK_DOCUMENTS) -> Iterator[list[np.ndarray]]:
        """The documents as symbol indices, in order; document i is fixed by (seed, i)."""
        lengths = self.lengths()
        for start in range(0, len(lengths), batch_size):
            part = lengths[start : start + batch_size]
            seeds = [[self.spec.seed, start + i] for i in range(len(part))]
            yield generate(self.chain, part, seeds)

    def iter_texts(self, batch_size: int = _BLOCK_DOCUMENTS) -> Iterator[list[str]]:
        """The documents as text (one word per symbol), for the tokenizer and packer."""
        for block in self.documents(batch_size):
            yield [" ".join(self._names[document].tolist()) for document in block]

    def summary(self) -> dict[str, Any]:
        """What meta.json records about the chain: the triggers, their share of the tokens and
        the best perplexity any model can reach, both estimated on ``_FLOOR_DOCUMENTS``
        documents generated from a seed of their own."""
        chain, spec = self.chain, self.spec
        lengths = [spec.doc_tokens] * _FLOOR_DOCUMENTS
        sample = generate(chain, lengths, [[0xF100, spec.seed, i] for i in range(len(lengths))])
        floor = np.concatenate([optimal_nll(chain, document) for document in sample])
        return {
            "trigger_symbols": chain.triggers.tolist(),
            "trigger_token_ids": sorted(int(i) + SYMBOL_ID_OFFSET for i in chain.triggers),
            "trigger_share": float(np.mean([chain.is_trigger[d].mean() for d in sample])),
            "optimal_ppl": math.exp(float(floor.mean())),
            "units": chain.units,
        }
