"""Part 1 of ``sinklm demo``, the sink lab: a synthetic task on which sinks form in seconds.

Bigram-Backcopy data generated and packed as ``configs/data/bigram_backcopy.yaml`` says; the
``vanilla``, ``zero_sink`` and ``sink_token`` models of ``configs/experiments/bb-*.yaml`` trained
on it; ``sinklm compare`` on its held-out validation split with the paper's cache grid.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sinklm.cli.demo_runs import VARIANTS, DemoError, read_config, say, train
from sinklm.cli.main import UserError

LAB_DATA = "data/bigram_backcopy.yaml"


def run_lab(args: argparse.Namespace) -> Any:
    """The sink lab: Bigram-Backcopy packed, the three bb models trained, their report."""
    from sinklm.data import PrepareConfig, prepare_data
    from sinklm.data.errors import DataError
    from sinklm.eval.compare import Settings, compare

    config = read_config(LAB_DATA)
    packed = Path(config["output"])
    say(f"sink lab: Bigram-Backcopy data into {packed}")
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
    except UserError as error:
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
