"""``sinklm stream-eval`` (streaming perplexity under KV cache policies) and ``sinklm sinks``
(where attention goes), on any checkpoint ``load_checkpoint`` reads.

Each checks, in this order and before torch loads, every file it will write, its numeric
settings, its cache specs and its text source; only then the model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sinklm.cli.main import UserError, check_at_least
from sinklm.cli.options import DEVICE_HELP, DTYPE_NAMES, default_device
from sinklm.cli.outputs import guard_outputs, write_atomic

if TYPE_CHECKING:
    from sinklm.data.sinks import SinkPrefix
    from sinklm.eval.texts import Stream
    from sinklm.models.load import Checkpoint


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one before any model is loaded."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device here; use --device cpu")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, metavar="P",
        help="a `sinklm fit` checkpoint (.ckpt), an exported or transformers GPTNeoX folder "
        "(with tokenizer.json), or a Hub id such as EleutherAI/pythia-160m",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", metavar="FILE",
                        help="a UTF-8 text file, one stream per file (repeatable)")
    source.add_argument("--dataset", metavar="HUB_ID[:split]",
                        help="a datasets id (or local dataset folder), one stream per row; "
                        "split defaults to test, e.g. deepmind/pg19:test")
    source.add_argument("--packed", metavar="DIR[:split]",
                        help="token ids of a `sinklm prepare-data` folder's split (default "
                        "validation), one stream per document; for a model trained with that "
                        "folder's tokenizer, e.g. the sink lab's packed/bigram_backcopy")
    parser.add_argument("--eod-first", action="store_true",
                        help="with --packed: keep the end-of-document id in front of each "
                        "document (the first one gets one too), as a model trained with "
                        "data.windows: documents saw every document start")
    parser.add_argument("--text-column", default="text", help="dataset column with the text")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="tokenizer.json to use instead of the checkpoint's")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")


def define_stream_eval(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Perplexity of a long stream (the text tokenized as one string, the "
        "model's sink ids in front) when the KV cache keeps the first X and the Y most recent "
        "tokens, with positions re-assigned inside the cache. Writes results.json, per-token "
        "losses (.npz) and a running-perplexity plot (.png) beside it, and prints the table.")
    parser.epilog = (
        "example: sinklm stream-eval --checkpoint EleutherAI/pythia-160m \\\n"
        "           --dataset deepmind/pg19:test --max-tokens 65536 \\\n"
        "           --cache 0+1024,1+1023,2+1022,4+1020,dense --output results.json\n"
        "caches: X+Y (0+Y is window attention), dense, recompute:L[:S] (sliding window of L\n"
        "tokens re-encoded for each token, or every S tokens). Default: the paper's grid with\n"
        "X+Y = half the model's trained context.")
    _add_common(parser)
    parser.add_argument("--cache", help="comma-separated cache specs")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="evaluate the first N text tokens (across streams, in order)")
    parser.add_argument("--reference", action="store_true",
                        help="use the token-by-token reference evaluator (slow, the definition)")
    parser.add_argument("--chunk-size", type=int, metavar="N",
                        help="queries per step of the fast evaluator (default 2048)")
    parser.add_argument("--output", type=Path, default=Path("results.json"),
                        help="results JSON; the .npz and .png go beside it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output (and the files beside it)")
    parser.set_defaults(func=run_stream_eval)


def define_sinks(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure where attention goes on windows of a text (each starting with the "
        "model's sink ids): mean attention to the first positions per layer and head, Gu et "
        "al.'s Sink_k^eps (share of heads whose mean attention to position k exceeds eps), the "
        "implicit sink's mass (softmax1, sink_logit), and which tokens each head attends to "
        "(first position, sink ids, newline, punctuation, other). Writes JSON and plots.")
    parser.epilog = (
        "example: sinklm sinks --checkpoint EleutherAI/pythia-160m \\\n"
        "           --text book.txt --window 512 --windows 8 --output sinks/pythia-160m.json")
    _add_common(parser)
    parser.add_argument("--window", type=int,
                        help="tokens per window, sink ids included (default: min(512, context))")
    parser.add_argument("--windows", type=int, default=4, help="windows to average over")
    parser.add_argument("--first", type=int, default=4, help="report the first K positions")
    parser.add_argument("--eps", type=float, default=0.3, help="Sink_k^eps threshold")
    parser.add_argument("--map-size", type=int, default=16,
                        help="positions shown in the attention-map plot")
    parser.add_argument("--output", type=Path, default=Path("sinks.json"),
                        help="JSON report; plots go beside it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output (and the plots beside it)")
    parser.set_defaults(func=run_sinks)


def warn(command: str, message: str) -> None:
    """One warning line on stderr: the run goes on."""
    print(f"sinklm {command}: warning: {message}", file=sys.stderr)


def load_model(args: argparse.Namespace) -> Checkpoint:
    """The checkpoint of ``--checkpoint`` (with ``--tokenizer``, ``--device``, ``--dtype``)."""
    from sinklm.models.load import DTYPES, load_checkpoint

    check_device(args.device)
    return load_checkpoint(args.checkpoint, tokenizer=args.tokenizer, device=args.device,
                           dtype=DTYPES[args.dtype])


def check_eod_first(eod_first: bool, packed: str | None) -> None:
    """Refuse ``--eod-first`` without ``--packed``: only packed ids carry end-of-document ids."""
    if eod_first and not packed:
        raise UserError("--eod-first keeps the end-of-document ids of packed data in front of "
                        "each document: use it with --packed DIR[:split]")


def note(command: str, message: str) -> None:
    """One note line on stderr: the run goes on as asked."""
    print(f"sinklm {command}: note: {message}", file=sys.stderr)


def _check_source(args: argparse.Namespace) -> None:
    """Fail on a missing text file or packed folder before the model is loaded."""
    from sinklm.eval.texts import check_files, check_packed

    check_eod_first(args.eod_first, args.packed)
    if args.text:
        check_files(args.text)
    elif args.packed:
        check_packed(args.packed)


def _streams(args: argparse.Namespace, checkpoint: Checkpoint, sinks: SinkPrefix,
             max_tokens: int | None) -> list[Stream]:
    """The streams of --text, --dataset or --packed in the checkpoint's tokens."""
    from sinklm.eval.texts import (
        encode_streams,
        eod_first_note,
        packed_streams,
        read_dataset,
        read_files,
    )

    message = eod_first_note(args.checkpoint, args.eod_first)
    if message:
        note(args.command, message)
    if args.packed:
        return packed_streams(args.packed, checkpoint.tokenizer, sinks, max_tokens,
                              eod_first=args.eod_first)
    documents: Iterator[tuple[str, str]] = (
        read_files(args.text) if args.text else read_dataset(args.dataset, args.text_column)
    )
    return encode_streams(documents, checkpoint.tokenizer, sinks, max_tokens)


