"""Part 1 of ``sinklm demo``, the sink lab: a synthetic task on which sinks form in seconds.

Bigram-Backcopy data generated and packed as ``configs/data/bigram_backcopy.yaml`` says; the
``vanilla``, ``zero_sink`` and ``sink_token`` models of ``configs/experiments/bb-*.yaml`` trained
on it; ``sinklm compare`` on its held-out validation split with the paper's cache grid. Then
vanilla and zero sink with document-aligned windows (``bb-docs-*.yaml`` on
``configs/data/bigram_backcopy_docs.yaml``), where vanilla's windows all start with the
end-of-document id and it comes to depend on it, evaluated with that id in front of every
document. Then streaming generation from the sink-token model far past its trained context,
with the sink id kept and evicted, scored by the chain that made the data (the one task whose
truth is known).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinklm.cli.demo_runs import VARIANTS, DemoError, read_config, say, train
from sinklm.cli.main import UserError

if TYPE_CHECKING:
    from sinklm.data.synthetic import StreamScore

LAB_DATA = "data/bigram_backcopy.yaml"
DOCS_DATA = "data/bigram_backcopy_docs.yaml"
# The document-aligned lab trains the rows it is for: vanilla and zero sink. (Its sink-token
# model, whose windows start with two fixed tokens, needs both: the sweep's doc127-aligned.)
DOCS_VARIANTS = ("vanilla", "zero_sink")
# Generation: tokens per cache in trained contexts, and the seed of the model's and the
# chain's samples.
GENERATED_CONTEXTS = 20
GENERATION_SEED = 0


@dataclass(frozen=True)
class Lab:
    """What the sink lab made: its comparison report, the sink-token checkpoint, and the
    generator parameters the data was packed with (the truth generation is scored by)."""

    report: Any
    docs_report: Any  # the document-aligned lab's: windows led by the end-of-document id
    sink_token: Path
    source: dict[str, Any]


@dataclass(frozen=True)
class Generation:
    """Streams sampled from the sink-token model, scored per cache, and the chain's own."""

    context: int  # the model's trained context W
    tokens: int  # generated per cache
    scores: dict[str, StreamScore]  # by cache label
    truth: StreamScore  # a sample of the chain itself: what perfect looks like


def _lab_group(args: argparse.Namespace, data: str, family: str, folder: str,
               variants: tuple[str, ...], eod_first: bool
               ) -> tuple[Any, dict[str, Path], dict[str, Any]]:
    """One lab group: its data packed, ``FAMILY-VARIANT`` trained for ``variants`` into
    ``DIR/FOLDER/VARIANT``, compared on the held-out split into ``DIR/FOLDER/report``."""
    from sinklm.data import PrepareConfig, prepare_data
    from sinklm.data.errors import DataError
    from sinklm.eval.compare import Settings, compare

    config = read_config(data)
    packed = Path(config["output"])
    say(f"sink lab: Bigram-Backcopy data into {packed}")
    try:
        meta = prepare_data(PrepareConfig.from_dict(config))
    except DataError as error:
        raise DemoError(f"sink lab data: {error} (move {packed} aside to rebuild it)") from None
    checkpoints = {
        variant: train(family, variant, args.output_dir / folder / variant, packed, meta,
                       args.lab_steps, [])
        for variant in variants
    }
    settings = Settings(texts=(), packed=f"{packed}:validation", max_tokens=args.lab_eval_tokens,
                        eod_first=eod_first)
    try:
        report = compare([str(path) for path in checkpoints.values()],
                         args.output_dir / folder / "report", settings)
    except UserError as error:
        raise DemoError(f"sink lab evaluation: {error}") from None
    return report, checkpoints, meta


def run_lab(args: argparse.Namespace) -> Lab:
    """The sink lab: the three bb models on Bigram-Backcopy (windows mid-stream), then the
    vanilla and zero-sink bb-docs models (windows aligned to documents), each with its
    report."""
    report, checkpoints, meta = _lab_group(args, LAB_DATA, "bb", "lab", VARIANTS,
                                           eod_first=False)
    docs_report, _, _ = _lab_group(args, DOCS_DATA, "bb-docs", "lab-docs", DOCS_VARIANTS,
                                   eod_first=True)
    return Lab(report, docs_report, checkpoints["sink_token"], meta["source"])


