"""The table of ``sinklm sweep``: a row per run, a line per (setting, variant), a verdict per
setting, a plot.

Per run: perplexity under 0+W, 1+(W-1) and 4+(W-4); the dependence ratio 0+W / 1+(W-1); how
far 1+(W-1) sits above 4+(W-4); and where each run's heads park (from ``sinklm compare``'s
sink measurement): non-trigger queries' attention to position 0, to themselves, to the previous
token and into the implicit sink (softmax1, sink logit), and trigger queries' attention to the
previous token (the copy), each in the head where it is largest.

A setting *shows the paper's rows* when, in every seed, vanilla's window-only perplexity is at
least ``DEPENDS`` times that of 1+(W-1) and 1+(W-1) is within ``SETTLED`` of 4+(W-4), and the
sink-token model does the same (its row holds).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sinklm.cli.sweep import Grid

DEPENDS = 1.3  # 0+W at least this many times 1+(W-1) (the bar; compare says 1.1)
SETTLED = 0.02  # 1+(W-1) at most this far above 4+(W-4)
CONFIRMING_SEEDS = 3  # the rows count as there only in this many seeds
# Row fields, in table order: (key, heading, format).
MEASURES = (
    ("ppl_window", "0+W", "{:.2f}"),
    ("ppl_one", "1+(W-1)", "{:.2f}"),
    ("ppl_four", "4+(W-4)", "{:.2f}"),
    ("ratio", "0+W / 1+(W-1)", "{:.2f}"),
    ("one_over_four", "1+(W-1) / 4+(W-4)", "{:.3f}"),
    ("first", "non-trigger → position 0", "{:.3f}"),
    ("self", "non-trigger → itself", "{:.3f}"),
    ("before", "non-trigger → previous", "{:.3f}"),
    ("implicit", "implicit sink", "{:.3f}"),
    ("previous", "trigger → previous", "{:.3f}"),
)


def _strongest(group: list[list[list[float]]] | None, target: int) -> float | None:
    """The largest value over layers and heads of one target (first, self, previous)."""
    if group is None:
        return None
    return max(head[target] for layer in group for head in layer)


def attention_columns(sinks: dict[str, Any]) -> dict[str, float | None]:
    """Where the heads park, from a full sink report (``SinkReport.to_json``)."""
    targets = sinks.get("targets", {})
    names = targets.get("targets", ["first", "self", "previous"])
    implicit = sinks.get("implicit_sink")
    return {
        "first": _strongest(targets.get("non_trigger"), names.index("first")),
        "self": _strongest(targets.get("non_trigger"), names.index("self")),
        "before": _strongest(targets.get("non_trigger"), names.index("previous")),
        "implicit": None if implicit is None else max(max(layer) for layer in implicit),
        "previous": _strongest(targets.get("trigger"), names.index("previous")),
    }


def setting_rows(runs: Sequence[dict[str, Any]], document: dict[str, Any],
                 sinks: dict[str, dict[str, Any]], grid: Grid) -> list[dict[str, Any]]:
    """One row per run: ``runs`` in the order their checkpoints went to compare, whose
    ``document`` (report.json) and full sink reports (by label) hold the numbers."""
    window, one, four = grid.caches()
    rows = []
    for run, model in zip(runs, document["models"], strict=True):
        label = model["label"]
        ppl = {r["cache"]: r["ppl"] for r in document["streaming"]["results"][label]}
        rows.append({**run, "ppl_window": ppl[window], "ppl_one": ppl[one],
                     "ppl_four": ppl[four], "ratio": ppl[window] / ppl[one],
                     "one_over_four": ppl[one] / ppl[four], **attention_columns(sinks[label])})
    return rows


def dependence(row: dict[str, Any]) -> str:
    """What one run needs of its first tokens: ``its first token`` (0+W at least ``DEPENDS``
    times 1+(W-1), which is within ``SETTLED`` of 4+(W-4): the paper's rows), ``several first
    tokens`` (0+W that far above 4+(W-4), but one kept token is not enough), or ``none``."""
    settled = row["one_over_four"] <= 1 + SETTLED
    if row["ratio"] >= DEPENDS and settled:
        return "its first token"
    if row["ratio"] * row["one_over_four"] >= DEPENDS and not settled:
        return "several first tokens"
    return "none"


def shows_rows(rows: Sequence[dict[str, Any]], variant: str) -> bool:
    """Whether every seed of ``variant`` depends on its first token and settles at one."""
    mine = [r for r in rows if r["variant"] == variant]
    return bool(mine) and all(dependence(r) == "its first token" for r in mine)


def _needs(rows: Sequence[dict[str, Any]], variant: str) -> str:
    found = [dependence(r) for r in rows if r["variant"] == variant]
    if len(set(found)) == 1:
        return "needs nothing of its first tokens" if found[0] == "none" else (
            f"needs {found[0]}")
    counts = ", ".join(f"{found.count(kind)} {kind}" for kind in dict.fromkeys(found))
    return f"varies by seed ({counts})"


def verdict(rows: Sequence[dict[str, Any]]) -> str:
    """A setting's outcome in words, measured against the acceptance above."""
    seeds = len({r["seed"] for r in rows})
    plural = "s" if seeds > 1 else ""
    has = {r["variant"] for r in rows}
    if {"vanilla", "sink_token"} <= has and all(shows_rows(rows, v)
                                                 for v in ("vanilla", "sink_token")):
        if seeds < CONFIRMING_SEEDS:
            return (f"the paper's rows appear in {seeds} seed{plural} "
                    f"(confirm with {CONFIRMING_SEEDS})")
        return f"the paper's rows appear ({seeds} seeds)"
    parts = [f"{variant} {_needs(rows, variant)}"
             for variant in dict.fromkeys(r["variant"] for r in rows)]
    return "; ".join(parts) + f" ({seeds} seed{plural})"


def _cell(values: list[float | None], form: str) -> str:
    numbers = [v for v in values if v is not None]
    if not numbers:
        return "-"
    mean = form.format(statistics.fmean(numbers))
    if len(numbers) == 1:
        return mean
    return f"{mean} ({form.format(min(numbers))}-{form.format(max(numbers))})"


def markdown(rows: Sequence[dict[str, Any]], grid: Grid) -> str:
    """The sweep's table (mean and min-max over seeds) and a verdict per setting."""
    about = {s.name: s.about for s in grid.settings}
    head = "| setting | variant | seeds | " + " | ".join(h for _, h, _ in MEASURES) + " |"
    lines = [f"W = {grid.window}; attention in the head where it is largest; "
             f"mean (min-max) over seeds. A setting shows the paper's rows when vanilla and "
             f"sink_token both have 0+W >= {DEPENDS}x 1+(W-1) and 1+(W-1) within "
             f"{SETTLED:.0%} of 4+(W-4) in every seed.", "", head,
             "|---|---|---:|" + "---:|" * len(MEASURES)]
    order = [s.name for s in grid.settings]
    for name in order:
        mine = [r for r in rows if r["setting"] == name]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            group = [r for r in mine if r["variant"] == variant]
            cells = [_cell([r[key] for r in group], form) for key, _, form in MEASURES]
            lines.append(f"| {name} | {variant} | {len(group)} | " + " | ".join(cells) + " |")
    lines += ["", "| setting | what it changes | outcome |", "|---|---|---|"]
    for name in order:
        mine = [r for r in rows if r["setting"] == name]
        if mine:
            lines.append(f"| {name} | {about[name] or '-'} | {verdict(mine)} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], grid: Grid, path: Path) -> None:
    """0+W / 1+(W-1) per setting and variant, one dot per seed, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in grid.settings if any(r["setting"] == s.name for r in rows)]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.2))
    width = 0.8 / max(1, len(variants))
    for k, variant in enumerate(variants):
        xs, ys = [], []
        for i, name in enumerate(names):
            for r in rows:
                if r["setting"] == name and r["variant"] == variant:
                    xs.append(i - 0.4 + width * (k + 0.5))
                    ys.append(r["ratio"])
        ax.scatter(xs, ys, label=variant, s=22)
    ax.axhline(DEPENDS, color="grey", linestyle="--", linewidth=1,
               label=f"{DEPENDS}x: depends on its first token")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel(f"0+{grid.window} / 1+{grid.window - 1} perplexity")
    ax.set_title("Window-only cost per setting (one dot per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(rows: Sequence[dict[str, Any]], grid: Grid, out: Path) -> dict[str, str]:
    """sweep.md, sweep.json, sweep.csv (a row per run) and sweep.png in ``out``."""
    from sinklm.cli.outputs import write_atomic

    files = {"markdown": out / "sweep.md", "json": out / "sweep.json", "csv": out / "sweep.csv",
             "plot": out / "sweep.png"}
    write_atomic(files["markdown"], markdown(rows, grid))
    verdicts = {s.name: verdict([r for r in rows if r["setting"] == s.name])
                for s in grid.settings if any(r["setting"] == s.name for r in rows)}
    write_atomic(files["json"], json.dumps({"grid": grid.to_json(), "rows": list(rows),
                                            "verdicts": verdicts}, indent=2) + "\n")
    with files["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["setting"])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, grid, files["plot"])
    return {key: str(path) for key, path in files.items()}