def run_stream_eval(args: argparse.Namespace) -> int:
    command = "stream-eval"
    from sinklm.eval.cache import check_policies, paper_caches, parse_caches
    from sinklm.eval.report import format_ppl, markdown_table, output_files, write_outputs

    guard_outputs(output_files(args.output), args.overwrite)
    check_at_least(("--max-tokens", args.max_tokens, 2), ("--chunk-size", args.chunk_size, 1))
    policies = parse_caches(args.cache) if args.cache is not None else None
    _check_source(args)
    from sinklm.data.sinks import SinkPrefix
    from sinklm.eval.streaming import DEFAULT_CHUNK, CacheResult, evaluate

    chunk_size = DEFAULT_CHUNK if args.chunk_size is None else args.chunk_size
    args.device = args.device or default_device()
    checkpoint = load_model(args)
    config = checkpoint.model.config
    if policies is None:
        policies = paper_caches(config.max_seq_len // 2)
    sinks = SinkPrefix(checkpoint.sink_token_ids)
    streams = _streams(args, checkpoint, sinks, args.max_tokens)
    longest = max(s.tokens for s in streams)
    for warning in check_policies(policies, longest, config.max_seq_len, len(sinks),
                                  learned_positions=config.learned_positions):
        warn(command, warning)

    def report(result: CacheResult) -> None:
        print(f"cache {result.policy.label}: ppl {format_ppl(result.ppl)} over "
              f"{result.tokens} tokens, {result.tokens_per_second:,.0f} tokens/s",
              file=sys.stderr)
        for note in result.notes:
            warn(command, f"cache {result.policy.label}: {note}")

    results = evaluate(checkpoint.model, streams, policies, reference=args.reference,
                       chunk_size=chunk_size, on_result=report, progress=True)
    header = {
        "checkpoint": args.checkpoint,
        "model": checkpoint.describe(),
        "sink_token_ids": checkpoint.sink_token_ids,
        "eod_first": args.eod_first,
        "tokens": sum(s.text_tokens - 1 for s in streams),
        "text_tokens": sum(s.text_tokens for s in streams),
        "streams": [{"name": s.name, "text_tokens": s.text_tokens} for s in streams],
        "evaluator": "reference" if args.reference else "fast",
        "device": str(args.device),
        "dtype": args.dtype,
    }
    label = _row_label(checkpoint)
    document = write_outputs(args.output, header, results,
                             [s.text_tokens - 1 for s in streams], title=label)
    print(markdown_table([(label, document["results"])]))
    print(f"\nresults: {args.output}\nlosses: {document['losses']}\nplot: {document['plot']}")
    return 0


def _row_label(checkpoint: Checkpoint) -> str:
    config = checkpoint.model.config
    return f"{checkpoint.name} ({config.attention.softmax}, sink_tokens={config.sink_tokens})"


def sinks_plot_files(output: Path) -> dict[str, Path]:
    """Where ``sinklm sinks`` draws each plot of ``eval.sinks.plot_sinks``: beside the JSON,
    named after its stem (``sinks_first.png``)."""
    return {name: output.with_name(f"{output.stem}_{name}.png")
            for name in ("first", "maps", "classes")}


def run_sinks(args: argparse.Namespace) -> int:
    command = "sinks"
    plot_files = sinks_plot_files(args.output)
    guard_outputs([args.output, *plot_files.values()], args.overwrite)
    check_at_least(("--windows", args.windows, 1), ("--first", args.first, 1),
                   ("--map-size", args.map_size, 1))
    if not 0.0 <= args.eps < 1.0:
        raise UserError(f"--eps {args.eps}: must lie in [0, 1)")
    _check_source(args)
    import torch

    from sinklm.data.sinks import SinkPrefix
    from sinklm.eval.sinks import markdown_summary, measure_text, plot_sinks

    args.device = args.device or default_device()
    checkpoint = load_model(args)
    config = checkpoint.model.config
    window = args.window if args.window is not None else min(512, config.max_seq_len)
    sink_ids = checkpoint.sink_token_ids
    if window <= len(sink_ids) + 1:
        raise UserError(f"--window {window}: must hold the {len(sink_ids)} sink ids "
                        "and at least two text tokens")
    if window > config.max_seq_len:
        warn(command, f"--window {window} is longer than the {config.max_seq_len} "
              "positions the model was trained on")
    budget = args.windows * (window - len(sink_ids))
    streams = _streams(args, checkpoint, SinkPrefix(()), budget)
    report = measure_text(checkpoint, torch.cat([s.text for s in streams]), window,
                          args.windows, args.first, args.eps, args.map_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plots = plot_sinks(report, plot_files)
    document = {
        "checkpoint": args.checkpoint,
        "model": checkpoint.describe(),
        "sink_token_ids": sink_ids,
        "eod_first": args.eod_first,
        **report.to_json(),
        "plots": plots,
    }
    write_atomic(args.output, json.dumps(document, indent=2) + "\n")
    print(f"## {_row_label(checkpoint)}\n")
    print(markdown_summary(report))
    print(f"\nreport: {args.output}\nplots: {', '.join(plots.values())}")
    return 0