def run_generation(lab: Lab) -> Generation:
    """Sample GENERATED_CONTEXTS trained contexts from the sink-token model per cache: the
    sink id kept (``1+(W-2)``, as ``sinklm generate`` defaults) and evicted (``0+(W-1)``),
    each plus the query filling the context W. Both start from the sink id alone, as every
    training window does, so the first token is a document start to the chain as well.
    Sampled at temperature 1: greedy decoding falls into a loop and leaves nothing to score."""
    from sinklm.cli.generate import default_cache
    from sinklm.data.synthetic import (
        SYMBOL_ID_OFFSET,
        BigramBackcopySpec,
        build_chain,
        generate,
        score_stream,
    )
    from sinklm.eval.cache import StartRecent
    from sinklm.eval.generate import Sampling, Session
    from sinklm.models.load import load_checkpoint

    checkpoint = load_checkpoint(lab.sink_token)
    chain = build_chain(BigramBackcopySpec.from_dict(lab.source))
    context = checkpoint.model.config.max_seq_len
    tokens = GENERATED_CONTEXTS * context
    kept = default_cache(checkpoint)
    scores: dict[str, StreamScore] = {}
    for policy in (kept, StartRecent(0, kept.size)):
        say(f"sink lab: generating {tokens:,} tokens from sink_token with cache {policy.label}")
        session = Session(checkpoint.model, policy, Sampling(temperature=1.0,
                                                             seed=GENERATION_SEED))
        session.feed(checkpoint.sink_token_ids)
        drawn = [session.draw()[0] for _ in range(tokens)]
        # Up to then both caches hold the whole stream: only later tokens can differ.
        scores[policy.label] = score_stream(chain, drawn, scored_from=context)
    (sample,) = generate(chain, [tokens], [[GENERATION_SEED]])
    truth = score_stream(chain, sample + SYMBOL_ID_OFFSET, scored_from=context)
    return Generation(context, tokens, scores, truth)


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


def print_lab(lab: Lab, args: argparse.Namespace) -> None:
    print("\n## Sink lab: Bigram-Backcopy (synthetic; Guo et al. 2024, arXiv 2410.13835)\n")
    print(f"Streaming perplexity on the held-out validation split (first "
          f"{args.lab_eval_tokens:,} tokens). A synthetic task on which sinks form in seconds; "
          "what natural text does at scale needs the GPU configs.\n")
    print("Windows mid-stream (documents of 8,192 tokens, cut on a fixed grid), as Pythia's "
          "rows are: only the sink-token model has a fixed first token to depend on.\n")
    _print_report(lab.report)
    print("\nWindows aligned to documents of 127 tokens, each led by the end-of-document id "
          "(data.windows: documents), and every held-out document streamed with that id in "
          "front (--eod-first): now every vanilla and zero-sink window starts with the same "
          "token too.\n")
    _print_report(lab.docs_report)


def _print_report(report: Any) -> None:
    print(lab_table(report))
    print()
    print("\n".join(report.findings))
    print(f"\nreport: {report.files['markdown']} ({report.provenance()})")


def generation_table(generation: Generation) -> str:
    """Per cache, and for the chain's own sample: copy accuracy, the chain's log-likelihood of
    the other tokens, and the share of them it forbids (their -inf kept out of the mean)."""
    lines = ["| cache | copy accuracy | true log-likelihood per non-copy token | non-copy "
             "tokens the chain forbids |", "|---|---:|---:|---:|"]
    rows = [*generation.scores.items(), ("the true chain's own sample", generation.truth)]
    for label, score in rows:
        accuracy = "-" if not score.copies else f"{score.copy_accuracy:.3f}"
        lines.append(f"| {label} | {accuracy} ({score.copied}/{score.copies}) | "
                     f"{score.mean_loglik:.3f} | {score.forbidden_share:.1%} "
                     f"({score.forbidden}/{score.others}) |")
    return "\n".join(lines)


def print_generation(generation: Generation) -> None:
    kept, evicted = generation.scores
    print("\n## Streaming generation from the sink lab's sink-token model, scored by the true "
          "chain\n")
    print(f"{generation.tokens:,} tokens ({generation.tokens // generation.context} x its "
          f"trained context W = {generation.context}) sampled per cache at temperature 1 (seed "
          f"{GENERATION_SEED}) from the sink id alone, written on past end-of-document as a "
          "packed stream is (a new chain starts there). Each cache plus the query fills W: "
          f"{kept} keeps the sink id, {evicted} evicts it once full; tokens are scored from the "
          f"{generation.context + 1}th on, the first whose context the caches can differ in. "
          "Copy accuracy: the share "
          "of tokens after a trigger that repeat the token before it. Log-likelihood: the "
          "chain's, in nats, of the other tokens it allows. In brackets, the counts: right "
          "copies of copy positions, forbidden of non-copy tokens.\n")
    print(generation_table(generation))
