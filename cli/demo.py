"""``sinklm demo`` (``make demo``): the whole path on a CPU in minutes, every number measured here.

Part 1, the sink lab (``--only lab``): Bigram-Backcopy data generated and packed as
``configs/data/bigram_backcopy.yaml`` says; the ``vanilla``, ``zero_sink`` and ``sink_token``
models of ``configs/experiments/bb-*.yaml`` trained on it; ``sinklm compare`` on its held-out
validation split with the paper's cache grid. A synthetic task on which sinks form in seconds.

Part 2, natural text (``--only text``):
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

from sinklm.cli.main import UserError, bundled_file, check_at_least

VARIANTS = ("vanilla", "zero_sink", "sink_token")
LAB_DATA = "data/bigram_backcopy.yaml"
LOCAL_DATA = Path("../shared/data")
# 4088 ids: tiny-5m embeds 4096, so 8 stay free for sink ids (configs/data/local_corpus_bpe4k).
VOCAB_SIZE = 4088
# Without local data: documents of the streamed Pile the tokenizer is trained on.
HUB_TOKENIZER_DOCUMENTS = 20_000
DEFAULT_PYTHIA = "EleutherAI/pythia-70m"
# Pythia's context is 2048 at every size: caches of half of it, as the paper's Table 3.
PYTHIA_CACHE = 1024
HUB_TIMEOUT_S = 3.0


class DemoError(UserError):
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
        help="the whole path on a CPU: the sink lab, then three tiny models on natural text",
        description="Part 1, the sink lab: generate Bigram-Backcopy data, train vanilla, "
        "zero_sink and sink_token models on it (configs/experiments/bb-*.yaml) and compare "
        "them on its held-out split with the paper's cache grid, where a sink forms in seconds. "
        "Part 2, natural text: prepare the corpus, train tiny vanilla, zero_sink and sink_token "
        "models (configs/experiments/tiny-*.yaml), stream-evaluate them on a held-out book, "
        "measure sinks, and, where the Hub is reachable, stream a real Pythia. Everything is "
        "reused on a rerun.",
        epilog="example: sinklm demo\n"
        "         sinklm demo --only lab\n"
        "         sinklm demo --data ../shared/data --pythia EleutherAI/pythia-160m\n"
        "         sinklm demo --steps 2 --lab-steps 2 --max-eval-tokens 2000 "
        "--output-dir runs/demo-smoke",
    )
    parser.add_argument("--only", choices=("lab", "text"),
                        help="run one part: the sink lab or the natural-text models")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help=f"local data with corpus/ and books/ (default {LOCAL_DATA} when it "
                        "exists, else the Hub datasets of configs/data)")
    parser.add_argument("--book", type=Path, metavar="FILE",
                        help="held-out text to stream (default: the first of DATA/books)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/demo"), metavar="DIR",
                        help="runs and reports go here (default runs/demo; the lab in DIR/lab)")
    parser.add_argument("--steps", type=int,
                        help="training steps of the natural-text models (default: the configs')")
    parser.add_argument("--lab-steps", type=int,
                        help="training steps of the sink lab's models (default: the configs')")
    parser.add_argument("--max-eval-tokens", type=int, default=8192, metavar="N",
                        help="tokens of the book to stream (default 8192)")
    parser.add_argument("--lab-eval-tokens", type=int, default=16384, metavar="N",
                        help="tokens of the sink lab's held-out split to stream (default 16384)")
    parser.add_argument("--pythia", default=DEFAULT_PYTHIA, metavar="HUB_ID",
                        help=f"a Pythia to stream where the Hub is reachable (default "
                        f"{DEFAULT_PYTHIA}; 'none' skips it)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's). On a machine shared with "
                        "other jobs, OMP_WAIT_POLICY=PASSIVE in the environment (make demo "
                        "sets it) keeps idle threads from spinning")
    parser.add_argument(
        "fit_args", nargs=argparse.REMAINDER,
        help="after --: extra `sinklm fit` arguments for the three natural-text runs, e.g. "
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


def _config_file(name: str) -> Path:
    """A config the demo runs, e.g. ``data/bigram_backcopy.yaml``, installed with sinklm."""
    path = bundled_file(f"configs/{name}")
    if not path.is_file():
        raise DemoError(f"{path} not found: this sinklm install lacks its configs; reinstall it")
    return path


def _config(name: str) -> dict[str, Any]:
    return yaml.safe_load(_config_file(name).read_text())


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


def train(family: str, variant: str, run_dir: Path, packed: Path, meta: dict[str, Any],
          steps: int | None, fit_args: list[str]) -> Path:
    """``sinklm fit`` of ``configs/experiments/FAMILY-VARIANT.yaml`` into ``run_dir``; resumed
    if interrupted, skipped if done, refused if ``run_dir`` holds a run of other settings."""

    from sinklm.models.checkpoint import global_step
    from sinklm.train.fit import newest_checkpoint, run_fit

    config_path = _config_file(f"experiments/{family}-{variant}.yaml")
    config = yaml.safe_load(config_path.read_text())
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
        return global_step(newest)

    done = trained()
    if done == steps:
        _say(f"reusing {run_dir}: {variant} trained for {steps} steps")
        return run_dir / "checkpoints" / "last.ckpt"
    _say(f"training {family} {variant} for {steps} steps into {run_dir}"
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
    stamps: dict[str, float] = {}
    lab = text = None
    check_at_least(("--steps", args.steps, 1), ("--lab-steps", args.lab_steps, 1),
                   ("--max-eval-tokens", args.max_eval_tokens, 2),
                   ("--lab-eval-tokens", args.lab_eval_tokens, 2), ("--threads", args.threads, 1))
    if args.book is not None and not args.book.is_file():
        raise DemoError(f"--book {args.book}: no such file")
    if args.data is not None and not args.data.is_dir():
        raise DemoError(f"--data {args.data}: no such folder")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    # The natural-text data is resolved first: a missing corpus is refused before any
    # training, not after the sink lab.
    data = text_data(args) if args.only in (None, "text") else None
    if args.only in (None, "lab"):
        lab = run_lab(args)
        stamps["sink lab"] = time.perf_counter() - start
    if data is not None:
        text = run_text(args, data, stamps)
    if lab is not None:
        print_lab(lab, args)
    if text is not None:
        print_text(*text, args)
    timing = ", ".join(f"{name} {_minutes(seconds)}" for name, seconds in stamps.items())
    print(f"\ntime: {_minutes(time.perf_counter() - start)} ({timing}) on {os.cpu_count()} CPU "
          f"cores, load average {os.getloadavg()[0]:.2f}")
    return 0


def run_lab(args: argparse.Namespace) -> Any:
    """The sink lab: Bigram-Backcopy packed, the three bb models trained, their report."""
    from sinklm.cli.evaluate import user_errors
    from sinklm.data import PrepareConfig, prepare_data
    from sinklm.data.errors import DataError
    from sinklm.eval.compare import CompareError, Settings, compare

    config = _config(LAB_DATA)
    packed = Path(config["output"])
    _say(f"sink lab: Bigram-Backcopy data into {packed}")
    try:
        meta = prepare_data(PrepareConfig.from_dict(config))
    except DataError as error:
        raise DemoError(f"sink lab data: {error} (move {packed} aside to rebuild it)") from None
    checkpoints = [
        str(train("bb", variant, args.output_dir / "lab" / variant, packed, meta,
                  args.lab_steps, []))
        for variant in VARIANTS
    ]
    settings = Settings(texts=(), packed=f"{packed}:validation", max_tokens=args.lab_eval_tokens)
    try:
        return compare(checkpoints, args.output_dir / "lab" / "report", settings)
    except (*user_errors(), CompareError) as error:
        raise DemoError(f"sink lab evaluation: {error}") from None


def lab_table(report: Any) -> str:
    """Per variant: Sink_1^0.3, the non-trigger queries' attention to position 0 (strongest
    head) and the streaming perplexity per cache, from the report's JSON."""
    from sinklm.eval.report import format_ppl

    document = json.loads(Path(report.files["json"]).read_text())
    caches = document["streaming"]["caches"]
    lines = ["| model | Sink_1^0.3 | attention to position 0, non-trigger queries | "
             + " | ".join(caches) + " |", "|---|---:|---:|" + "---:|" * len(caches)]
    for label, results in document["streaming"]["results"].items():
        sinks = document["sinks"][label]
        attention = sinks.get("non_trigger_first")
        cells = [f"{sinks['sink_rate']['1']:.3f}",
                 "-" if attention is None else f"{attention:.3f}",
                 *(format_ppl(row["ppl"]) for row in results)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_lab(report: Any, args: argparse.Namespace) -> None:
    print("\n## Sink lab: Bigram-Backcopy (synthetic; Guo et al. 2024, arXiv 2410.13835)\n")
    print(f"Streaming perplexity on the held-out validation split (first "
          f"{args.lab_eval_tokens:,} tokens). A synthetic task on which sinks form in seconds; "
          "what natural text does at scale needs the GPU configs.\n")
    print(lab_table(report))
    print()
    print("\n".join(report.findings))
    print(f"\nreport: {report.files['markdown']} ({report.provenance()})")


def text_data(args: argparse.Namespace) -> DemoData:
    """The natural-text corpus and book: local data, else the Hub's (refused if unreachable)."""
    data_dir = args.data or (LOCAL_DATA if LOCAL_DATA.is_dir() else None)
    if data_dir is not None:
        return local_data(data_dir, args.book)
    _say(f"no local data at {LOCAL_DATA}: using the Hub datasets of configs/data")
    config = _config("experiments/tiny-vanilla.yaml")
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
    from sinklm.cli.evaluate import user_errors
    from sinklm.eval.cache import StartRecent
    from sinklm.eval.compare import CompareError, Settings, compare

    settings = Settings(texts=(book,), max_tokens=args.max_eval_tokens)
    try:
        report = compare(checkpoints, args.output_dir / "report", settings)
    except (*user_errors(), CompareError) as error:
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
    except (*user_errors(), CompareError, OSError) as error:  # a download can fail half-way
        return report, f"skipped: {error}"
    return report, (f"{pythia.streaming_table}\n\nreport: {pythia.files['markdown']} "
                    f"({pythia.provenance()})")
