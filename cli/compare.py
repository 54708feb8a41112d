"""``sinklm compare``: several checkpoints in one report (StreamingLLM's Tables 3 and 4, plots)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sinklm.cli.evaluate import check_device, check_eod_first
from sinklm.cli.main import UserError, check_at_least
from sinklm.cli.options import DEVICE_HELP, DTYPE_NAMES, OFFLINE_HINT, default_device


def define_compare(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate several checkpoints (a .ckpt, an exported or GPTNeoX folder, a Hub "
        "id) on the same text and tasks, and write DIR/report.md, report.json, streaming.csv "
        "(StreamingLLM's Table 3: perplexity per cache), zeroshot.csv (Table 4: acc / acc_norm "
        "per task) and plots (perplexity per cache, attention on the first token per layer, "
        "running perplexity per model). Results are cached in DIR/cache per checkpoint "
        "(path, size and mtime of its files) and setting, so a rerun computes only what is "
        "missing; a report made from other checkpoints, text or settings is replaced only "
        "with --overwrite. Models are named by their configs.")
    parser.epilog = (
        "example: sinklm compare runs/demo/vanilla/checkpoints/last.ckpt \\\n"
        "           runs/demo/sink_token/checkpoints/last.ckpt \\\n"
        "           --text ../shared/data/books/frankenstein_shelley_pg84.txt \\\n"
        "           --max-tokens 16384 --cache 0+256,1+255,2+254,4+252,dense \\\n"
        "           --tasks arc_easy,piqa --data-dir ../shared/data/benchmarks --limit 200 \\\n"
        "           --output runs/compare\n"
        "caches: X+Y (0+Y is window attention), dense, recompute:L[:S]. Default: the paper's\n"
        "grid with X+Y = half the shortest trained context of the checkpoints.")
    parser.add_argument("checkpoints", nargs="+", metavar="P",
                        help="checkpoints to compare: .ckpt, folder or Hub id")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", metavar="FILE",
                        help="a UTF-8 text file for streaming and sinks, one stream per file "
                        "(repeatable)")
    source.add_argument("--packed", metavar="DIR[:split]",
                        help="token ids of a `sinklm prepare-data` folder's split (default "
                        "validation), one stream per document, e.g. packed/bigram_backcopy "
                        "(needs checkpoints trained with that folder's tokenizer)")
    parser.add_argument("--eod-first", action="store_true",
                        help="with --packed: keep the end-of-document id in front of each "
                        "document (the first one gets one too), as models trained with "
                        "data.windows: documents saw every document start")
    parser.add_argument("--cache", help="comma-separated cache specs")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="stream the first N text tokens (across files, in order)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated lm-eval tasks (default: none, no zero-shot)")
    parser.add_argument("--data-dir", type=Path,
                        help="read the tasks from local files in this folder "
                        "(the layout of ../shared/data/benchmarks)")
    parser.add_argument("--limit", type=int, help="score only the first N items of each task")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="zero-shot sequences per forward")
    parser.add_argument("--bootstrap-iters", type=int, default=100_000,
                        help="resamples for the stderr of non-mean metrics (lambada perplexity)")
    parser.add_argument("--output", type=Path, required=True, metavar="DIR",
                        help="the report folder (reused for the same checkpoints, text and "
                        "settings: its cache makes reruns cheap)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a report made from other inputs, or write into a folder "
                        "that holds other files (they stay)")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from sinklm.eval.cache import parse_caches

    check_at_least(("--max-tokens", args.max_tokens, 2), ("--limit", args.limit, 1),
                   ("--batch-size", args.batch_size, 1))
    check_eod_first(args.eod_first, args.packed)
    tasks = tuple(name.strip() for name in args.tasks.split(",") if name.strip())
    if args.data_dir is not None and not tasks:
        raise UserError("--data-dir is for zero-shot tasks; name them with --tasks")
    caches = tuple(parse_caches(args.cache)) if args.cache is not None else None
    # The checks above answer at once; torch loads from here on.
    from sinklm.eval.compare import Settings, compare

    args.device = args.device or default_device()
    check_device(args.device)
    settings = Settings(
        texts=tuple(Path(t).expanduser() for t in args.text or ()), packed=args.packed,
        eod_first=args.eod_first, caches=caches,
        max_tokens=args.max_tokens, tasks=tasks, data_dir=args.data_dir, limit=args.limit,
        batch_size=args.batch_size, bootstrap_iters=args.bootstrap_iters,
        device=args.device, dtype=args.dtype,
    )
    try:
        report = compare(args.checkpoints, args.output, settings, args.overwrite)
    except ConnectionError as error:  # datasets cannot reach the Hub
        raise UserError(f"{error}: {OFFLINE_HINT}", code=1) from None
    print(report.streaming_table)
    print()
    print("\n".join(report.findings))
    print()
    print(report.sinks_table)
    if report.training_sinks_table is not None:
        print()
        print(report.training_sinks_table)
    if report.zeroshot_table is not None:
        print()
        print(report.zeroshot_table)
    print(f"\nreport: {report.files['markdown']} ({report.provenance()})")
    return 0
