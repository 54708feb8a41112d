"""Streaming-evaluation outputs: results.json, per-token losses (.npz), the Markdown table in
StreamingLLM's Table 3 layout (a row per model, a column per cache) and the running-perplexity
plot. Tables read the JSON rows, so a comparison of several runs can reuse them. Importing it
loads no torch: ``sinklm stream-eval`` guards :func:`output_files` before anything slow."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sinklm.cli.outputs import write_atomic

from .plots import figure

if TYPE_CHECKING:
    from .streaming import CacheResult

# Points drawn per line of the running-perplexity plot, whatever the stream length.
PLOT_POINTS = 2000


def format_ppl(ppl: float) -> str:
    """Two decimals, or a whole number once it is large (the paper writes 29214, 18.05)."""
    if not math.isfinite(ppl):
        return "inf"
    return f"{ppl:.0f}" if ppl >= 1000 else f"{ppl:.2f}"


def markdown_table(rows: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """Perplexity with one row per model and one column per cache (first-seen order)."""
    columns: list[str] = []
    for _, results in rows:
        columns += [r["cache"] for r in results if r["cache"] not in columns]
    lines = [
        "| Cache config | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, results in rows:
        by_cache = {r["cache"]: format_ppl(r["ppl"]) for r in results}
        lines.append(f"| {label} | " + " | ".join(by_cache.get(c, "-") for c in columns) + " |")
    return "\n".join(lines)


def running_ppl(losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token count, perplexity of the tokens so far) at up to PLOT_POINTS evenly spaced points."""
    cumulative = np.cumsum(losses.astype(np.float64))
    index = np.unique(np.linspace(0, len(losses) - 1, min(PLOT_POINTS, len(losses))).astype(int))
    return index + 1, np.exp(cumulative[index] / (index + 1))


def plot_running_ppl(results: Sequence[CacheResult], path: Path, title: str) -> None:
    """Each cache's perplexity so far against scored tokens: where a cache breaks down, its
    curve leaves the others."""
    with figure(path, figsize=(7, 4)) as (_, ax):
        for result in results:
            x, y = running_ppl(result.losses)
            ax.plot(x, y, label=f"{result.policy.label} ({format_ppl(result.ppl)})")
        ax.set(xlabel="scored tokens", ylabel="running perplexity", title=title, yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def output_files(output: Path) -> list[Path]:
    """What :func:`write_outputs` writes: the JSON, then the .npz and .png beside it."""
    return [output, output.with_suffix(".npz"), output.with_suffix(".png")]


def write_outputs(
    output: Path,
    header: dict[str, Any],
    results: Sequence[CacheResult],
    stream_lengths: Sequence[int],
    title: str,
) -> dict[str, Any]:
    """results.json at ``output``; the losses (.npz) and plot (.png) beside it with its stem.

    The .npz holds one float32 array of per-token losses per cache label, in stream order, and
    ``stream_lengths``: the scored tokens of each stream, to split them.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    _, losses_path, plot_path = output_files(output)
    arrays = {r.policy.label: r.losses for r in results}
    np.savez(losses_path, stream_lengths=np.asarray(stream_lengths, dtype=np.int64), **arrays)
    plot_running_ppl(results, plot_path, title)
    document = {
        **header,
        "results": [r.to_json() for r in results],
        "losses": str(losses_path),
        "plot": str(plot_path),
    }
    write_atomic(output, json.dumps(document, indent=2) + "\n")
    return document
