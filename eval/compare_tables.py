"""What ``sinklm compare``'s numbers say, as text: its Markdown tables (zero-shot, sinks, sinks
during training) and one measured finding per model that ties its first-token measures. Pure
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


def model_findings(streams: dict[str, list[CacheResult]], sinks: dict[str, dict[str, Any]],
                   context: dict[str, int]) -> list[str]:
    """One finding per model that ties the three measures of a first-token sink together:
    dependence (window-only 0+W perplexity against 1+(W-1)), attention to position 0 (per
    layer; on Bigram-Backcopy also from non-trigger queries, where a copy head parks), and
    Sink_1^eps (heads whose mean attention to position 0 exceeds eps, Gu et al.). A model may
    need its first token while no head passes eps on average, so the verdict names which."""
    findings = []
    for label in dict.fromkeys([*streams, *sinks]):
        results, report = streams.get(label, []), sinks.get(label)
        parts, depends = _dependence(results)
        above, eps = None, 0.0
        if report is not None:
            attention, above, eps = _attention(report)
            parts.append(attention)
        sentence = f"{label}: " + "; ".join(parts)
        if depends is not None and above is not None:
            sentence += ". So: " + _verdict(depends, above > 0, eps)
        dense = next((r for r in results if isinstance(r.policy, Dense)), None)
        if dense is not None and (dense.max_position or 0) >= context[label]:
            sentence += (
                f". Dense attention reaches position {dense.max_position:,}, past the "
                f"{context[label]} positions the model was trained on: its perplexity "
                f"({format_ppl(dense.ppl)}) measures length extrapolation, not the cache"
            )
        findings.append(sentence + ".")
    return findings


def _dependence(results: list[CacheResult]) -> tuple[list[str], bool | None]:
    """Per cache size W of the grid, 0+W against 1+(W-1) (and 4+(W-4)): the clauses, and
    whether any 0+W is DEPENDENCE_RATIO times worse (None without such a pair)."""
    by_start = {(r.policy.start, r.policy.size): r.ppl for r in results
                if isinstance(r.policy, StartRecent)}
    clauses: list[str] = []
    depends: bool | None = None
    for (start, size), window in sorted(by_start.items()):
        one, four = by_start.get((1, size)), by_start.get((4, size))
        if start != 0 or one is None:
            continue
        ratio = window / one
        if four is not None and one / four >= DEPENDENCE_RATIO:
            # One kept token is not enough (by the same ratio): the model needs several, such
            # as two sink ids, or a sink id and the token every training window has after it.
            depends = True
            clauses.append(
                f"it depends on more than its first token (window-only 0+{size} perplexity is "
                f"{window / four:.2f}x that of 4+{size - 4}, {format_ppl(window)} vs "
                f"{format_ppl(four)}, and keeping one, 1+{size - 1}, is still "
                f"{one / four - 1:.1%} above it)")
            continue
        depends = bool(depends) or ratio >= DEPENDENCE_RATIO
        verdict = "depends on" if ratio >= DEPENDENCE_RATIO else "does not depend on"
        clause = (f"it {verdict} its first token (window-only 0+{size} perplexity is "
                  f"{ratio:.2f}x that of 1+{size - 1}, {format_ppl(window)} vs "
                  f"{format_ppl(one)}")
        if four is not None:
            change = four / one - 1
            clause += (f"; 4+{size - 4} is {abs(change):.1%} "
                       f"{'below' if change < 0 else 'above'} 1+{size - 1}")
        clauses.append(clause + ")")
    return clauses, depends


def _attention(report: dict[str, Any]) -> tuple[str, int, float]:
    """The attention clause of a sink report (mass on position 0, Sink_1^eps), the number of
    heads above eps, and eps."""
    heads = np.asarray(report["attention_to_position"])[:, :, 0]
    eps = float(report["eps"])
    above = int((heads > eps).sum())
    layers = ", ".join(f"{m:.3f}" for m in report["attention_to_first_per_layer"])
    clause = f"attention to position 0 averages {layers} per layer"
    non_trigger = non_trigger_first(report)
    if non_trigger is not None:
        clause += f" ({non_trigger:.3f} from non-trigger queries in the strongest head)"
    clause += (f", and {above} of {heads.size} heads give it more than {eps:g} "
               f"(Sink_1^{eps:g} = {above / heads.size:.3f}; the strongest head "
               f"{heads.max():.3f})")
    return clause, above, eps


def _verdict(depends: bool, attended: bool, eps: float) -> str:
    """What the dependence and Sink_1^eps say together."""
    if depends and attended:
        return ("a first-token sink: heads park attention on position 0 and the model breaks "
                "without it")
    if depends:
        return (f"it needs its first token though no head gives it more than {eps:g} of its "
                "attention on average: a partial sink, which some queries use")
    if attended:
        return ("heads attend to position 0, yet windows without it lose nothing: the recent "
                "tokens take over that no-op")
    return "no first-token sink by any of the three measures"


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

