"""``sinklm demo`` (``make demo``): the whole path on a CPU in minutes, every number measured here.

Part 1, the sink lab (``--only lab``, ``demo_lab.py``): a synthetic task on which sinks form in
seconds, with windows mid-stream and aligned to documents. Part 2, natural text (``--only
text``, ``demo_text.py``): a tokenizer and packed corpus, three tiny models trained on it,
streamed on a held-out book, and a real Pythia where the Hub is reachable. Both train
through ``demo_runs.py``, which reuses what a previous run made. The demo ends with the lab's
sink-token model generating far past its context, scored by the chain that made its data.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from sinklm.cli.demo_lab import (
    GENERATED_CONTEXTS,
    print_generation,
    print_lab,
    run_generation,
    run_lab,
)
from sinklm.cli.demo_runs import DemoError
from sinklm.cli.demo_text import DEFAULT_PYTHIA, LOCAL_DATA, print_text, run_text, text_data
from sinklm.cli.main import check_at_least


def define_demo(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Part 1, the sink lab: generate Bigram-Backcopy data, train vanilla, "
        "zero_sink and sink_token models on it (configs/experiments/bb-*.yaml) and compare "
        "them on its held-out split with the paper's cache grid, where a sink forms in seconds; "
        "then vanilla and zero sink with windows aligned to short documents (bb-docs-*.yaml), "
        "where every window starts with the end-of-document id and they come to depend on it. "
        "Part 2, natural text: prepare the corpus, train tiny vanilla, zero_sink and sink_token "
        "models (configs/experiments/tiny-*.yaml), stream-evaluate them on a held-out book, "
        "measure sinks, and, where the Hub is reachable, stream a real Pythia. It ends with the "
        f"sink lab's sink-token model generating {GENERATED_CONTEXTS}x its trained context with "
        "its sink id kept and evicted, scored by the true chain. Models and reports are reused "
        "on a rerun.")
    parser.epilog = (
        "example: sinklm demo\n"
        "         sinklm demo --only lab\n"
        "         sinklm demo --data ../shared/data --pythia EleutherAI/pythia-160m\n"
        "         sinklm demo --steps 2 --lab-steps 2 --max-eval-tokens 2000 "
        "--output-dir runs/demo-smoke")
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


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    stamps: dict[str, float] = {}
    lab = text = generation = None
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
        generation = run_generation(lab)
        stamps["lab generation"] = time.perf_counter() - start - stamps["sink lab"]
    if data is not None:
        text = run_text(args, data, stamps)
    if lab is not None:
        print_lab(lab, args)
    if text is not None:
        print_text(*text, args)
    if generation is not None:
        print_generation(generation)
    timing = ", ".join(f"{name} {_minutes(seconds)}" for name, seconds in stamps.items())
    print(f"\ntime: {_minutes(time.perf_counter() - start)} ({timing}) on {os.cpu_count()} CPU "
          f"cores, load average {os.getloadavg()[0]:.2f}")
    return 0
