"""What the two streaming evaluators share: the stream as the model reads it, which targets are
scored, the loss buffer and the recompute windows.

A stream is a document's text token ids plus the model's :class:`SinkPrefix`. An evaluator
puts the sink ids in front once (:func:`stream_ids`); query ``t`` of the result predicts token
``t + 1``, and the scored targets are the text tokens from the second one on (stream indices
``len(sinks) + 1 ..``), the same set for every variant and cache, so numbers compare.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklm.cli.main import UserError
from sinklm.data.sinks import SinkPrefix
from sinklm.models import CausalLM

from .cache import Recompute

# Told how many more tokens were scored (a progress bar's update).
Progress = Callable[[int], object]
# The prefix of a model trained without sink ids.
NO_SINKS = SinkPrefix(())


class StreamError(UserError, ValueError):
    """A stream the model cannot be evaluated on; the message says why."""


def no_progress(tokens: int) -> None:
    """A progress callback that shows nothing."""


def stream_ids(model: CausalLM, text: Tensor, sinks: SinkPrefix) -> Tensor:
    """The sink ids, then ``text`` (1-D), on the model's device: what the model reads."""
    if text.dim() != 1:
        raise StreamError(f"a stream is a 1-D tensor of token ids, got shape {tuple(text.shape)}")
    if len(text) < 2:
        raise StreamError(
            f"a stream needs at least two text tokens after its {len(sinks)} sink ids"
        )
    ids = sinks.prepend(text.to(next(model.parameters()).device))
    top = int(ids.max())
    if top >= model.config.vocab_size:
        raise StreamError(
            f"token id {top} is outside the model's {model.config.vocab_size}-row embedding: "
            "the tokenizer does not match the checkpoint"
        )
    return ids


def token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token negative log-likelihood in fp32 whatever the model dtype."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def loss_buffer(ids: Tensor, n_sink_ids: int) -> Tensor:
    """The per-token loss buffer of a stream, allocated once: many small tensors kept across
    chunks would pin the freed logits' memory (allocator fragmentation) and RSS would grow."""
    return torch.empty(len(ids) - n_sink_ids - 1, device=ids.device)


# --- sliding window with recomputation ---------------------------------------------------------


def check_recompute(policy: Recompute, sinks: SinkPrefix) -> None:
    if policy.window <= len(sinks):
        raise StreamError(
            f"cache {policy.label}: the window must hold the {len(sinks)} sink ids and a text token"
        )


def window_ids(ids: Tensor, end: int, window: int, sinks: SinkPrefix) -> Tensor:
    """The recompute window whose last token is ``end``: sink ids, then the most recent tokens."""
    if end < window:
        return ids[: end + 1]
    return sinks.prepend(ids[end - (window - len(sinks)) + 1 : end + 1])


def window_ends(n: int, policy: Recompute) -> list[int]:
    """Last token of each recompute window: every query for stride 1, else one per stride."""
    last = n - 2
    if policy.stride == 1:
        return list(range(last + 1))
    return [*range(min(policy.window - 1, last), last, policy.stride), last]


def scored_queries(end: int, previous_end: int, policy: Recompute) -> range:
    """Queries a window scores: its own last token (stride 1), else all since the last window."""
    return range(end, end + 1) if policy.stride == 1 else range(previous_end + 1, end + 1)
