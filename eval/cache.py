"""KV cache policies for streaming evaluation, as small immutable objects.

A policy says which earlier tokens the query at stream index ``t`` sees, and at which positions;
the evaluators (``streaming.py``) implement it. Notation as StreamingLLM's:

- ``x+y`` (:class:`StartRecent`): keep the first x tokens of the stream and the y most recent.
  Keys are cached before rotary and re-positioned on every step: cached tokens sit at
  0..x+y-1 in cache order and the query at the next position, so once the cache is full the
  query at position x+y attends to x+y cached tokens plus itself. ``0+y`` is window attention.
- ``dense`` (:class:`Dense`): keep everything at true positions.
- ``recompute:L[:S]`` (:class:`Recompute`): sliding window with recomputation. Each token is
  re-encoded from position 0 with the L-1 tokens before it (a window of L tokens; for a
  sink-token model each window starts with the k sink ids, then the L - k most recent tokens)
  and its last position predicts the next token. ``S`` (stride, default 1) is the usual faster
  approximation: one window every S tokens scores its last S queries, so a query's context is
  between L-S and L-1 tokens.

torch is imported only where a tensor is built, so a command checks its ``--cache`` at once,
before loading torch and the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sinklm.cli.main import UserError
from sinklm.models.config import PositionError

if TYPE_CHECKING:
    from torch import Tensor

SPEC_HELP = "X+Y with integers X, Y >= 0 (e.g. 4+1020), 'dense', or 'recompute:L[:S]'"


class CacheSpecError(UserError, ValueError):
    """A cache spec string is malformed; the message quotes it and shows the accepted forms."""


class CachePositionError(CacheSpecError, PositionError):
    """A cache's queries reach positions a model with ``learned_positions`` cannot embed."""


@dataclass(frozen=True)
class StartRecent:
    """Keep the ``start`` first tokens and the ``recent`` most recent ones (``x+y``)."""

    start: int
    recent: int

    @property
    def label(self) -> str:
        return f"{self.start}+{self.recent}"

    @property
    def size(self) -> int:
        return self.start + self.recent

    def max_position(self, stream_len: int) -> int:
        """The largest position a query reaches on a stream of ``stream_len`` tokens."""
        return min(self.size, stream_len - 1)

    def keep_index(self, cache_len: int) -> Tensor | None:
        """Indices of the cache entries to keep before the next token, or None to keep all."""
        if cache_len <= self.size:
            return None
        import torch  # here, not at import: cache specs are checked before torch loads

        first = torch.arange(self.start)
        return torch.cat([first, torch.arange(cache_len - self.recent, cache_len)])


@dataclass(frozen=True)
class Dense:
    """Keep every token at its true position: the full-attention baseline."""

    @property
    def label(self) -> str:
        return "dense"

    def max_position(self, stream_len: int) -> int:
        return stream_len - 1


@dataclass(frozen=True)
class Recompute:
    """Sliding window of ``window`` tokens re-encoded from position 0 for every ``stride``."""

    window: int
    stride: int = 1

    @property
    def label(self) -> str:
        return f"recompute:{self.window}" + (f":{self.stride}" if self.stride != 1 else "")

    def max_position(self, stream_len: int) -> int:
        return min(self.window, stream_len) - 1


CachePolicy = StartRecent | Dense | Recompute

_START_RECENT = re.compile(r"(-?\d+)\+(-?\d+)")
_RECOMPUTE = re.compile(r"recompute:(-?\d+)(?::(-?\d+))?")


def parse_cache(spec: str) -> CachePolicy:
    """One policy from its spec string."""
    text = spec.strip()
    if text == "dense":
        return Dense()
    if match := _START_RECENT.fullmatch(text):
        start, recent = int(match[1]), int(match[2])
        if start < 0 or recent < 0:
            raise CacheSpecError(f"cache {spec!r}: sizes must be >= 0 (expected {SPEC_HELP})")
        if start + recent == 0:
            raise CacheSpecError(f"cache {spec!r} keeps no token: X+Y must be at least 1")
        return StartRecent(start, recent)
    if match := _RECOMPUTE.fullmatch(text):
        window = int(match[1])
        stride = int(match[2]) if match[2] is not None else 1
        if window < 2:
            raise CacheSpecError(f"cache {spec!r}: the window must be at least 2 tokens")
        if not 1 <= stride < window:
            raise CacheSpecError(f"cache {spec!r}: the stride must lie in 1..{window - 1}")
        return Recompute(window, stride)
    raise CacheSpecError(f"cache {spec!r}: expected {SPEC_HELP}")


def parse_caches(specs: str) -> list[CachePolicy]:
    """Comma-separated specs (``0+1024,1+1023,dense``), in order, duplicates refused."""
    parts = [part for part in specs.split(",") if part.strip()]
    if not parts:
        raise CacheSpecError(f"cache list {specs!r} is empty: expected {SPEC_HELP}")
    policies = [parse_cache(part) for part in parts]
    labels = [policy.label for policy in policies]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise CacheSpecError(f"cache list {specs!r} repeats {', '.join(duplicates)}")
    return policies


def paper_caches(size: int) -> list[CachePolicy]:
    """StreamingLLM's Table 3 grid for a cache of S: 0+S, 1+(S-1), 2+(S-2), 4+(S-4), dense."""
    return [StartRecent(x, size - x) for x in (0, 1, 2, 4) if size > 0 and x <= size] + [Dense()]


def check_learned_positions(policies: list[CachePolicy], longest: int, max_seq_len: int) -> None:
    """Refuse, for a model with learned absolute positions (a table of ``max_seq_len`` rows), a
    cache whose queries reach a position past the table on a stream of ``longest`` tokens (its
    last token is no query: it predicts nothing)."""
    for policy in policies:
        top = policy.max_position(longest - 1)
        if top < max_seq_len:
            continue
        if isinstance(policy, StartRecent):
            fix = f"use caches of at most {max_seq_len - 1} tokens (x+y <= {max_seq_len - 1})"
        elif isinstance(policy, Recompute):
            fix = f"use a recompute window of at most {max_seq_len} tokens"
        else:
            fix = (f"use x+y caches of at most {max_seq_len - 1} tokens and no dense, or streams "
                   f"of at most {max_seq_len + 1} tokens")
        raise CachePositionError(
            f"cache {policy.label}: queries reach position {top}, but learned_positions embeds "
            f"only positions 0..{max_seq_len - 1}; {fix}"
        )


def check_policies(
    policies: list[CachePolicy], longest: int, max_seq_len: int, n_sink_ids: int, *,
    learned_positions: bool = False,
) -> list[str]:
    """Refuse a recompute window that cannot hold the sink ids and, with ``learned_positions``
    (the model's config), queries past its position table (:func:`check_learned_positions`);
    return warnings for caches whose queries reach positions the model was not trained on."""
    if learned_positions:
        check_learned_positions(policies, longest, max_seq_len)
    warnings = []
    for policy in policies:
        if isinstance(policy, Recompute) and policy.window <= n_sink_ids:
            raise CacheSpecError(
                f"cache {policy.label}: the window must be longer than the {n_sink_ids} sink ids"
            )
        top = policy.max_position(longest)
        if top >= max_seq_len:
            warnings.append(
                f"cache {policy.label}: queries reach position {top}, past the {max_seq_len} "
                f"positions (0..{max_seq_len - 1}) the model was trained on"
            )
    return warnings
