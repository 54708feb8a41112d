"""``sinklm prepare-data`` and ``sinklm train-tokenizer``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from sinklm.cli.outputs import guard_writable
from sinklm.data.errors import DataError
from sinklm.data.packing import PrepareConfig, prepare_data
from sinklm.data.sources import Source, SourceSpec
from sinklm.data.synthetic import GENERATORS
from sinklm.data.tokenizer import (
    DEFAULT_TOKENIZER,
    eod_token_id,
    save_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

# CLI flag -> SourceSpec field; flags left unset keep the YAML's (or the default) value.
_SOURCE_FLAGS = {
    "source": "path",
    "name": "name",
    "split": "split",
    "text_field": "text_field",
    "streaming": "streaming",
    "revision": "revision",
    "reflow": "reflow",
    "cache_dir": "cache_dir",
}
_PREPARE_FLAGS = ("output", "tokenizer", "val_fraction", "seed", "max_tokens", "shard_tokens",
                  "overwrite")


def _add_source_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("source (flags override the --config file)")
    group.add_argument("--config", metavar="FILE",
                       help="a YAML data config, e.g. configs/data/local_corpus.yaml")
    group.add_argument("--source", metavar="PATH_OR_HUB_ID",
                       help="a .txt/.jsonl/.jsonl.gz/.parquet file, a folder of them, or a Hub id")
    group.add_argument("--name", help="the Hub dataset's config name")
    group.add_argument("--split", help="the Hub split (default train)")
    group.add_argument("--text-field", help="the field holding the text (default text)")
    group.add_argument("--revision", help="a Hub branch, tag or commit")
    group.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=None,
                       help="stream a Hub dataset instead of downloading it first")
    group.add_argument("--reflow", action=argparse.BooleanOptionalAction, default=None,
                       help="join hard-wrapped lines into paragraphs (Gutenberg text)")
    group.add_argument("--cache-dir", help="the datasets cache folder")


def _read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise DataError(f"{path}: cannot read the data config ({error})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: a data config is a mapping of keys (source, output, ...)")
    return data


def _synthetic_flags(args: argparse.Namespace, source: dict[str, Any]) -> dict[str, Any]:
    """``--synthetic NAME`` and ``--param KEY=VALUE`` (values read as YAML) on top of the
    config's source; a generator and document flags together are refused."""
    name, params = getattr(args, "synthetic", None), getattr(args, "param", None) or []
    if name is not None:
        source = {"synthetic": name, **{k: v for k, v in source.items() if k != "path"}}
    if not (name or params):
        return source
    if "synthetic" not in source:
        raise DataError("--param sets a generator's parameter: add --synthetic bigram-backcopy "
                        "(or a --config whose source names synthetic)")
    document_flags = [f"--{flag.replace('_', '-')}" for flag in _SOURCE_FLAGS
                      if getattr(args, flag) is not None]
    if document_flags:
        raise DataError(f"{', '.join(document_flags)} describe documents, not a generator: pass "
                        "either --synthetic or --source")
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DataError(f"--param {item!r}: write KEY=VALUE, e.g. --param vocab=64")
        source[key.strip()] = yaml.safe_load(value)
    return source


