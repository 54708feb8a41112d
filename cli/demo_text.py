"""Part 2 of ``sinklm demo``, natural text: three tiny models, streamed on a held-out book.

1. Data: a byte-level BPE of 4088 ids trained on the corpus, and the corpus packed with it, as
   ``configs/data/local_corpus_bpe4k.yaml`` says (reused when already there). Local data (the
   ``../shared/data`` layout: ``corpus/``, ``books/``) by default; without it, the Hub datasets
   of ``configs/data/pile_deduped.yaml`` (a sample) and ``pg19_test.yaml`` (a book).
2. Training: the tiny ``vanilla``, ``zero_sink`` and ``sink_token`` models of
   ``configs/experiments/tiny-*.yaml``, resumable (``--ckpt_path auto``) and reused when done.
3. Evaluation: ``sinklm compare`` of the three on a held-out book with the paper's cache grid
   (0+y, 1+(y-1), 2+(y-2), 4+(y-4), dense; x+y half the trained context), sinks measured.
4. Where the Hub is reachable, a real Pythia streamed with window-only and start+recent caches.
"""

from __future__ import annotations

import argparse
import itertools
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinklm.cli.demo_runs import VARIANTS, DemoError, read_config, say, train
from sinklm.cli.main import UserError

LOCAL_DATA = Path("../shared/data")
# 4088 ids: tiny-5m embeds 4096, so 8 stay free for sink ids (configs/data/local_corpus_bpe4k).
VOCAB_SIZE = 4088
# Without local data: documents of the streamed Pile the tokenizer is trained on.
HUB_TOKENIZER_DOCUMENTS = 20_000
DEFAULT_PYTHIA = "EleutherAI/pythia-70m"
# Pythia's context is 2048 at every size: caches of half of it, as the paper's Table 3.
PYTHIA_CACHE = 1024
HUB_TIMEOUT_S = 3.0


@dataclass
class DemoData:
    """The demo's training data (a ``prepare-data`` config) and its held-out book."""

    prepare: dict[str, Any]  # PrepareConfig fields: source, tokenizer, output, ...
    book: Path

    @property
    def tokenizer(self) -> Path:
        return Path(self.prepare["tokenizer"])

    @property
    def packed(self) -> Path:
        return Path(self.prepare["output"])


def hub_unreachable() -> str | None:
    """Why the Hub cannot be used now, or None. One short request, not a 30 s retry loop."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    request = urllib.request.Request(constants.ENDPOINT, method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None  # an answer, whatever its status, means the Hub is there
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"cannot reach {constants.ENDPOINT} ({reason})"
    return None


def local_data(data: Path, book: Path | None) -> DemoData:
    """The corpus and a book from a folder laid out as ../shared/data."""
    config = read_config("data/local_corpus_bpe4k.yaml")
    corpus = data / "corpus"
    if not corpus.is_dir():
        raise DemoError(f"{data} has no corpus/ folder (the layout of {LOCAL_DATA})")
    if book is None:
        books = sorted((data / "books").glob("*.txt"))
        if not books:
            raise DemoError(f"{data} has no books/*.txt to stream; pass --book FILE")
        book = books[0]
    return DemoData({**config, "source": {**config["source"], "path": str(corpus)}}, book)


def hub_data(output_dir: Path, book: Path | None, tokens: int) -> DemoData:
    """A sample of the Pile (``tokens`` of it) and a PG19 test book, from the Hub."""
    reason = hub_unreachable()
    if reason is not None:
        raise DemoError(f"no local data ({LOCAL_DATA} does not exist) and the Hub is "
                        f"unreachable: {reason}. Pass --data DIR (corpus/ and books/ as in "
                        f"{LOCAL_DATA}), or run where huggingface.co is reachable")
    pile = read_config("data/pile_deduped.yaml")
    if book is None:
        from sinklm.eval.texts import read_dataset

        pg19 = read_config("data/pg19_test.yaml")["source"]
        book = output_dir / "data" / "pg19-test-0.txt"
        if not book.is_file():
            say(f"downloading the first book of {pg19['path']}:{pg19['split']}")
            _, text = next(read_dataset(f"{pg19['path']}:{pg19['split']}", pg19["text_field"]))
            book.parent.mkdir(parents=True, exist_ok=True)
            book.write_text(text)
    # The Pile's config packs with Pythia's 50k tokenizer; tiny-5m embeds 4096 ids.
    return DemoData({**pile, "tokenizer": "tokenizers/pile_deduped_4k/tokenizer.json",
                     "output": "packed/pile_deduped-bpe4k", "val_fraction": 0.05,
                     "max_tokens": tokens}, book)


def prepare(data: DemoData) -> dict[str, Any]:
    """Train the tokenizer (unless there) and pack the corpus (reused when unchanged)."""
    from sinklm.data import PrepareConfig, Source, SourceSpec, prepare_data
    from sinklm.data.errors import DataError
    from sinklm.data.tokenizer import save_tokenizer, train_tokenizer

    try:
        if data.tokenizer.is_file():
            say(f"reusing the tokenizer {data.tokenizer}")
        else:
            source = Source(SourceSpec.from_dict(data.prepare["source"]))
            say(f"training a {VOCAB_SIZE}-id BPE on {source.describe()} (about 10 s)")
            texts = (text for batch in source.iter_texts() for text in batch)
            if source.spec.streaming:  # a Hub corpus: a sample of it
                texts = itertools.islice(texts, HUB_TOKENIZER_DOCUMENTS)
            tokenizer = train_tokenizer(texts, VOCAB_SIZE, length=source.num_documents)
            save_tokenizer(tokenizer, data.tokenizer.parent)
        return prepare_data(PrepareConfig.from_dict(data.prepare))
    except DataError as error:
        raise DemoError(
            f"data: {error} (the demo's data lives in {data.tokenizer.parent} and "
            f"{data.packed}; move them aside to rebuild them from this corpus)"
        ) from None


def text_data(args: argparse.Namespace) -> DemoData:
    """The natural-text corpus and book: local data, else the Hub's (refused if unreachable)."""
    data_dir = args.data or (LOCAL_DATA if LOCAL_DATA.is_dir() else None)
    if data_dir is not None:
        return local_data(data_dir, args.book)
    say(f"no local data at {LOCAL_DATA}: using the Hub datasets of configs/data")
    config = read_config("experiments/tiny-vanilla.yaml")
    steps = args.steps or config["trainer"]["max_steps"]
    batch = config["data"]["micro_batch_size"] * config["data"]["seq_len"]
    return hub_data(args.output_dir, args.book, int(1.1 * steps * batch) + 100_000)


