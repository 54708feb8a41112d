"""Where attention goes: sink diagnostics per layer and head.

On windows of a text (each window starts with the model's sink ids, as in training) the eager
kernel's probabilities give, per layer and head:

- the mean attention to each of the first k positions, alpha[l, h, p] = mean over queries
  t >= p of A[t, p] (Gu et al., ICLR 2025), and Sink_k^eps = share of heads with alpha > eps;
- the mass that goes to the implicit sink (softmax1 and sink_logit: one minus the row sum);
- which tokens receive attention: the first position, further sink ids, newlines, punctuation,
  other tokens. A model without a first-token sink often parks attention on newlines instead,
  so this shows where the sinks are, not only whether position 0 is one;
- the head-averaged attention map of the first positions (StreamingLLM's Figure 2).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from sinklm.data.sinks import SinkPrefix
from sinklm.data.synthetic import trigger_token_ids
from sinklm.models import CausalLM
from sinklm.models.config import check_embeddable
from sinklm.models.load import Checkpoint

from .plots import figure

TOKEN_CLASSES = ("first", "sink_ids", "newline", "punctuation", "other")
# Query groups of the relative-target table: every query, and on Bigram-Backcopy (a tokenizer
# with trigger symbols) the queries that are not triggers (a copy head has nothing to do there:
# where it parks is the sink) and those that are (where it must look at the previous token).
QUERY_GROUPS = ("all", "non_trigger", "trigger")
TARGETS = ("first", "self", "previous")


def token_class(text: str) -> str:
    """``newline`` if the token holds a line break, ``punctuation`` if it is only punctuation or
    symbols (with optional spaces), else ``other``."""
    if "\n" in text or "\r" in text:
        return "newline"
    stripped = text.strip()
    if stripped and all(unicodedata.category(ch)[0] in "PS" for ch in stripped):
        return "punctuation"
    return "other"


def classify_positions(tokenizer: Tokenizer, ids: Tensor, n_sink_ids: int) -> Tensor:
    """Class index (into TOKEN_CLASSES) of each position of a window starting with sink ids."""
    decoded: dict[int, int] = {}
    classes = []
    for position, token in enumerate(ids.tolist()):
        if position == 0:
            classes.append(TOKEN_CLASSES.index("first"))
        elif position < n_sink_ids:
            classes.append(TOKEN_CLASSES.index("sink_ids"))
        else:
            if token not in decoded:
                decoded[token] = TOKEN_CLASSES.index(token_class(tokenizer.decode([token])))
            classes.append(decoded[token])
    return torch.tensor(classes, dtype=torch.long)


def make_windows(text_ids: Tensor, sinks: SinkPrefix, window: int, count: int) -> list[Tensor]:
    """Up to ``count`` consecutive windows of ``window`` tokens, each starting with the sink ids."""
    step = window - len(sinks)
    if step < 1:
        raise ValueError(f"a window of {window} tokens cannot hold {len(sinks)} sink ids")
    windows = []
    for start in range(0, len(text_ids), step):
        chunk = text_ids[start : start + step]
        if len(windows) == count or len(chunk) < 2:
            break
        windows.append(sinks.prepend(chunk))
    if not windows:
        raise ValueError("the text has fewer than two tokens: nothing to measure")
    return windows


@dataclass
class SinkReport:
    """Attention statistics per layer and head, averaged over the windows measured."""

    window: int
    windows: int
    eps: float
    to_position: np.ndarray  # [L, H, k]: alpha, mean attention to position p over queries >= p
    implicit_sink: np.ndarray | None  # [L, H]: mean implicit-sink mass (softmax1, sink_logit)
    class_share: np.ndarray  # [L, H, classes]: mean mass per token class over queries t >= 1
    class_counts: dict[str, int]  # positions of each class in the windows
    attention_map: np.ndarray  # [L, H, m, m]: mean probabilities among the first m positions
    # Per query group (QUERY_GROUPS, those with queries): [L, H, 3] mean attention of queries
    # t >= 2 to position 0, to themselves and to the previous token (TARGETS).
    targets: dict[str, np.ndarray]

    def sink_rate(self, position: int = 1) -> float:
        """Gu et al.'s Sink_k^eps for the 1-based ``position`` k: share of heads above eps."""
        return float((self.to_position[:, :, position - 1] > self.eps).mean())

    def sink_heads(self, position: int = 1) -> list[tuple[int, int]]:
        above = np.argwhere(self.to_position[:, :, position - 1] > self.eps)
        return [(int(layer), int(head)) for layer, head in above]

    def non_trigger_first(self) -> np.ndarray | None:
        """[L, H] attention of non-trigger queries to position 0 (Bigram-Backcopy only): the
        quantity the active-dormant mechanism predicts to grow in the copy heads."""
        group = self.targets.get("non_trigger")
        return None if group is None else group[:, :, 0]

    def dominant(self) -> list[list[tuple[str, float]]]:
        """Per layer and head: where most of its attention goes, and that share."""
        shares, names = self.class_share, list(TOKEN_CLASSES)
        if self.implicit_sink is not None:
            shares = np.concatenate([shares, self.implicit_sink[..., None]], axis=-1)
            names.append("implicit_sink")
        best = shares.argmax(-1)
        return [
            [(names[index], float(shares[layer, head, index])) for head, index in enumerate(row)]
            for layer, row in enumerate(best)
        ]

    def to_json(self) -> dict[str, Any]:
        first = self.to_position.shape[2]
        return {
            "window": self.window,
            "windows": self.windows,
            "eps": self.eps,
            "sink_rate": {str(k): self.sink_rate(k) for k in range(1, first + 1)},
            "sink_heads": [list(pair) for pair in self.sink_heads(1)],
            "attention_to_position": self.to_position.tolist(),
            "attention_to_first_per_layer": self.to_position[:, :, 0].mean(1).tolist(),
            "implicit_sink": None if self.implicit_sink is None else self.implicit_sink.tolist(),
            "token_classes": {
                "classes": list(TOKEN_CLASSES),
                "share": self.class_share.tolist(),
                "counts": self.class_counts,
                "dominant": [[{"class": c, "share": s} for c, s in row] for row in self.dominant()],
            },
            "attention_map": self.attention_map.tolist(),
            "targets": {"targets": list(TARGETS),
                        **{group: value.tolist() for group, value in self.targets.items()}},
        }


