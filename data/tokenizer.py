"""Tokenizers: the Pythia/GPT-NeoX ``tokenizer.json`` or a byte-level BPE trained here.

Sink tokens are real vocabulary entries, added as special tokens (``<|sink|>``,
``<|sink_1|>``, ...) at the first free ids inside the model's padded embedding. For GPT-NeoX
(50277 ids, embedding padded to 50304) the first sink id is 50277, so a sink-token model keeps
Pythia's embedding shape. A vocabulary with no room left is an error, never a silent resize.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from .errors import DataError

# The Pythia tokenizer on the Hub; a local tokenizer.json (or a folder holding one) also works.
DEFAULT_TOKENIZER = "EleutherAI/gpt-neox-20b"
SINK_TOKEN = "<|sink|>"
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
# End-of-document tokens of common tokenizers, in the order they are looked for.
EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
# Text whose encoding goes into the tokenizer hash: normaliser, pre-tokenizer and merges all
# show in it (accents for NFC, whitespace runs, digits, non-Latin scripts, emoji).
_PROBE = (
    "Hello world!  The café\u0301 costs $3.50 -- 12345 tokens,\n\n\tindented\r\n"
    "    four spaces; Ünïcödé: 日本語のテキスト, Ελληνικά, русский, 🙂👍 'quoted' \"double\" "
    "don't won't it's <|endoftext|> end."
)


def load_tokenizer(spec: str | Path = DEFAULT_TOKENIZER) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` file, a folder holding one, or a Hub model id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{spec}: the folder has no tokenizer.json; point at the file")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as error:
            raise DataError(f"{path}: not a tokenizers JSON file ({error})") from None
    if str(spec).endswith(".json") or str(spec).startswith(("/", ".", "~")):
        raise DataError(f"{spec}: no such tokenizer file")
    try:
        return Tokenizer.from_pretrained(str(spec))
    except Exception as error:
        raise DataError(
            f"cannot load tokenizer '{spec}' from the Hub ({type(error).__name__}); pass a local "
            "tokenizer.json (or a folder holding one), or train one with `sinklm train-tokenizer`"
        ) from None


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, length: int | None = None
) -> Tokenizer:
    """Train a GPT-NeoX-style byte-level BPE (NFC, ByteLevel) for small CPU experiments.

    ``vocab_size`` counts everything, ``<|endoftext|>`` (id 0) and ``<|padding|>`` (id 1)
    included, as GPT-NeoX does. Leave room for sink tokens below the model's ``vocab_size``:
    tiny-5m has 4096 embedding rows, so train at most 4095 ids for one sink token. A small
    corpus may yield fewer ids than asked for.
    """
    specials = [EOD_TOKEN, PAD_TOKEN]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise DataError(
            f"vocab_size={vocab_size}: a byte-level BPE needs at least "
            f"{len(alphabet) + len(specials)} ids (256 bytes and {len(specials)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write ``directory/tokenizer.json`` (via a temporary name) and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tmp = path.with_name(path.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)
    return path


def sink_token_names(n_sink: int) -> list[str]:
    """``<|sink|>``, ``<|sink_1|>``, ``<|sink_2|>``, ... for ``n_sink`` sink tokens."""
    return [SINK_TOKEN] + [f"<|sink_{i}|>" for i in range(1, n_sink)] if n_sink > 0 else []


def _is_sink(token: str) -> bool:
    return token == SINK_TOKEN or (
        token.startswith("<|sink_") and token.endswith("|>") and token[7:-2].isdigit()
    )


def sink_token_ids(tokenizer: Tokenizer, n_sink: int, vocab_size: int) -> list[int]:
    """The ids of ``n_sink`` sink tokens, adding any missing ones as special tokens.

    Missing sink tokens take the first free ids (``tokenizer.get_vocab_size()`` onwards),
    which must fit inside the model's ``vocab_size`` embedding rows. Idempotent: a tokenizer
    that already has them (a second call, an exported tokenizer) keeps their ids.
    """
    if n_sink < 0:
        raise DataError(f"sink_tokens={n_sink}: must be >= 0")
    names = sink_token_names(n_sink)
    missing = [name for name in names if tokenizer.token_to_id(name) is None]
    if missing:
        first_free = tokenizer.get_vocab_size(with_added_tokens=True)
        if first_free + len(missing) > vocab_size:
            raise DataError(
                f"no room for {len(missing)} sink token(s): the tokenizer uses ids "
                f"0..{first_free - 1} and the model has vocab_size={vocab_size} embedding rows. "
                f"Use a model vocab_size >= {first_free + len(missing)} (Pythia pads to a "
                f"multiple of 128), or train a tokenizer with --vocab-size <= "
                f"{vocab_size - n_sink}"
            )
        tokenizer.add_special_tokens(
            [AddedToken(name, special=True, normalized=False) for name in missing]
        )
        added = [tokenizer.token_to_id(name) for name in missing]
        expected = list(range(first_free, first_free + len(missing)))
        if added != expected:
            raise DataError(
                f"the tokenizer put sink tokens at ids {added}, not at the first free ids "
                f"{expected}; its vocabulary has gaps, so give it explicit sink tokens"
            )
    ids = [tokenizer.token_to_id(name) for name in names]
    too_large = [i for i in ids if i >= vocab_size]
    if too_large:
        raise DataError(
            f"sink token ids {too_large} lie outside the model's vocab_size={vocab_size}; "
            "use a larger vocab_size or a tokenizer without those tokens"
        )
    return ids


def eod_token_id(tokenizer: Tokenizer) -> int:
    """The end-of-document id appended after every document (0 for GPT-NeoX)."""
    for token in EOD_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(
        f"the tokenizer has none of the end-of-document tokens {list(EOD_CANDIDATES)}; add "
        f"'{EOD_TOKEN}' as a special token (`sinklm train-tokenizer` does)"
    )


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """A hash of what the tokenizer does, the same across loads and ``tokenizers`` versions.

    It covers the vocabulary (sink tokens excluded: they never occur in packed text), the BPE
    merges and the encoding of a probe text, not the JSON bytes, whose layout changes between
    ``tokenizers`` releases (merges as "a b" strings or as pairs).
    """
    vocab = sorted(
        (token_id, token)
        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()
        if not _is_sink(token)
    )
    model = json.loads(tokenizer.to_str()).get("model", {})
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    probe = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    blob = json.dumps(
        {"type": model.get("type"), "vocab": vocab, "merges": merges, "probe": probe},
        ensure_ascii=False, separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32: half the disk for Pythia."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