def run_text(args: argparse.Namespace, data: DemoData,
             stamps: dict[str, float]) -> tuple[DemoData, Any, str]:
    """The natural-text part: data, the three tiny models, their report and Pythia's."""
    start = time.perf_counter()
    meta = prepare(data)
    stamps["text data"] = time.perf_counter() - start
    fit_args = [a for a in args.fit_args if a != "--"]
    checkpoints = [
        str(train("tiny", variant, args.output_dir / variant, data.packed, meta, args.steps,
                  fit_args))
        for variant in VARIANTS
    ]
    stamps["text training"] = time.perf_counter() - start - stamps["text data"]
    report, pythia = evaluate_models(args, data.book, checkpoints)
    stamps["text evaluation"] = (time.perf_counter() - start - stamps["text data"]
                                 - stamps["text training"])
    return data, report, pythia


def print_text(data: DemoData, report: Any, pythia: str, args: argparse.Namespace) -> None:
    print(f"\n## Natural text: streaming perplexity on {data.book.name} (first "
          f"{args.max_eval_tokens:,} tokens; cache x+y = the first x tokens and the y most "
          "recent)\n")
    print(report.streaming_table)
    print()
    print("\n".join(report.findings))
    print("\n## Attention on the first token (a sink id for sink_token)\n")
    print(report.sinks_table)
    if report.training_sinks_table is not None:
        print("\n## Sinks during training (the sink probe: Sink_1^0.3 = share of heads whose "
              "mean attention to position 0 exceeds 0.3)\n")
        print(report.training_sinks_table)
    print(f"\n## {args.pythia}\n")
    print(pythia)
    print(f"\nreport: {report.files['markdown']} ({report.provenance()})")


def evaluate_models(args: argparse.Namespace, book: Path,
                    checkpoints: list[str]) -> tuple[Any, str]:
    """The tiny models' comparison report, and Pythia's table or why it was skipped."""
    from sinklm.eval.cache import StartRecent
    from sinklm.eval.compare import Settings, compare

    settings = Settings(texts=(book,), max_tokens=args.max_eval_tokens)
    try:
        report = compare(checkpoints, args.output_dir / "report", settings)
    except UserError as error:
        raise DemoError(f"evaluation: {error}") from None
    if args.pythia.lower() == "none":
        return report, "skipped (--pythia none)"
    reason = hub_unreachable()
    if reason is not None:
        return report, f"skipped: the Hub is unreachable ({reason})"
    caches = (StartRecent(0, PYTHIA_CACHE), StartRecent(4, PYTHIA_CACHE - 4))
    say(f"streaming {args.pythia} (window-only and start+recent caches)")
    try:
        pythia = compare([args.pythia], args.output_dir / "pythia",
                         Settings(texts=(book,), caches=caches, max_tokens=args.max_eval_tokens))
    except (UserError, OSError) as error:  # a download can fail half-way
        return report, f"skipped: {error}"
    return report, (f"{pythia.streaming_table}\n\nreport: {pythia.files['markdown']} "
                    f"({pythia.provenance()})")