@torch.no_grad()
def measure_sinks(
    model: CausalLM,
    windows: list[Tensor],
    classes: list[Tensor],
    first: int = 4,
    eps: float = 0.3,
    map_size: int = 16,
    trigger_ids: list[int] | None = None,
) -> SinkReport:
    """Attention statistics of ``model`` on ``windows`` (token ids) with per-position classes;
    with ``trigger_ids`` (Bigram-Backcopy), also per trigger / non-trigger query."""
    longest = max(len(w) for w in windows)
    check_embeddable(model.config, longest - 1, f"windows of {longest} tokens",
                     f"use windows of at most {model.config.max_seq_len} tokens")
    device = next(model.parameters()).device
    n_layer, n_head = model.config.n_layer, model.config.n_head
    has_sink = model.config.attention.softmax in ("softmax1", "sink_logit")
    first = min(first, min(len(w) for w in windows))
    size = min(map_size, min(len(w) for w in windows))
    to_position = torch.zeros(n_layer, n_head, first, dtype=torch.float64)
    position_count = torch.zeros(first, dtype=torch.float64)
    implicit = torch.zeros(n_layer, n_head, dtype=torch.float64)
    share = torch.zeros(n_layer, n_head, len(TOKEN_CLASSES), dtype=torch.float64)
    attention_map = torch.zeros(n_layer, n_head, size, size, dtype=torch.float64)
    targets = torch.zeros(len(QUERY_GROUPS), n_layer, n_head, len(TARGETS), dtype=torch.float64)
    group_count = torch.zeros(len(QUERY_GROUPS), dtype=torch.float64)
    triggers = torch.tensor(sorted(trigger_ids or []), dtype=torch.long)
    queries = 0
    for ids, cls in zip(windows, classes, strict=True):
        _, probs = model.forward_with_attentions(ids.unsqueeze(0).to(device))
        one_hot = torch.nn.functional.one_hot(cls.to(device), len(TOKEN_CLASSES)).double()
        t = len(ids)
        position_count += torch.arange(t, t - first, -1, dtype=torch.float64)
        queries += t - 1
        groups = _query_groups(ids, triggers)  # [G, T - 2] over queries 2..T-1
        group_count += groups.sum(1)
        rows = torch.arange(2, t)
        for layer, p in enumerate(probs):
            p = p[0].double()  # [H, T, S]
            to_position[layer] += p[:, :, :first].sum(1).cpu()
            implicit[layer] += (1.0 - p[:, 1:].sum(-1)).sum(-1).cpu()
            share[layer] += (p[:, 1:] @ one_hot).sum(1).cpu()
            attention_map[layer] += p[:, :size, :size].cpu()
            picked = torch.stack([p[:, 2:, 0], p[:, rows, rows], p[:, rows, rows - 1]], -1).cpu()
            targets[:, layer] += torch.einsum("gq,hqk->ghk", groups, picked)
    counts = torch.stack([torch.bincount(c, minlength=len(TOKEN_CLASSES)) for c in classes]).sum(0)
    return SinkReport(
        window=max(len(w) for w in windows),
        windows=len(windows),
        eps=eps,
        to_position=(to_position / position_count).numpy(),
        implicit_sink=(implicit / queries).numpy() if has_sink else None,
        class_share=(share / queries).numpy(),
        class_counts={name: int(n) for name, n in zip(TOKEN_CLASSES, counts, strict=True)},
        attention_map=(attention_map / len(windows)).numpy(),
        targets={name: (targets[g] / group_count[g]).numpy()
                 for g, name in enumerate(QUERY_GROUPS) if group_count[g] > 0},
    )


