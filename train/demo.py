"""``sinklm demo`` (``make demo``): the whole path on a CPU in minutes, every number measured here.

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
import hashlib
import itertools
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
VARIANTS = ("vanilla", "zero_sink", "sink_token")
LOCAL_DATA = Path("../shared/data")
# 4088 ids: tiny-5m embeds 4096, so 8 stay free for sink ids (configs/data/local_corpus_bpe4k).
VOCAB_SIZE = 4088
# Without local data: documents of the streamed Pile the tokenizer is trained on.
HUB_TOKENIZER_DOCUMENTS = 20_000
DEFAULT_PYTHIA = "EleutherAI/pythia-70m"
# Pythia's context is 2048 at every size: caches of half of it, as the paper's Table 3.
PYTHIA_CACHE = 1024
HUB_TIMEOUT_S = 3.0


class DemoError(RuntimeError):
    """A demo step cannot run; the message says what to do."""


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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the whole path on a CPU: data, three tiny models, streaming comparison",
        description="Prepare data, train tiny vanilla, zero_sink and sink_token models "
        "(configs/experiments/tiny-*.yaml), stream-evaluate them on a held-out book with the "
        "paper's cache grid, measure sinks, and write a comparison report; where the Hub is "
        "reachable, also stream a real Pythia. Everything is reused on a rerun.",
        epilog="example: sinklm demo\n"
        "         sinklm demo --data ../shared/data --pythia EleutherAI/pythia-160m\n"
        "         sinklm demo --steps 2 --max-eval-tokens 2000 --output-dir runs/demo-smoke",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help=f"local data with corpus/ and books/ (default {LOCAL_DATA} when it "
                        "exists, else the Hub datasets of configs/data)")
    parser.add_argument("--book", type=Path, metavar="FILE",
                        help="held-out text to stream (default: the first of DATA/books)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/demo"), metavar="DIR",
                        help="runs and reports go here (default runs/demo)")
    parser.add_argument("--steps", type=int, help="training steps (default: the configs')")
    parser.add_argument("--max-eval-tokens", type=int, default=8192, metavar="N",
                        help="tokens of the book to stream (default 8192)")
    parser.add_argument("--pythia", default=DEFAULT_PYTHIA, metavar="HUB_ID",
                        help=f"a Pythia to stream where the Hub is reachable (default "
                        f"{DEFAULT_PYTHIA}; 'none' skips it)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's). On a machine shared with "
                        "other jobs, OMP_WAIT_POLICY=PASSIVE in the environment (make demo "
                        "sets it) keeps idle threads from spinning")
    parser.add_argument(
        "fit_args", nargs=argparse.REMAINDER,
        help="after --: extra `sinklm fit` arguments for the three runs, e.g. "
        "-- --trainer.precision=bf16-mixed",
    )
    parser.set_defaults(func=run_demo)


def _say(message: str) -> None:
    print(f"sinklm demo: {message}", file=sys.stderr, flush=True)


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


def _config(name: str) -> dict[str, Any]:
    path = CONFIGS / name
    if not path.is_file():
        raise DemoError(f"{path} not found: the demo runs from a sinklm checkout (configs/)")
    return yaml.safe_load(path.read_text())


def local_data(data: Path, book: Path | None) -> DemoData:
    """The corpus and a book from a folder laid out as ../shared/data."""
    config = _config("data/local_corpus_bpe4k.yaml")
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
    pile = _config("data/pile_deduped.yaml")
    if book is None:
        from sinklm.eval.texts import read_dataset

        pg19 = _config("data/pg19_test.yaml")["source"]
        book = output_dir / "data" / "pg19-test-0.txt"
        if not book.is_file():
            _say(f"downloading the first book of {pg19['path']}:{pg19['split']}")
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
            _say(f"reusing the tokenizer {data.tokenizer}")
        else:
            source = Source(SourceSpec.from_dict(data.prepare["source"]))
            _say(f"training a {VOCAB_SIZE}-id BPE on {source.describe()} (about 10 s)")
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(variant: str, run_dir: Path, packed: Path, meta: dict[str, Any],
          steps: int | None, fit_args: list[str]) -> Path:
    """``sinklm fit`` of ``configs/experiments/tiny-VARIANT.yaml`` into ``run_dir``; resumed if
    interrupted, skipped if done, refused if ``run_dir`` holds a run of other settings."""
    import torch

    from sinklm.train.fit import newest_checkpoint, run_fit

    config_path = CONFIGS / "experiments" / f"tiny-{variant}.yaml"
    config = _config(f"experiments/tiny-{variant}.yaml")
    steps = steps or config["trainer"]["max_steps"]
    settings = {"config": _sha256(config_path), "steps": steps, "fit_args": fit_args,
                "tokenizer_hash": meta["tokenizer_hash"],
                "source_fingerprint": meta["source_fingerprint"]}
    record = run_dir / "demo.json"
    if record.is_file() and json.loads(record.read_text()) != settings:
        raise DemoError(f"{run_dir} holds a run with other settings (config, steps, fit "
                        "arguments or data): remove it or pass another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=2) + "\n")

    def trained() -> int:
        newest = newest_checkpoint(run_dir / "checkpoints", run_dir)
        if newest is None:
            return 0
        return int(torch.load(newest, map_location="cpu", mmap=True,
                              weights_only=False)["global_step"])

    done = trained()
    if done == steps:
        _say(f"reusing {run_dir}: {variant} trained for {steps} steps")
        return run_dir / "checkpoints" / "last.ckpt"
    _say(f"training tiny {variant} for {steps} steps into {run_dir}"
         + (f" (resuming at step {done})" if done else ""))
    argv = [
        "--config", str(config_path),
        "--trainer.max_steps", str(steps),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.logger.init_args.save_dir", str(run_dir),
        "--data.path", str(packed),
        "--ckpt_path", "auto",
        *fit_args,
    ]
    try:
        code = run_fit(argv)
    except SystemExit as error:  # LightningCLI exits on a config it cannot parse
        code = error.code
    if code:
        raise DemoError(f"training {variant} failed (sinklm fit {' '.join(argv)})")
    if trained() != steps:
        raise DemoError(f"training {variant} ended without a checkpoint at step {steps}")
    return run_dir / "checkpoints" / "last.ckpt"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        for name, value, low in (("--steps", args.steps, 1),
                                 ("--max-eval-tokens", args.max_eval_tokens, 2),
                                 ("--threads", args.threads, 1)):
            if value is not None and value < low:
                raise DemoError(f"{name} {value}: must be at least {low}")
        if args.book is not None and not args.book.is_file():
            raise DemoError(f"--book {args.book}: no such file")
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        if args.data is not None and not args.data.is_dir():
            raise DemoError(f"--data {args.data}: no such folder")
        data_dir = args.data or (LOCAL_DATA if LOCAL_DATA.is_dir() else None)
        if data_dir is not None:
            data = local_data(data_dir, args.book)
        else:
            _say(f"no local data at {LOCAL_DATA}: using the Hub datasets of configs/data")
            config = _config("experiments/tiny-vanilla.yaml")
            steps = args.steps or config["trainer"]["max_steps"]
            batch = config["data"]["micro_batch_size"] * config["data"]["seq_len"]
            data = hub_data(args.output_dir, args.book, int(1.1 * steps * batch) + 100_000)
        meta = prepare(data)
        stamps = {"data": time.perf_counter() - start}
        fit_args = [a for a in args.fit_args if a != "--"]
        checkpoints = [
            str(train(variant, args.output_dir / variant, data.packed, meta, args.steps,
                      fit_args))
            for variant in VARIANTS
        ]
        stamps["training"] = time.perf_counter() - start - sum(stamps.values())
        report, pythia = evaluate_models(args, data.book, checkpoints)
        stamps["evaluation"] = time.perf_counter() - start - sum(stamps.values())
    except DemoError as error:
        print(f"sinklm demo: {error}", file=sys.stderr)
        return 2
    total = time.perf_counter() - start
    print(f"\n## Streaming perplexity on {data.book.name} (first {args.max_eval_tokens:,} "
          "tokens; cache x+y = the first x tokens and the y most recent)\n")
    print(report.streaming_table)
    print("\n## Attention on the first token (a sink id for sink_token)\n")
    print(report.sinks_table)
    if report.training_sinks_table is not None:
        print("\n## Sinks during training (the sink probe: Sink_1^0.3 = share of heads whose "
              "mean attention to position 0 exceeds 0.3)\n")
        print(report.training_sinks_table)
    print(f"\n## {args.pythia}\n")
    print(pythia)
    timing = ", ".join(f"{name} {_minutes(seconds)}" for name, seconds in stamps.items())
    print(f"\nreport: {report.files['markdown']} ({report.provenance()})\n"
          f"time: {_minutes(total)} ({timing}) on "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}")
    return 0


def evaluate_models(args: argparse.Namespace, book: Path,
                    checkpoints: list[str]) -> tuple[Any, str]:
    """The tiny models' comparison report, and Pythia's table or why it was skipped."""
    from sinklm.eval.cache import StartRecent
    from sinklm.eval.cli import USER_ERRORS
    from sinklm.eval.compare import CompareError, Settings, compare

    settings = Settings(texts=(book,), max_tokens=args.max_eval_tokens)
    try:
        report = compare(checkpoints, args.output_dir / "report", settings)
    except (*USER_ERRORS, CompareError) as error:
        raise DemoError(f"evaluation: {error}") from None
    if args.pythia.lower() == "none":
        return report, "skipped (--pythia none)"
    reason = hub_unreachable()
    if reason is not None:
        return report, f"skipped: the Hub is unreachable ({reason})"
    caches = (StartRecent(0, PYTHIA_CACHE), StartRecent(4, PYTHIA_CACHE - 4))
    _say(f"streaming {args.pythia} (window-only and start+recent caches)")
    try:
        pythia = compare([args.pythia], args.output_dir / "pythia",
                         Settings(texts=(book,), caches=caches, max_tokens=args.max_eval_tokens))
    except (*USER_ERRORS, CompareError, OSError) as error:  # a download can fail half-way
        return report, f"skipped: {error}"
    return report, (f"{pythia.streaming_table}\n\nreport: {pythia.files['markdown']} "
                    f"({pythia.provenance()})")
