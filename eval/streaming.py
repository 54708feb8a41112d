"""Streaming perplexity under a KV cache policy: an exact token-by-token reference and a fast
batched evaluator that computes the same per-token losses.

A stream is a 1-D tensor of token ids: the model's sink ids, then the text. Query ``t`` predicts
token ``t + 1``; the scored targets are the text tokens from the second one on (stream indices
``n_sink_ids + 1 ..``), the same set for every variant and cache, so numbers compare.

Why the fast path is exact. Under ``x+y`` with position shift, the query at stream index ``j``
sits at position ``P_j = min(j, x + y)``; the first x tokens sit at positions 0..x-1 and each
recent token ``i`` (``max(x, j - y) <= i <= j``) at ``P_j - (j - i)``. Rotary scores depend only
on the position difference, so recent keys are seen at their *true* distance ``j - i`` (a band,
i.e. sliding-window attention over a chunk of queries) and initial keys at distance
``P_j - i``: separate score columns with the query rotated to ``P_j`` (see
:class:`ChunkGeometry`). Both share one softmax row. A token's keys and values
at every layer are computed once, when it is the query, from what the cache held then; the
fast path keeps exactly those (x initial and y recent per layer), so its memory is flat in the
stream length.

Both evaluators run under ``torch.inference_mode``: it dispatches each op more cheaply than
``no_grad``, which makes the reference (one token per model call) 15-20% faster on CPU.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sinklm.cli.main import UserError
from sinklm.data.sinks import SinkPrefix
from sinklm.models import CausalLM, KVCache
from sinklm.models.attention import sink_softmax
from sinklm.models.model import Attention, RotaryEmbedding

from .cache import CachePolicy, Recompute, StartRecent

# Told how many more tokens were scored (a progress bar's update).
Progress = Callable[[int], object]

# Queries per fast step; bigger amortises the per-step overhead (~1 ms of op dispatch on CPU),
# smaller bounds the score block. 2048 measured best on CPU (tiny-1m, 4+252; 1024: -3..8%).
DEFAULT_CHUNK = 2048
# Tokens per batch of recomputed windows (windows x window length).
RECOMPUTE_BATCH_TOKENS = 16384
# Rows per call of the vocab head: bounds the logits in memory (512 x 50304 floats = 100 MB).
HEAD_ROWS = 512


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device


def _token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token negative log-likelihood in fp32 whatever the model dtype."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


class VocabHead:
    """Final norm, vocab head and per-token losses of hidden states, ``HEAD_ROWS`` rows at a time.

    The same numbers as cross-entropy on the logits with less memory traffic, since the head is
    a large share of the fast path (the largest on small models): one logits buffer serves
    every block (a fresh one per block costs page faults), the log-softmax is taken in place
    and only the target column is read back.
    """

    def __init__(self, model: CausalLM, rows: int) -> None:
        self.norm = model.gpt_neox.final_layer_norm
        self.embed_out = model.embed_out
        weight = model.embed_out.weight
        self.logits = torch.empty(min(rows, HEAD_ROWS), weight.shape[0], dtype=torch.float32,
                                  device=weight.device)

    @torch.inference_mode()
    def losses(self, hidden: Tensor, targets: Tensor, out: Tensor) -> None:
        """Losses of hidden states [R, d] against ``targets`` [R], written into ``out`` [R]."""
        for r in range(0, len(hidden), HEAD_ROWS):
            normed = self.norm(hidden[r : r + HEAD_ROWS])
            logits = self.logits[: len(normed)]
            if normed.dtype == logits.dtype:
                torch.mm(normed, self.embed_out.weight.t(), out=logits)
            else:  # logits in the model's dtype, then fp32 as the reference
                logits.copy_(self.embed_out(normed))
            torch.log_softmax(logits, dim=-1, out=logits)
            torch.neg(logits.gather(1, targets[r : r + HEAD_ROWS, None])[:, 0],
                      out=out[r : r + HEAD_ROWS])


def _no_progress(tokens: int) -> None:
    """A progress callback that shows nothing."""


def _output(ids: Tensor, n_sink_ids: int) -> Tensor:
    """The per-token loss buffer of a stream, allocated once: many small tensors kept across
    chunks would pin the freed logits' memory (allocator fragmentation) and RSS would grow."""
    return torch.empty(len(ids) - n_sink_ids - 1, device=ids.device)


