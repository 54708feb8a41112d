"""The fast streaming evaluator: the reference's per-token losses in batched steps.

``x+y`` feeds chunks of queries through a :class:`StartRecentCache` (exact by construction,
see ``start_recent.py``); ``dense`` feeds chunks with a growing ``KVCache``; ``recompute``
encodes many windows per batch. Every path runs the model's own forward
(``CausalLM.hidden_states``); the tests hold the losses to the reference's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinklm.data.sinks import SinkPrefix
from sinklm.models import CausalLM, KVCache

from .cache import CachePolicy, Recompute, StartRecent, check_learned_positions
from .scoring import (
    NO_SINKS,
    Progress,
    StreamError,
    check_recompute,
    loss_buffer,
    no_progress,
    scored_queries,
    stream_ids,
    token_losses,
    window_ends,
)
from .start_recent import StartRecentCache

# Queries per fast step; bigger amortises the per-step overhead (~1 ms of op dispatch on CPU),
# smaller bounds the score block. 2048 measured best on CPU (tiny-1m, 4+252; 1024: -3..8%).
DEFAULT_CHUNK = 2048
# Tokens per batch of recomputed windows (windows x window length).
RECOMPUTE_BATCH_TOKENS = 16384
# Rows per call of the vocab head: bounds the logits in memory (512 x 50304 floats = 100 MB).
HEAD_ROWS = 512


class VocabHead:
    """The model's logits and per-token losses of hidden states, ``HEAD_ROWS`` rows at a time.

    The same numbers as cross-entropy on the logits with less memory traffic, since the head is
    a large share of the fast path (the largest on small models): one logits buffer serves
    every block (a fresh one per block costs page faults), the log-softmax is taken in place
    and only the target column is read back.
    """

    def __init__(self, model: CausalLM, rows: int) -> None:
        self.model = model
        self.logits = torch.empty(min(rows, HEAD_ROWS), model.config.vocab_size,
                                  dtype=torch.float32, device=next(model.parameters()).device)

    @torch.inference_mode()
    def losses(self, hidden: Tensor, targets: Tensor, out: Tensor) -> None:
        """Losses of hidden states [R, d] against ``targets`` [R], written into ``out`` [R]."""
        for r in range(0, len(hidden), HEAD_ROWS):
            rows = hidden[r : r + HEAD_ROWS]
            logits = self.model.logits(rows, out=self.logits[: len(rows)])
            torch.log_softmax(logits, dim=-1, out=logits)
            torch.neg(logits.gather(1, targets[r : r + HEAD_ROWS, None])[:, 0],
                      out=out[r : r + HEAD_ROWS])


@torch.inference_mode()
def fast_losses(
    model: CausalLM,
    text: Tensor,
    policy: CachePolicy,
    sinks: SinkPrefix = NO_SINKS,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Progress | None = None,
) -> Tensor:
    """The same per-token losses as :func:`reference_losses`, in batched steps.

    ``x+y``: chunks of ``chunk_size`` queries through a :class:`StartRecentCache`. ``dense``:
    chunks through the model with a growing ``KVCache`` (true positions, as the reference).
    ``recompute``: many windows per batch, the first (shared prefix) window once. ``progress``
    is told how many tokens each step scored.
    """
    ids = stream_ids(model, text, sinks)
    if chunk_size < 1:
        raise StreamError(f"chunk_size={chunk_size}: must be >= 1")
    if model.config.learned_positions:
        check_learned_positions([policy], len(ids), model.config.max_seq_len)
    progress = progress or no_progress
    if isinstance(policy, Recompute):
        return _recompute_fast(model, ids, policy, sinks, progress)
    n, n_sink_ids = len(ids), len(sinks)
    cache: StartRecentCache | KVCache = (
        StartRecentCache.empty(model, policy) if isinstance(policy, StartRecent)
        else KVCache(model.config.n_layer)
    )
    head = VocabHead(model, chunk_size)
    losses = loss_buffer(ids, n_sink_ids)
    for a in range(0, n - 1, chunk_size):
        b = min(a + chunk_size, n - 1)
        first = max(a, n_sink_ids)  # the first scored query of this chunk, if first < b
        if isinstance(cache, StartRecentCache):
            hidden = model.hidden_states(ids[None, a:b], cache=cache)[0]
            if first < b:
                head.losses(hidden[first - a :], ids[first + 1 : b + 1],
                            losses[first - n_sink_ids : b - n_sink_ids])
        else:
            logits = model(ids[None, a:b], cache=cache)[0]
            if first < b:
                losses[first - n_sink_ids : b - n_sink_ids] = token_losses(
                    logits[first - a :], ids[first + 1 : b + 1]
                )
        progress(max(0, b - first))
    return losses.cpu()


@torch.inference_mode()
def _recompute_fast(model: CausalLM, ids: Tensor, policy: Recompute, sinks: SinkPrefix,
                    progress: Progress) -> Tensor:
    """Queries inside the first window share one causal pass; later windows go in batches."""
    check_recompute(policy, sinks)
    n, window, n_sink_ids = len(ids), policy.window, len(sinks)
    ends = window_ends(n, policy)
    first_end = min(window - 1, n - 2)
    hidden = model.hidden_states(ids[None, : first_end + 1])[0]
    losses = loss_buffer(ids, n_sink_ids)
    head = VocabHead(model, HEAD_ROWS)
    head.losses(hidden[n_sink_ids:], ids[n_sink_ids + 1 : first_end + 2],
                losses[: first_end + 1 - n_sink_ids])
    progress(first_end + 1 - n_sink_ids)
    later = [end for end in ends if end > first_end]
    per_batch = max(1, RECOMPUTE_BATCH_TOKENS // window)
    offsets = torch.arange(window - n_sink_ids, device=ids.device)
    previous = first_end
    for i in range(0, len(later), per_batch):
        batch_ends = torch.tensor(later[i : i + per_batch], device=ids.device)
        recent = batch_ends[:, None] - (window - n_sink_ids) + 1 + offsets[None]
        hidden = model.hidden_states(sinks.prepend(ids[recent]))
        start, rows = previous + 1, []  # this batch scores queries start..its last end
        for b, end in enumerate(batch_ends.tolist()):
            rows.append(hidden[b, window - len(scored_queries(end, previous, policy)) :])
            previous = end
        head.losses(torch.cat(rows), ids[start + 1 : previous + 2],
                    losses[start - n_sink_ids : previous + 1 - n_sink_ids])
        progress(previous + 1 - start)
    return losses.cpu()