def _query_groups(ids: Tensor, triggers: Tensor) -> Tensor:
    """[groups, T - 2] float masks over queries 2..T-1: all, non-trigger, trigger (the last two
    empty when there are no trigger ids)."""
    queries = ids[2:].cpu()
    everyone = torch.ones(len(queries), dtype=torch.float64)
    if len(triggers) == 0:
        return torch.stack([everyone, torch.zeros_like(everyone), torch.zeros_like(everyone)])
    is_trigger = torch.isin(queries, triggers).double()
    return torch.stack([everyone, 1.0 - is_trigger, is_trigger])


def measure_text(
    checkpoint: Checkpoint,
    text_ids: Tensor,
    window: int,
    count: int,
    first: int = 4,
    eps: float = 0.3,
    map_size: int = 16,
) -> SinkReport:
    """measure_sinks on up to ``count`` windows of ``text_ids``, each led by the sink ids."""
    sinks = SinkPrefix(checkpoint.sink_token_ids)
    windows = make_windows(text_ids, sinks, window, count)
    classes = [classify_positions(checkpoint.tokenizer, w, len(sinks)) for w in windows]
    return measure_sinks(checkpoint.model, windows, classes, first, eps, map_size,
                         trigger_token_ids(checkpoint.tokenizer))


def markdown_summary(report: SinkReport) -> str:
    """Sink_k^eps and, per layer, the attention to the first position and each head's target."""
    first = report.to_position.shape[2]
    rates = ", ".join(
        f"Sink_{k}^{report.eps:g} = {report.sink_rate(k):.3f}" for k in range(1, first + 1)
    )
    lines = [
        f"{rates} ({report.windows} windows of {report.window} tokens)",
        "",
        "| layer | attention to position 0 | implicit sink | heads: where attention goes |",
        "|---:|---:|---:|---|",
    ]
    for layer, heads in enumerate(report.dominant()):
        sink = "-" if report.implicit_sink is None else f"{report.implicit_sink[layer].mean():.3f}"
        where = ", ".join(f"h{h} {name} {share:.0%}" for h, (name, share) in enumerate(heads))
        first_mass = report.to_position[layer, :, 0].mean()
        lines.append(f"| {layer} | {first_mass:.3f} | {sink} | {where} |")
    groups = [g for g in QUERY_GROUPS if g in report.targets]
    lines += ["", "Where each head's queries (t >= 2) look, as first / self / previous token:", "",
              "| layer | head | " + " | ".join(f"{g.replace('_', '-')} queries" for g in groups)
              + " |", "|---:|---:|" + "---|" * len(groups)]
    for (layer, head), _ in np.ndenumerate(report.to_position[:, :, 0]):
        cells = [" / ".join(f"{v:.2f}" for v in report.targets[g][layer, head]) for g in groups]
        lines.append(f"| {layer} | {head} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sinks(report: SinkReport, paths: Mapping[str, Path]) -> dict[str, str]:
    """Heatmaps of attention to position 0 (and the implicit sink) into ``paths["first"]``, the
    attention maps of the first positions per layer (``"maps"``), and each head's share per
    token class (``"classes"``). The caller names the files: a command guards them before it
    loads torch. Returns the paths as strings."""
    _plot_first(report, str(paths["first"]))
    _plot_maps(report, str(paths["maps"]))
    _plot_classes(report, str(paths["classes"]))
    return {name: str(path) for name, path in paths.items()}


def _plot_first(report: SinkReport, path: str) -> None:
    """Heatmaps (layer x head) of attention to position 0 and, with softmax1 or a sink logit,
    of the implicit sink's mass, each cell written out."""
    n_layer, n_head = report.to_position.shape[:2]
    panels = [("attention to position 0", report.to_position[:, :, 0])]
    if report.implicit_sink is not None:
        panels.append(("implicit sink mass", report.implicit_sink))
    size = (1.2 + 0.6 * n_head * len(panels), 1.5 + 0.45 * n_layer)
    with figure(path, ncols=len(panels), figsize=size, squeeze=False) as (fig, axes):
        for ax, (title, values) in zip(axes[0], panels, strict=True):
            image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            for (layer, head), value in np.ndenumerate(values):
                ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if value < 0.5 else "black")
            ax.set(title=title, xlabel="head", ylabel="layer")
            fig.colorbar(image, ax=ax)
        fig.suptitle(f"Sink_1^{report.eps:g} = {report.sink_rate(1):.3f}")


