"""Streaming perplexity under KV cache policies: every policy on every stream, timed.

The evaluators are ``reference.py`` (token by token, the definition) and ``fast.py`` (batched,
the same per-token losses); ``scoring.py`` says which targets count. A :class:`Stream`
(``texts.py``) carries its text and the model's sink prefix; the evaluator puts it in front.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from sinklm.models import CausalLM

from .cache import CachePolicy, Recompute, StartRecent, check_learned_positions
from .fast import DEFAULT_CHUNK, fast_losses
from .reference import reference_losses
from .texts import Stream


@dataclass
class CacheResult:
    """One cache policy's per-token losses over every stream, and how fast they came."""

    policy: CachePolicy
    losses: np.ndarray  # float32, the scored targets of all streams in order
    seconds: float
    notes: list[str] = field(default_factory=list)
    max_position: int | None = None  # the largest position any query reached

    @property
    def tokens(self) -> int:
        return int(self.losses.size)

    @property
    def nll(self) -> float:
        return float(self.losses.astype(np.float64).mean())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict[str, object]:
        policy = self.policy
        row: dict[str, object] = {
            "cache": policy.label,
            "start": policy.start if isinstance(policy, StartRecent) else None,
            "recent": policy.recent if isinstance(policy, StartRecent) else None,
            "ppl": self.ppl,
            "nll": self.nll,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "max_position": self.max_position,
        }
        if isinstance(policy, Recompute):
            row |= {"window": policy.window, "stride": policy.stride}
        if self.notes:
            row["notes"] = self.notes
        return row


def evaluate(
    model: CausalLM,
    streams: list[Stream],
    policies: list[CachePolicy],
    reference: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    on_result: Callable[[CacheResult], None] | None = None,
    progress: bool = False,
) -> list[CacheResult]:
    """Every policy on every stream; with ``progress``, a bar per cache on stderr with tokens/s
    when stderr is a terminal (a bar's redraws would run into the lines of a log file, where
    ``on_result`` gives a line per cache). A model with learned positions has every policy
    checked against its position table first, so a cache it cannot run is refused before any."""
    from tqdm import tqdm

    config = model.config
    if config.learned_positions and streams:
        check_learned_positions(policies, max(s.tokens for s in streams), config.max_seq_len)
    results = []
    scored = sum(stream.text_tokens - 1 for stream in streams)
    for policy in policies:
        start = time.perf_counter()
        with tqdm(total=scored, desc=f"cache {policy.label}", unit="tok", unit_scale=True,
                  disable=None if progress else True, leave=False, file=sys.stderr) as bar:
            parts = [
                reference_losses(model, s.text, policy, s.sinks, bar.update) if reference
                else fast_losses(model, s.text, policy, s.sinks, chunk_size, bar.update)
                for s in streams
            ]
        seconds = time.perf_counter() - start
        notes = []
        if isinstance(policy, StartRecent):
            short = [s.tokens for s in streams if s.tokens - 1 <= policy.size]
            if short:
                notes.append(
                    f"{len(short)} of {len(streams)} streams ({min(short)} tokens or fewer) never "
                    f"fill the {policy.size}-token cache: those losses equal dense"
                )
        result = CacheResult(policy, torch.cat(parts).numpy().astype(np.float32), seconds, notes,
                             max(policy.max_position(s.tokens) for s in streams))
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
