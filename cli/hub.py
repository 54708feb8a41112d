"""``sinklm export`` (a Hugging Face folder, optionally pushed) and ``sinklm zeroshot`` (lm-eval).

Both take ``--checkpoint`` as every evaluator does (``models.load.load_checkpoint``) and check
their cheap inputs (output paths, task names, data files, Hub token) before loading a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sinklm.cli.main import UserError
from sinklm.cli.options import CHECKPOINT_HELP, DEVICE_HELP, DTYPE_NAMES, OFFLINE_HINT
from sinklm.cli.outputs import guard_outputs, guard_writable, write_atomic
from sinklm.eval.zeroshot_tasks import PAPER_TASKS


def define_export(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write safetensors weights, config.json, the tokenizer (which prepends the sink "
        "tokens), generation_config.json and a model card with the training recipe and "
        "the results files found beside the checkpoint. Vanilla and sink-token models "
        "load as plain GPTNeoXForCausalLM; softmax1, sink_logit and gated models ship "
        "their modeling code (trust_remote_code=True)."
    )
    parser.epilog = (
        "example: sinklm export --checkpoint "
        "runs/pythia-160m-sink_token/checkpoints/last.ckpt \\\n"
        "           --output exports/pythia-160m-sink_token\n"
        "         sinklm export --checkpoint runs/pythia-160m-zero_sink/checkpoints/last.ckpt \\\n"
        "           --output exports/pythia-160m-zero_sink "
        "--push-to-hub me/pythia-160m-zero-sink --private"
    )
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--output", required=True, help="the folder to write")
    parser.add_argument("--tokenizer", help="a tokenizer.json to use instead of the checkpoint's")
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="float32", help="precision of the saved weights"
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder to this repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="write into an existing folder, replacing the export's files (others stay)",
    )
    parser.set_defaults(func=run_export)


def define_zeroshot(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Score a checkpoint on lm-eval tasks at zero shots and write acc and acc_norm (where "
        "a task has them) with their stderr, and the lm-eval version, to a JSON file. With "
        "--data-dir the tasks read local files (the layout of ../shared/data/benchmarks) "
        "with lm-eval's own task definitions; without it, lm-eval's Hub datasets."
    )
    parser.epilog = (
        "example: sinklm zeroshot --checkpoint "
        "runs/pythia-160m-sink_token/checkpoints/last.ckpt \\\n"
        "           --data-dir ../shared/data/benchmarks --limit 100 "
        "--output runs/pythia-160m-sink_token/zeroshot_results.json"
    )
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument(
        "--tasks", default=",".join(PAPER_TASKS),
        help="comma-separated lm-eval task names (default: the paper's seven)",
    )
    parser.add_argument("--limit", type=int, help="score only the first N items of each task")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    parser.add_argument("--data-dir", help="read the tasks from local files in this folder")
    parser.add_argument("--output", required=True, help="the results JSON file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="float32", help="precision of the weights"
    )
    parser.add_argument("--tokenizer", help="a tokenizer.json to use instead of the checkpoint's")
    parser.add_argument(
        "--bootstrap-iters", type=int, default=100_000,
        help="resamples for the stderr of non-mean metrics (lambada perplexity)",
    )
    parser.set_defaults(func=run_zeroshot)


def run_export(args: argparse.Namespace) -> int:
    from sinklm.models.hub import (
        HubError,
        check_hub_token,
        check_output,
        export_model,
        find_results,
        find_training_recipe,
        push_to_hub,
    )
    from sinklm.models.load import DTYPES, load_checkpoint

    if args.private and not args.push_to_hub:
        raise UserError("--private applies to --push-to-hub REPO_ID; give both")
    out = check_output(args.output, args.checkpoint, args.overwrite)
    guard_writable([out, out.parent])  # the export is staged beside the folder, then renamed
    if args.push_to_hub:
        try:
            check_hub_token(args.push_to_hub)
        except HubError as error:  # a malformed repo id or no token: the user's to fix, exit 2
            raise UserError(error) from None
    checkpoint = load_checkpoint(args.checkpoint, args.tokenizer, dtype=DTYPES[args.dtype])
    folder = export_model(
        checkpoint,
        args.output,
        training=find_training_recipe(checkpoint.source),
        results=find_results(checkpoint.source),
        repo_id=args.push_to_hub,
        overwrite=args.overwrite,
    )
    print(f"sinklm export: wrote {folder}")
    if args.push_to_hub:
        url = push_to_hub(folder, args.push_to_hub, private=args.private)
        print(f"sinklm export: pushed to {url}")
    return 0


def run_zeroshot(args: argparse.Namespace) -> int:
    output = Path(args.output).expanduser()
    guard_outputs([output], args.overwrite)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: give a positive number of items")
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise UserError("--tasks is empty: name at least one lm-eval task")
    from sinklm.eval.zeroshot_tasks import check_tasks

    check_tasks(tasks, args.data_dir)  # before torch and lm-eval load
    from lm_eval.utils import make_table

    from sinklm.eval.zeroshot import SinkLMEval, evaluate, summarize
    from sinklm.eval.zeroshot_tasks import task_specs

    try:
        specs = task_specs(tasks, args.data_dir)
        model = SinkLMEval(
            args.checkpoint, args.batch_size, args.device, args.dtype, args.tokenizer
        )
        raw = evaluate(model, specs, limit=args.limit, bootstrap_iters=args.bootstrap_iters)
    except ConnectionError as error:  # datasets cannot reach the Hub
        raise UserError(f"{error}: {OFFLINE_HINT}", code=1) from None
    settings = {
        "checkpoint": args.checkpoint,
        "tasks": tasks,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "data_dir": str(Path(args.data_dir).resolve()) if args.data_dir else None,
        "device": str(model.device),
        "dtype": args.dtype,
        "bootstrap_iters": args.bootstrap_iters,
    }
    results = summarize(raw, model, settings)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, json.dumps(results, indent=2) + "\n")
    print(make_table(raw))
    print(f"sinklm zeroshot: wrote {output}")
    return 0
