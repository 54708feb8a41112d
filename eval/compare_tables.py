"""What ``sinklm compare``'s numbers say, as text: its Markdown tables (zero-shot, sinks, sinks
during training) and one measured sentence per model on its first token and its sinks. Pure
functions of the cached results, so they can be checked by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .cache import Dense, StartRecent
from .compare_cache import SINK_EPS
from .report import format_ppl
from .streaming import CacheResult

# 0+W at least this many times 1+(W-1): the report says the model depends on its first token.
DEPENDENCE_RATIO = 1.1


def zeroshot_markdown(results: dict[str, dict[str, dict[str, Any]]], tasks: Sequence[str]) -> str:
    """Table 4's layout: a row per model, a column per task, ``acc / acc_norm`` in percent."""
    lines = ["| Model | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for label, rows in results.items():
        cells = []
        for task in tasks:
            row = rows[task]
            scores = [f"{100 * row[m]:.1f}" for m in ("acc", "acc_norm") if row.get(m) is not None]
            cells.append(" / ".join(scores) or "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def non_trigger_first(report: dict[str, Any]) -> float | None:
    """The strongest head's attention from non-trigger queries to position 0 (Bigram-Backcopy
    only), from a sink report's JSON."""
    group = report.get("targets", {}).get("non_trigger")
    return None if group is None else max(head[0] for layer in group for head in layer)


def sinks_markdown(sinks: dict[str, dict[str, Any]]) -> str:
    """Sink_1^eps and the attention each layer gives position 0 (a sink id if the model has
    them), per model; on Bigram-Backcopy also the non-trigger queries' attention to it."""
    triggers = any(non_trigger_first(report) is not None for report in sinks.values())
    extra = " attention to position 0 from non-trigger queries (strongest head) |"
    lines = [f"| Model | Sink_1^{SINK_EPS:g} | attention to position 0 per layer |"
             + (extra if triggers else ""), "|---|---:|---|" + ("---:|" if triggers else "")]
    for label, report in sinks.items():
        layers = ", ".join(f"{m:.3f}" for m in report["attention_to_first_per_layer"])
        row = f"| {label} | {report['sink_rate']['1']:.3f} | {layers} |"
        if triggers:
            value = non_trigger_first(report)
            row += f" {'-' if value is None else f'{value:.3f}'} |"
        lines.append(row)
    return "\n".join(lines)


def sink_findings(sinks: dict[str, dict[str, Any]]) -> list[str]:
    """One measured sentence per model on whether a first-token sink formed (Gu et al.)."""
    findings = []
    for label, report in sinks.items():
        heads = np.asarray(report["attention_to_position"])[:, :, 0]
        above = int((heads > report["eps"]).sum())
        verdict = (f"{above} of {heads.size} heads give position 0 more than {report['eps']:g} "
                   "of their attention: a first-token sink formed" if above else
                   f"no head gives position 0 more than {report['eps']:g} of its attention "
                   f"(at most {heads.max():.3f}): no first-token sink by this measure")
        findings.append(f"{label}: {verdict}.")
    return findings


def first_token_findings(streams: dict[str, list[CacheResult]],
                         context: dict[str, int]) -> list[str]:
    """One measured sentence per model on what its first tokens do under the paper's caches
    (0+W against 1+(W-1) and 4+(W-4)), and a note when dense runs past the trained context."""
    findings = []
    for label, results in streams.items():
        by_start = {(r.policy.start, r.policy.size): r.ppl for r in results
                    if isinstance(r.policy, StartRecent)}
        for (start, size), window in sorted(by_start.items()):
            one, four = by_start.get((1, size)), by_start.get((4, size))
            if start != 0 or one is None:
                continue
            ratio = window / one
            verdict = ("it depends on its first token: dropping it breaks the model"
                       if ratio >= DEPENDENCE_RATIO else
                       "it does not depend on its first token")
            sentence = (f"{label}: window-only 0+{size} perplexity is {ratio:.2f}x that of "
                        f"1+{size - 1} ({format_ppl(window)} vs {format_ppl(one)}): {verdict}")
            if four is not None:
                change = four / one - 1
                sentence += (f"; 4+{size - 4} is {abs(change):.1%} "
                             f"{'below' if change < 0 else 'above'} 1+{size - 1}")
            findings.append(sentence + ".")
        dense = next((r for r in results if isinstance(r.policy, Dense)), None)
        if dense is not None and (dense.max_position or 0) >= context[label]:
            findings.append(
                f"{label}: dense attention reaches position {dense.max_position:,}, past the "
                f"{context[label]} positions the model was trained on; its perplexity "
                f"({format_ppl(dense.ppl)}) measures length extrapolation, not the cache."
            )
    return findings


def strongest_non_trigger(row: dict[str, Any]) -> float | None:
    values = row.get("non_trigger_first")
    return None if values is None else max(max(layer) for layer in values)


def training_sinks_markdown(training: dict[str, list[dict[str, Any]]]) -> str:
    """Per model, when the sink probe first saw Sink_1^eps above zero, and its last reading
    (with the non-trigger queries' attention to position 0 on Bigram-Backcopy)."""
    triggers = any(strongest_non_trigger(h[-1]) is not None for h in training.values())
    lines = ["| Model | probes | tokens trained | Sink_1^0.3 first > 0 at | last Sink_1^0.3 | "
             "last attention to position 0 per layer |"
             + (" last non-trigger attention to position 0 (strongest head) |" if triggers
                else ""),
             "|---|---:|---:|---:|---:|---|" + ("---:|" if triggers else "")]
    for label, history in training.items():
        last = history[-1]
        formed = next((row["tokens"] for row in history if row["sink_rate"] > 0), None)
        layers = ", ".join(f"{m:.3f}" for m in last["first_mass"])
        row = (f"| {label} | {len(history)} | {last['tokens']:,} | "
               f"{'never' if formed is None else f'{formed:,} tokens'} | "
               f"{last['sink_rate']:.3f} | {layers} |")
        if triggers:
            value = strongest_non_trigger(last)
            row += f" {'-' if value is None else f'{value:.3f}'} |"
        lines.append(row)
    return "\n".join(lines)

