"""The StreamingLLM start+recent cache (``x+y``) with position shift, for the model's forward.

A :class:`StartRecentCache` is a :class:`sinklm.models.model.Cache`: ``model.hidden_states(ids,
cache=cache)`` runs any number of next tokens of one stream through it, one token (generation)
or a long chunk (evaluation, a long prompt) at a time, with the same result per token as
feeding them one by one under the policy: the first x tokens and the y most recent stay, keys
before rotary, and positions are re-assigned at every step.

Why a chunk is exact. Under ``x+y`` with position shift, the query at stream index ``j`` sits
at position ``P_j = min(j, x + y)``; the first x tokens sit at positions 0..x-1 and each recent
token ``i`` (``max(x, j - y) <= i <= j``) at ``P_j - (j - i)``. Rotary scores depend only on the
position difference, so recent keys are seen at their *true* distance ``j - i`` (a band, i.e.
sliding-window attention over a chunk of queries) and initial keys at distance ``P_j - i``:
separate score columns with the query rotated to ``P_j`` (see :class:`ChunkGeometry`). Both
share one softmax row. A token's keys and values at every layer are computed once, when it is
the query, from what the cache held then; the cache keeps exactly those (x initial and y recent
per layer), so its memory is flat in the stream length.

One token at a time (generation) takes another layout, :class:`Ring`: re-rotating the y recent
keys at every token would cost more than the token's own projections, so there each recent key
is rotated once, at its stream index, and the query at its own; the score depends only on their
distance, as in the band. The keys before rotary are kept beside, for the next chunk.

A model with learned absolute positions embeds the token at stream index ``j`` at ``P_j`` too
(:meth:`StartRecentCache.query_positions`, the same in both layouts): the position it enters
the cache at, as the token-by-token reference gives it. Stream tokens 0..x+y-1 get rows
0..x+y-1 and every later token row x + y; a token's row stays in everything it leaves in the
cache, wherever positions are re-assigned later, so only the stream's true first tokens carry
row 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sinklm.models import CausalLM
from sinklm.models.attention import sink_softmax
from sinklm.models.model import Attention, LayerAttention, RotaryEmbedding

from .cache import StartRecent


@dataclass
class LayerCache:
    """One layer's keys (before rotary) and values [H, S, D]: the x initial and y recent."""

    initial_k: Tensor
    initial_v: Tensor
    recent_k: Tensor
    recent_v: Tensor