def _plot_maps(report: SinkReport, path: str) -> None:
    """Each layer's head-averaged attention map among the first positions, six per row."""
    n_layer = report.to_position.shape[0]
    columns = min(n_layer, 6)
    rows = -(-n_layer // columns)
    with figure(path, nrows=rows, ncols=columns, figsize=(2.6 * columns, 2.6 * rows + 0.3),
                squeeze=False) as (fig, axes):
        for index, ax in enumerate(axes.flat):
            if index >= n_layer:
                ax.axis("off")
                continue
            ax.imshow(report.attention_map[index].mean(0), cmap="viridis", vmin=0.0)
            ax.set(title=f"layer {index}", xlabel="key", ylabel="query")
        fig.suptitle("head-averaged attention among the first positions")


def _plot_classes(report: SinkReport, path: str) -> None:
    """A stacked bar per head: its attention's share per token class (and implicit sink)."""
    n_layer, n_head = report.to_position.shape[:2]
    labels = [f"L{layer}H{head}" for layer in range(n_layer) for head in range(n_head)]
    shares = report.class_share.reshape(n_layer * n_head, -1)
    names = list(TOKEN_CLASSES)
    if report.implicit_sink is not None:
        shares = np.concatenate([shares, report.implicit_sink.reshape(-1, 1)], axis=1)
        names.append("implicit_sink")
    with figure(path, figsize=(max(6.0, 0.3 * len(labels)), 3.5)) as (_, ax):
        bottom = np.zeros(len(labels))
        for column, name in enumerate(names):
            ax.bar(labels, shares[:, column], bottom=bottom, label=name)
            bottom += shares[:, column]
        ax.set(ylabel="share of attention", ylim=(0, 1),
               title="which tokens each head attends to")
        ax.tick_params(axis="x", labelrotation=90, labelsize=7)
        ax.legend(fontsize=7, ncols=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.25))