def _merged(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """The --config file's values with every flag the user gave on top."""
    data = _read_config(args.config)
    source = data.get("source", {})
    if isinstance(source, str):
        source = {"path": source}
    for flag, key in _SOURCE_FLAGS.items():
        if getattr(args, flag) is not None:
            source[key] = getattr(args, flag)
    source = _synthetic_flags(args, source)
    if not source.get("path") and not source.get("synthetic"):
        raise DataError("no source: pass --source PATH_OR_HUB_ID or --synthetic bigram-backcopy "
                        "(or a --config with source)")
    data["source"] = source
    for key in keys:
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    return data


def define_prepare_data(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Tokenize documents (a Hub dataset or local files) in parallel, append the "
        "end-of-document id to each, split train/validation by document, and write "
        "memory-mapped token shards plus DIR/meta.json. A second run with the same inputs "
        "reuses DIR; other inputs are refused unless --overwrite.")
    parser.epilog = (
        "example: sinklm prepare-data --reflow --val-fraction 0.05 \\\n"
        "           --source ../shared/data/corpus/english_pd_mix.jsonl.gz \\\n"
        "           --tokenizer ../shared/data/tokenizers/gpt-neox-20b/tokenizer.json \\\n"
        "           --output packed/english_pd_mix\n"
        "         sinklm prepare-data --config configs/data/local_corpus.yaml\n"
        "         sinklm prepare-data --synthetic bigram-backcopy --param tokens=2000000 \\\n"
        "           --val-fraction 0.05 --output packed/bigram_backcopy")
    _add_source_arguments(parser)
    synthetic = parser.add_argument_group(
        "synthetic source (instead of --source; see configs/data/bigram_backcopy.yaml)")
    synthetic.add_argument("--synthetic", choices=GENERATORS,
                           help="generate the documents: Bigram-Backcopy, the sink lab's task")
    synthetic.add_argument("--param", action="append", metavar="KEY=VALUE",
                           help="a generator parameter (repeatable): vocab, triggers, table "
                           "(random or a text file), unit, successors, zipf, dirichlet, "
                           "doc_tokens, tokens, seed, table_seed")
    parser.add_argument("--tokenizer", help=f"tokenizer.json, a folder, or a Hub id "
                        f"(default {DEFAULT_TOKENIZER}, Pythia's; none for --synthetic)")
    parser.add_argument("--output", metavar="DIR", help="the packed-data folder to write")
    parser.add_argument("--val-fraction", type=float, metavar="F",
                        help="share of documents for validation (default 0)")
    parser.add_argument("--seed", type=int, help="seed of the train/validation split (default 0)")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="stop after about N tokens (for streamed sets)")
    parser.add_argument("--shard-tokens", type=int, metavar="N",
                        help="tokens per shard file (default 2**30)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="rebuild DIR when it was built from other inputs")
    parser.set_defaults(func=run_prepare)


def define_train_tokenizer(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train a byte-level BPE with <|endoftext|> (id 0) and <|padding|> (id 1), "
        "NFC normalisation and GPT-NeoX's pre-tokenizer, and write DIR/tokenizer.json. Leave "
        "room below the model's vocab_size for sink tokens.")
    parser.epilog = (
        "example: sinklm train-tokenizer --reflow \\\n"
        "           --source ../shared/data/corpus/english_pd_mix.jsonl.gz \\\n"
        "           --vocab-size 8000 --output tokenizers/english_pd_8k")
    _add_source_arguments(parser)
    parser.add_argument("--vocab-size", type=int, required=True, metavar="N",
                        help="ids in total, special tokens included")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="folder for tokenizer.json")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="a pair must occur this often to be merged (default 2)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing DIR/tokenizer.json")
    parser.set_defaults(func=run_train_tokenizer)


def run_prepare(args: argparse.Namespace) -> int:
    config = PrepareConfig.from_dict(_merged(args, _PREPARE_FLAGS))
    output = Path(config.output).expanduser()
    guard_writable([output, output.parent])  # packed beside the folder, then renamed into it
    meta = prepare_data(config)
    splits = {
        name: {"documents": s["documents"], "tokens": s["tokens"]}
        for name, s in meta["splits"].items()
    }
    print(json.dumps({"output": config.output, "dtype": meta["dtype"], "splits": splits,
                      "tokenizer_hash": meta["tokenizer_hash"]}, indent=2))
    return 0


def _check_tokenizer_output(output: Path, overwrite: bool) -> None:
    """Refuse, before reading the corpus, to replace a tokenizer that packed data may use, or
    to write where this process cannot."""
    if output.is_file():
        raise DataError(f"--output {output} is a file; give a folder for tokenizer.json")
    if (output / "tokenizer.json").exists() and not overwrite:
        raise DataError(f"--output {output} already holds a tokenizer.json: pass --overwrite "
                        "to replace it")
    guard_writable([output])


def run_train_tokenizer(args: argparse.Namespace) -> int:
    _check_tokenizer_output(Path(args.output), args.overwrite)
    merged = _merged(args, ())["source"]
    if "synthetic" in merged:
        raise DataError("a synthetic source brings its own tokenizer (one word per symbol): "
                        "`sinklm prepare-data` writes it; nothing to train")
    source = Source(SourceSpec.from_dict(merged))
    texts = (text for batch in source.iter_texts() for text in batch)
    tokenizer = train_tokenizer(texts, args.vocab_size, args.min_frequency,
                                length=source.num_documents)
    path = save_tokenizer(tokenizer, args.output)
    print(json.dumps({"tokenizer": str(path),
                      "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
                      "eod_id": eod_token_id(tokenizer), "hash": tokenizer_hash(tokenizer)},
                     indent=2))
    return 0