@dataclass
class Ring:
    """One layer's cache between one-token steps, in the slots of one attention row: a zero key
    and value (the sink's column, unused without a sink), the x initial keys, then y + 1 slots
    (the y recent and the query's own) that a token takes at ``(i - x) % (y + 1)``. The order
    of keys in a row does not matter to attention, so a token is written once and never moved.

    ``keys`` hold the recent keys rotated at their stream index and the initial ones rotated
    anew at each step to where the query sees them; ``unrotated`` the recent keys before
    rotary, so that the next chunk gets them back exactly. Three tensors of x + y + 2 slots at
    most: flat in the stream length, as the layers.
    """

    keys: Tensor  # [H, 1 + x + y + 1, D]
    values: Tensor  # [H, 1 + x + y + 1, D]
    unrotated: Tensor  # [H, y + 1, D]


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
class StartRecentCache:
    """The ``x+y`` cache of one stream: at most x + y tokens per layer, before rotary."""

    policy: StartRecent
    layers: list[LayerCache]
    next_index: int = 0  # stream index of the next token
    steady: ChunkGeometry | None = None  # the geometry of full-cache chunks, of the last size
    scratch: Tensor | None = None  # one head's score rows, reused (fresh ones cost page faults)
    rings: list[Ring] | None = None  # while one-token steps run: the layers' recent tokens

    @classmethod
    def empty(cls, model: CausalLM, policy: StartRecent) -> StartRecentCache:
        """An empty cache for ``model``'s layers, in its dtype and on its device."""
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

    def __len__(self) -> int:
        """Entries held per layer (initial + recent): never more than x + y."""
        layer = self.layers[0]
        if self.rings is not None:  # one slot of the ring is the oldest's, not held any more
            return layer.initial_k.shape[1] + min(self.policy.recent,
                                                  self.next_index - self.policy.start)
        return layer.initial_k.shape[1] + layer.recent_k.shape[1]

    def _geometry(self, rotary: RotaryEmbedding, index: int, size: int, sink_key: bool,
                  dtype: torch.dtype, device: torch.device) -> ChunkGeometry:
        """The geometry of the chunk at stream index ``index``, reused while the cache is full
        and the chunk size unchanged."""
        start = min(index, self.policy.size)
        steady = start == self.policy.size
        if steady and self.steady is not None and self.steady.size == size:
            return self.steady
        blocks = -(-size // self.query_block)
        geometry = ChunkGeometry.build(
            rotary, self.policy, start, size,
            block=-(-size // blocks),  # equal blocks: at most blocks - 1 padded queries
            sink_key=sink_key, dtype=dtype, device=device,
        )
        if steady:
            self.steady = geometry
        return geometry

    def _scratch(self, numel: int, like: Tensor) -> Tensor:
        """A flat buffer of at least ``numel`` elements of ``like``'s dtype and device."""
        if self.scratch is None or self.scratch.numel() < numel or self.scratch.dtype != like.dtype:
            self.scratch = like.new_empty(numel)
        return self.scratch[:numel]

    def query_positions(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """[1, T]: the next tokens' positions as queries, ``P_j = min(j, x + y)``."""
        _check_input(input_ids, position_ids, None)
        index = self.next_index
        positions = torch.arange(index, index + input_ids.shape[1], device=input_ids.device)
        return positions.clamp_(max=self.policy.size)[None]

    def step(self, rotary: RotaryEmbedding, input_ids: Tensor, position_ids: Tensor | None,
             dtype: torch.dtype, attentions: list[Tensor] | None) -> LayerAttention:
        """The next ``input_ids`` [1, T] of the stream: positions are the cache's to assign."""
        _check_input(input_ids, position_ids, attentions)
        index, size = self.next_index, input_ids.shape[1]
        if size == 1 and index >= self.policy.start:  # past the initial tokens: a ring step
            return self._ring_step(rotary, index, dtype, input_ids.device)
        if self.rings is not None:
            self._leave_rings()
        self.next_index += size
        geometry: list[ChunkGeometry] = []  # built by the first layer: it knows the variant

        def attend(layer: int, attention: Attention, x: Tensor) -> Tensor:
            if not geometry:
                geometry.append(self._geometry(rotary, index, size, attention.sink() is not None,
                                               x.dtype, x.device))
            return self._attention(attention, rotary, x[0], index, layer=self.layers[layer],
                                   geometry=geometry[0])[None]

        return attend

    def _ring_step(self, rotary: RotaryEmbedding, index: int, dtype: torch.dtype,
                   device: torch.device) -> LayerAttention:
        """The token at stream index ``index`` (>= x) through the rings, built if need be."""
        x, y = self.policy.start, self.policy.recent
        rings = self.rings or self._enter_rings(rotary, index, dtype, device)
        self.next_index += 1
        slot = 1 + x + (index - x) % (y + 1)
        held = 1 + x + min(index - x + 1, y + 1)  # slots in use: the row's length
        # The query and its key at ``index``; initial key p where the query, at P = min(index,
        # x + y), sees it: P - p before it, so at angle index - (P - p).
        shift = index - min(index, x + y)
        positions = torch.tensor([index, index, *range(shift, shift + x)], device=device)
        rope = _exact_rope(rotary, positions, dtype)

        def attend(layer: int, attention: Attention, x_in: Tensor) -> Tensor:
            return self._ring_attention(attention, rotary, x_in[0], rings[layer],
                                        self.layers[layer], rope, slot, held)[None]

        return attend

    def _ring_attention(
        self, attn: Attention, rotary: RotaryEmbedding, x_in: Tensor, ring: Ring,
        layer: LayerCache, rope: Rope, slot: int, held: int,
    ) -> Tensor:
        """Layer output [1, d] of one token: one row of scores over the ring's slots."""
        x = layer.initial_k.shape[1]
        q, k, v = attn.heads(x_in)  # [H, 1, D]
        rotated = rotary.rotate(torch.cat([q, k, layer.initial_k], dim=1), *rope)
        ring.keys[:, slot] = rotated[:, 1]
        ring.keys[:, 1 : 1 + x] = rotated[:, 2:]
        ring.unrotated[:, slot - 1 - x] = k[:, 0]
        ring.values[:, slot] = v[:, 0]
        sink = attn.sink()
        first = int(sink is None)  # without a sink, the row starts after the sink's column
        keys, values = ring.keys[:, first:held], ring.values[:, first:held]
        scores = self._scratch(keys.shape[0] * keys.shape[1], q).view(keys.shape[0], 1, -1)
        torch.bmm(rotated[:, :1], keys.transpose(1, 2), out=scores)
        row = scores.view(scores.shape[0], -1).mul_(1.0 / math.sqrt(attn.head_dim))
        probs = sink_softmax(row, sink, out=row)
        return attn.output(torch.bmm(probs[:, None], values), x_in)

    def _enter_rings(self, rotary: RotaryEmbedding, index: int, dtype: torch.dtype,
                     device: torch.device) -> list[Ring]:
        """Rings holding what the layers hold before stream index ``index``."""
        x, n = self.policy.start, self.policy.recent + 1
        held = min(self.layers[0].recent_k.shape[1], index - x)  # recent keys past the initial
        stream = torch.arange(index - held, index, device=device)
        slots = 1 + x + (stream - x) % n
        rope = _exact_rope(rotary, stream, dtype)
        self.rings = []
        for layer in self.layers:
            recent_k = layer.recent_k[:, layer.recent_k.shape[1] - held :]
            h, d = recent_k.shape[0], recent_k.shape[2]
            keys, values, unrotated = (recent_k.new_zeros(h, s, d) for s in (1 + x + n,) * 2 + (n,))
            keys[:, slots] = rotary.rotate(recent_k, *rope)
            values[:, slots] = layer.recent_v[:, layer.recent_v.shape[1] - held :]
            values[:, 1 : 1 + x] = layer.initial_v
            unrotated[:, slots - 1 - x] = recent_k
            layer.recent_k = layer.recent_v = keys.new_zeros(h, 0, d)  # the ring holds them
            self.rings.append(Ring(keys, values, unrotated))
        return self.rings

    def _leave_rings(self) -> None:
        """The layers back from the rings (the recent keys in stream order), for a chunk."""
        x, y = self.policy.start, self.policy.recent
        index = self.next_index
        stream = torch.arange(max(x, index - y), index, device=self.rings[0].keys.device)
        slots = (stream - x) % (y + 1)
        for layer, ring in zip(self.layers, self.rings, strict=True):
            layer.recent_k = ring.unrotated[:, slots]
            layer.recent_v = ring.values[:, 1 + x + slots]
        self.rings = None

    def _attention(
        self, attn: Attention, rotary: RotaryEmbedding, x_in: Tensor, a: int, *,
        layer: LayerCache, geometry: ChunkGeometry,
    ) -> Tensor:
        """Layer output [c, d] of the chunk ``x_in`` [c, d] starting at stream index ``a``."""
        x, y = self.policy.start, self.policy.recent
        c = x_in.shape[0]
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


def _check_input(input_ids: Tensor, position_ids: Tensor | None,
                 attentions: list[Tensor] | None) -> None:
    if input_ids.shape[0] != 1 or position_ids is not None or attentions is not None:
        raise ValueError("a start+recent cache takes one stream [1, T], assigns positions "
                         "itself and returns no attention probabilities")


def _exact_rope(rotary: RotaryEmbedding, positions: Tensor, dtype: torch.dtype) -> Rope:
    """cos and sin [T, r] at stream indices ``positions``, however large: the angles in float64
    (fp32 angles are ~4e-3 rad off at index 10^5), then ``dtype``."""
    cos, sin = rotary.cos_sin(positions[None], torch.float64)
    return cos[0, 0].to(dtype), sin[0, 0].to(dtype)


def _band(held: Tensor, new: Tensor, before: int, after: int) -> Tensor:
    """[H, before + held + new + after, D]: the held and new rows between zero rows, one copy."""
    h, n, d = held.shape[0], held.shape[1] + new.shape[1], held.shape[2]
    band = held.new_empty(h, before + n + after, d)
    band[:, :before] = 0.0
    band[:, before : before + held.shape[1]] = held
    band[:, before + held.shape[1] : before + n] = new
    band[:, before + n :] = 0.0
    return band