class StreamError(UserError, ValueError):
    """A stream the model cannot be evaluated on; the message says why."""


def _check_stream(model: CausalLM, ids: Tensor, n_sink_ids: int) -> None:
    if ids.dim() != 1:
        raise StreamError(f"a stream is a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    if len(ids) < n_sink_ids + 2:
        raise StreamError(
            f"a stream needs at least two text tokens after its {n_sink_ids} sink ids"
        )
    top = int(ids.max())
    if top >= model.config.vocab_size:
        raise StreamError(
            f"token id {top} is outside the model's {model.config.vocab_size}-row embedding: "
            "the tokenizer does not match the checkpoint"
        )


# --- reference ---------------------------------------------------------------------------------


@torch.inference_mode()
def reference_losses(model: CausalLM, ids: Tensor, policy: CachePolicy, n_sink_ids: int = 0,
                     progress: Progress | None = None) -> Tensor:
    """Per-token losses [len(ids) - n_sink_ids - 1], one model call per token: the definition.

    ``x+y`` and ``dense`` decode with the model's ``KVCache``: before each token the policy's
    evictions, then cached positions re-assigned to 0..len-1 (dense keeps true positions, which
    are the same numbers) and the token at the next position. ``recompute`` re-encodes each
    token's window from position 0. ``progress`` is told of each scored token.
    """
    _check_stream(model, ids, n_sink_ids)
    ids = ids.to(_device(model))
    progress = progress or _no_progress
    if isinstance(policy, Recompute):
        return _recompute_reference(model, ids, policy, n_sink_ids, progress)
    cache = KVCache(model.config.n_layer)
    losses = _output(ids, n_sink_ids)
    for t in range(len(ids) - 1):
        if isinstance(policy, StartRecent):
            index = policy.keep_index(len(cache))
            if index is not None:
                cache.keep(index.to(ids.device))
            cache.positions = torch.arange(len(cache), device=ids.device).unsqueeze(0)
        position = torch.tensor([[len(cache)]], device=ids.device)
        logits = model(ids[t : t + 1].unsqueeze(0), position_ids=position, cache=cache)
        if t >= n_sink_ids:
            losses[t - n_sink_ids] = _token_losses(logits[0, -1:], ids[t + 1 : t + 2])[0]
            progress(1)
    return losses.cpu()


def _stream_sinks(ids: Tensor, n_sink_ids: int) -> SinkPrefix:
    """The sink ids a stream starts with, to lead each of its recompute windows."""
    return SinkPrefix(ids[:n_sink_ids].tolist())


def _window_ids(ids: Tensor, end: int, window: int, sinks: SinkPrefix) -> Tensor:
    """The recompute window whose last token is ``end``: sink ids, then the most recent tokens."""
    if end < window:
        return ids[: end + 1]
    return sinks.prepend(ids[end - (window - len(sinks)) + 1 : end + 1])


def _window_ends(n: int, policy: Recompute) -> list[int]:
    """Last token of each recompute window: every query for stride 1, else one per stride."""
    last = n - 2
    if policy.stride == 1:
        return list(range(last + 1))
    return [*range(min(policy.window - 1, last), last, policy.stride), last]


def _scored_queries(end: int, previous_end: int, policy: Recompute) -> range:
    """Queries a window scores: its own last token (stride 1), else all since the last window."""
    return range(end, end + 1) if policy.stride == 1 else range(previous_end + 1, end + 1)


def _recompute_check(policy: Recompute, n_sink_ids: int) -> None:
    if policy.window <= n_sink_ids:
        raise StreamError(
            f"cache {policy.label}: the window must hold the {n_sink_ids} sink ids and a text token"
        )


@torch.inference_mode()
def _recompute_reference(model: CausalLM, ids: Tensor, policy: Recompute, n_sink_ids: int,
                         progress: Progress) -> Tensor:
    _recompute_check(policy, n_sink_ids)
    losses = _output(ids, n_sink_ids)
    sinks = _stream_sinks(ids, n_sink_ids)
    previous = -1
    for end in _window_ends(len(ids), policy):
        if end < n_sink_ids:  # stride 1 only: a query on a sink id predicts nothing scored
            continue
        window = _window_ids(ids, end, policy.window, sinks)
        logits = model(window.unsqueeze(0))[0]
        for t in _scored_queries(end, previous, policy):
            if t >= n_sink_ids:
                row = len(window) - 1 - (end - t)
                losses[t - n_sink_ids] = _token_losses(logits[row : row + 1], ids[t + 1 : t + 2])[0]
                progress(1)
        previous = end
    return losses.cpu()


# --- fast --------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's keys (before rotary) and values [H, S, D]: the x initial and y recent."""

    initial_k: Tensor
    initial_v: Tensor
    recent_k: Tensor
    recent_v: Tensor


Rope = tuple[Tensor, Tensor]


@dataclass
class ChunkGeometry:
    """Rotary tables and the mask of one chunk of queries, shared by every layer.

    The chunk's queries go in ``blocks`` blocks of ``block`` (the last padded). A query's score
    row holds the prefix (the implicit sink, if any, then the initial keys the stream has
    reached), then its block's window of ``y + block`` band keys: the padded band is the y keys
    before the chunk, then the chunk's own, and window ``i`` starts at ``i * block``, so the
    windows are overlapping views of one band tensor, never copied. Band keys sit at local
    positions 0.. and the queries at y.., so angles stay small whatever the stream index;
    for the prefix the query is rotated to ``P_j`` instead.

    Everything here depends on the chunk's start only through ``min(start, x + y)``: once the
    cache is full, every chunk of a given size has the same geometry (built once).
    """

    size: int  # queries in the chunk
    band: Rope  # [1, prefix + y + blocks * block, r] at local positions -prefix..
    query: Rope  # the chunk's queries at local positions y..
    initial: Rope  # initial keys at 0..x-1 (those the stream has reached)
    initial_query: Rope  # each query at P_j = min(j, x + y)
    block: int
    blocks: int
    bias: Tensor  # [blocks, block, prefix + y + block]: 0 where a query sees a key, else -inf

    @classmethod
    def build(
        cls, rotary: RotaryEmbedding, policy: StartRecent, start: int, size: int, block: int,
        sink_key: bool, dtype: torch.dtype, device: torch.device,
    ) -> ChunkGeometry:
        x, y = policy.start, policy.recent
        blocks = -(-size // block)
        padded = blocks * block
        query = torch.arange(start, start + padded, device=device).view(blocks, block, 1)
        initial = torch.arange(min(x, start + size), device=device)  # those seen so far
        prefix = sink_key + len(initial)
        local = torch.arange(-prefix, y + padded, device=device)  # the keys' zero rows first
        cos, sin = (table[0] for table in rotary.cos_sin(local[None], dtype))  # [1, n, r]
        position_q = torch.clamp(query.reshape(1, -1), max=x + y)[:, :size]
        window = torch.arange(y + block, device=device)
        # Stream index of band key w in block i's window; the padded band starts at start - y.
        key = (start - y) + torch.arange(blocks, device=device).view(blocks, 1, 1) * block + window
        band = (key <= query) & (key >= torch.clamp(query - y, min=x))
        mask = torch.cat([(initial <= query).expand(blocks, block, len(initial)), band], dim=-1)
        if sink_key:
            mask = torch.cat([mask.new_ones(blocks, block, 1), mask], dim=-1)
        cos_i, sin_i = rotary.cos_sin(initial[None], dtype)
        cos_q, sin_q = rotary.cos_sin(position_q, dtype)
        return cls(
            size=size,
            band=(cos, sin),
            query=(cos[:, prefix + y : prefix + y + size], sin[:, prefix + y : prefix + y + size]),
            initial=(cos_i[0], sin_i[0]),
            initial_query=(cos_q[0], sin_q[0]),
            block=block,
            blocks=blocks,
            # An additive mask: adding it is many times faster than a broadcast masked_fill.
            bias=torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
                ~mask, float("-inf")
            ),
        )


@dataclass
class StartRecentState:
    """What the fast ``x+y`` evaluator carries between chunks: at most x + y tokens per layer."""

    policy: StartRecent
    layers: list[LayerCache]
    next_index: int = 0  # stream index of the next token to feed
    steady: ChunkGeometry | None = None  # the geometry of full-cache chunks, of the last size
    scratch: Tensor | None = None  # one head's score rows, reused (fresh ones cost page faults)

    @classmethod
    def empty(cls, model: CausalLM, policy: StartRecent) -> StartRecentState:
        config = model.config
        param = next(model.parameters())
        blank = param.new_zeros(config.n_head, 0, config.head_dim)
        return cls(policy, [LayerCache(blank, blank, blank, blank) for _ in range(config.n_layer)])

    @property
    def query_block(self) -> int:
        """Queries per block: a window holds y + block keys for at most y + 1 needed, so small
        blocks waste less, but each block is one small matmul. 32 measured best for y = 252 on
        CPU (24..64 within a few percent); y // 8 keeps the waste at 1.125x for big caches."""
        return max(32, self.policy.recent // 8)

    def cached_tokens(self) -> list[int]:
        """Entries held per layer (initial + recent); never more than x + y."""
        return [c.initial_k.shape[1] + c.recent_k.shape[1] for c in self.layers]

    def _geometry(self, model: CausalLM, size: int, dtype: torch.dtype,
                  device: torch.device) -> ChunkGeometry:
        """The chunk's geometry, reused while the cache is full and the chunk size unchanged."""
        start = min(self.next_index, self.policy.size)
        steady = start == self.policy.size
        if steady and self.steady is not None and self.steady.size == size:
            return self.steady
        decoder = model.gpt_neox
        blocks = -(-size // self.query_block)
        geometry = ChunkGeometry.build(
            decoder.rotary, self.policy, start, size,
            block=-(-size // blocks),  # equal blocks: at most blocks - 1 padded queries
            sink_key=decoder.layers[0].attention.sink() is not None, dtype=dtype, device=device,
        )
        if steady:
            self.steady = geometry
        return geometry

    def _scratch(self, numel: int, like: Tensor) -> Tensor:
        """A flat buffer of at least ``numel`` elements of ``like``'s dtype and device."""
        if self.scratch is None or self.scratch.numel() < numel or self.scratch.dtype != like.dtype:
            self.scratch = like.new_empty(numel)
        return self.scratch[:numel]

    @torch.inference_mode()
    def feed(self, model: CausalLM, ids: Tensor) -> Tensor:
        """Hidden states (before the final norm) [len(ids), d] of the next ``len(ids)`` tokens."""
        decoder = model.gpt_neox
        hidden = decoder.embed_in(ids)
        geometry = self._geometry(model, len(ids), hidden.dtype, ids.device)
        for block, layer in zip(decoder.layers, self.layers, strict=True):
            hidden = block.residual(hidden, functools.partial(
                self._attention, block.attention, decoder.rotary, layer=layer, geometry=geometry
            ))
        self.next_index += len(ids)
        return hidden

    def _attention(
        self, attn: Attention, rotary: RotaryEmbedding, x_in: Tensor, *, layer: LayerCache,
        geometry: ChunkGeometry,
    ) -> Tensor:
        x, y = self.policy.start, self.policy.recent
        a, c = self.next_index, x_in.shape[0]
        h, d, r = attn.n_head, attn.head_dim, rotary.rotary_dims
        blocks, block = geometry.blocks, geometry.block
        padded, window = blocks * block, y + block
        q, k, v = attn.heads(x_in)
        if a < x:  # this chunk holds some of the first x tokens: kept for good
            take = min(x - a, c)
            layer.initial_k = torch.cat([layer.initial_k, k[:, :take]], dim=1)
            layer.initial_v = torch.cat([layer.initial_v, v[:, :take]], dim=1)
        sink = attn.sink()
        first = int(sink is not None)  # the first initial key's column
        prefix = first + layer.initial_k.shape[1]

        # The band: y slots before the chunk (the first ones empty until y tokens have passed),
        # then the chunk, then padding to whole blocks; the mask hides the empty slots. Keys get
        # `prefix` more zero rows in front: window i of the keys is then
        # keys[i * block : i * block + prefix + window], a strided view, and one bmm per head
        # fills that head's contiguous scores (MKL's batched path); the first `prefix` columns,
        # scored against zero keys, are overwritten with the prefix's scores. Each buffer is
        # written once and rotated in place (rotary touches only the first r dims).
        held = layer.recent_k.shape[1]
        keys = _band(layer.recent_k, k, prefix + y - held, padded - c)
        keys[..., :r] = rotary.rotate(keys[..., :r], *geometry.band)
        values = _band(layer.recent_v, v, y - held, padded - c)
        if c >= y:  # the new recent keys (before rotary) and values: views, no copy
            layer.recent_k, layer.recent_v = k[:, c - y :], v[:, c - y :]
        else:
            layer.recent_k = torch.cat([layer.recent_k, k], dim=1)[:, -y:]
            layer.recent_v = torch.cat([layer.recent_v, v], dim=1)[:, -y:]
        scale = 1.0 / math.sqrt(d)
        query = q.new_empty(h, padded, d)
        torch.mul(q, scale, out=query[:, :c])
        query[:, c:] = 0.0  # padded queries: finite, and dropped below
        query[:, :c, :r] = rotary.rotate(query[:, :c, :r], *geometry.query)
        if prefix > first:  # for the initial keys: the query rotated to P_j
            initial_k = layer.initial_k
            initial_query = rotary.rotate(q[..., :r] * scale, *geometry.initial_query)
            initial_rotated = rotary.rotate(initial_k[..., :r], *geometry.initial)

        # One head at a time, so that its score rows [blocks, block, prefix + window] stay in
        # cache from the scores through the softmax to the values; the buffer is reused by
        # every head, layer and chunk. A row holds the prefix columns (the implicit sink's slot
        # if any, which sink_softmax fills, then the initial keys seen so far), then the
        # block's window of the band.
        scores = self._scratch(blocks * block * (prefix + window), q).view(blocks, block, -1)
        rows = scores.view(padded, -1)
        key_windows = keys.unfold(1, prefix + window, block)  # [h, blocks, d, prefix + window]
        value_windows = values.unfold(1, window, block).transpose(-1, -2)  # [h, blocks, window, d]
        out = q.new_empty(h, blocks, block, d)
        for head in range(h):
            torch.bmm(query[head].view(blocks, block, d), key_windows[head], out=scores)
            if prefix > first:  # rotated dims against P_j, the others as the band query's
                initial = rows[:c, first:prefix]
                torch.mm(initial_query[head], initial_rotated[head].t(), out=initial)
                initial.addmm_(query[head, :c, r:], initial_k[head, :, r:].t())
                rows[c:, first:prefix] = 0.0  # padded queries: finite, and dropped below
            scores += geometry.bias
            probs = sink_softmax(scores, None if sink is None else sink[head], out=scores)
            torch.bmm(probs[..., prefix:], value_windows[head], out=out[head])
            if prefix > first:
                out[head].view(padded, d).addmm_(probs.view(padded, -1)[:, first:prefix],
                                                 layer.initial_v[head])
        return attn.output(out.view(h, padded, d)[:, :c], x_in)


def _band(held: Tensor, new: Tensor, before: int, after: int) -> Tensor:
    """[H, before + held + new + after, D]: the held and new rows between zero rows, one copy."""
    h, n, d = held.shape[0], held.shape[1] + new.shape[1], held.shape[2]
    band = held.new_empty(h, before + n + after, d)
    band[:, :before] = 0.0
    band[:, before : before + held.shape[1]] = held
    band[:, before + held.shape[1] : before + n] = new
    band[:, before + n :] = 0.0
    return band


@torch.inference_mode()
def fast_losses(
    model: CausalLM,
    ids: Tensor,
    policy: CachePolicy,
    n_sink_ids: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Progress | None = None,
) -> Tensor:
    """The same per-token losses as :func:`reference_losses`, in batched steps.

    ``x+y``: chunks of ``chunk_size`` queries through :class:`StartRecentState`. ``dense``: chunks
    through the model with a growing ``KVCache`` (true positions, as the reference). ``recompute``:
    many windows per batch, the first (shared prefix) window once. ``progress`` is told how
    many tokens each step scored.
    """
    _check_stream(model, ids, n_sink_ids)
    if chunk_size < 1:
        raise StreamError(f"chunk_size={chunk_size}: must be >= 1")
    ids = ids.to(_device(model))
    progress = progress or _no_progress
    if isinstance(policy, Recompute):
        return _recompute_fast(model, ids, policy, n_sink_ids, progress)
    n = len(ids)
    state = StartRecentState.empty(model, policy) if isinstance(policy, StartRecent) else None
    head = VocabHead(model, chunk_size)
    cache = KVCache(model.config.n_layer)
    losses = _output(ids, n_sink_ids)
    for a in range(0, n - 1, chunk_size):
        b = min(a + chunk_size, n - 1)
        first = max(a, n_sink_ids)  # the first scored query of this chunk, if first < b
        if state is not None:
            hidden = state.feed(model, ids[a:b])
            if first < b:
                head.losses(hidden[first - a :], ids[first + 1 : b + 1],
                            losses[first - n_sink_ids : b - n_sink_ids])
        else:
            logits = model(ids[a:b].unsqueeze(0), cache=cache)[0]
            if first < b:
                losses[first - n_sink_ids : b - n_sink_ids] = _token_losses(
                    logits[first - a :], ids[first + 1 : b + 1]
                )
        progress(max(0, b - first))
    return losses.cpu()


@torch.inference_mode()
def _hidden(model: CausalLM, batch: Tensor) -> Tensor:
    """Hidden states [B, T, d] of windows encoded from position 0, without the vocab head."""
    decoder = model.gpt_neox
    x = decoder.embed_in(batch)
    positions = torch.arange(batch.shape[1], device=batch.device).expand_as(batch)
    rope = decoder.rotary.cos_sin(positions, x.dtype)
    for block in decoder.layers:
        x, _, _ = block(x, decoder.rotary, rope, rope, None, False)
    return x


@torch.inference_mode()
def _recompute_fast(model: CausalLM, ids: Tensor, policy: Recompute, n_sink_ids: int,
                    progress: Progress) -> Tensor:
    """Queries inside the first window share one causal pass; later windows go in batches."""
    _recompute_check(policy, n_sink_ids)
    n, window = len(ids), policy.window
    ends = _window_ends(n, policy)
    first_end = min(window - 1, n - 2)
    hidden = _hidden(model, ids[: first_end + 1].unsqueeze(0))[0]
    losses = _output(ids, n_sink_ids)
    head = VocabHead(model, HEAD_ROWS)
    head.losses(hidden[n_sink_ids:], ids[n_sink_ids + 1 : first_end + 2],
                losses[: first_end + 1 - n_sink_ids])
    progress(first_end + 1 - n_sink_ids)
    later = [end for end in ends if end > first_end]
    per_batch = max(1, RECOMPUTE_BATCH_TOKENS // window)
    offsets = torch.arange(window - n_sink_ids, device=ids.device)
    sinks = _stream_sinks(ids, n_sink_ids)
    previous = first_end
    for i in range(0, len(later), per_batch):
        batch_ends = torch.tensor(later[i : i + per_batch], device=ids.device)
        recent = batch_ends[:, None] - (window - n_sink_ids) + 1 + offsets[None]
        hidden = _hidden(model, sinks.prepend(ids[recent]))
        start, rows = previous + 1, []  # this batch scores queries start..its last end
        for b, end in enumerate(batch_ends.tolist()):
            rows.append(hidden[b, window - len(_scored_queries(end, previous, policy)) :])
            previous = end
        head.losses(torch.cat(rows), ids[start + 1 : previous + 2],
                    losses[start - n_sink_ids : previous + 1 - n_sink_ids])
        progress(previous + 1 - start)
    return losses.cpu()


# --- driving several caches over several streams -----------------------------------------------


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
    streams: list[Tensor],
    policies: list[CachePolicy],
    n_sink_ids: int = 0,
    reference: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    on_result: Callable[[CacheResult], None] | None = None,
    progress: bool = False,
) -> list[CacheResult]:
    """Every policy on every stream (each stream starts with ``n_sink_ids`` sink ids); with
    ``progress``, a bar per cache on stderr with tokens/s."""
    from tqdm import tqdm

    results = []
    scored = sum(len(ids) - n_sink_ids - 1 for ids in streams)
    for policy in policies:
        start = time.perf_counter()
        with tqdm(total=scored, desc=f"cache {policy.label}", unit="tok", unit_scale=True,
                  disable=not progress, leave=False, file=sys.stderr) as bar:
            parts = [
                reference_losses(model, ids, policy, n_sink_ids, bar.update) if reference
                else fast_losses(model, ids, policy, n_sink_ids, chunk_size, bar.update)
                for ids in streams
            ]
        seconds = time.perf_counter() - start
        notes = []
        if isinstance(policy, StartRecent):
            short = [len(ids) for ids in streams if len(ids) - 1 <= policy.size]
            if short:
                notes.append(
                    f"{len(short)} of {len(streams)} streams ({min(short)} tokens or fewer) never "
                    f"fill the {policy.size}-token cache: those losses equal dense"
                )
        result = CacheResult(policy, torch.cat(parts).numpy().astype(np.float32), seconds, notes,
                             max(policy.max_position(len(ids)) for ids in streams))
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
