"""The Pythia-style (GPT-NeoX) decoder, in one readable file.

Weight names and the fused QKV layout are those of transformers' ``GPTNeoXForCausalLM``
(``gpt_neox.layers.{i}.attention.query_key_value`` holds, per head, [q_h, k_h, v_h]), so
state dicts move between the two without renaming. Parameters the GPT-NeoX architecture has
no slot for (``attention.sink_logit``, ``attention.gate``) exist only in those variants, and
``gpt_neox.embed_positions`` (learned absolute positions, a research option) only with
``learned_positions``.

The model holds no cache policy: ``hidden_states`` runs the one block loop and takes explicit
positions and an optional :class:`Cache`, which decides what earlier tokens each layer's
attention sees. Keys are cached before rotary, so a cache (``KVCache`` here, the streaming
start+recent cache in ``sinklm.eval``) may evict entries and re-assign positions. A model with
``learned_positions`` adds to each token's embedding the row of the position it is given as it
enters (the position rotary gives it as a query, :meth:`Cache.query_positions`): that row stays
baked into everything the token leaves in a cache, wherever the cache later moves it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import FUSED_KERNELS, check_backend_available, eager_attention
from .config import ModelConfig, check_embeddable


def resolve_positions(position_ids: Tensor | None, first: int, input_ids: Tensor) -> Tensor:
    """Positions [B, T] of ``input_ids``: ``position_ids`` broadcast, else first, first + 1..."""
    b, t = input_ids.shape
    if position_ids is None:
        return torch.arange(first, first + t, device=input_ids.device).expand(b, t)
    return position_ids.expand(b, t)


class LayerAttention(Protocol):
    """One forward's attention of layer ``layer``: its module and its input (after ln1) give
    its output. A cache's :meth:`Cache.step` returns one; the model calls it for each block."""

    def __call__(self, layer: int, attention: Attention, x: Tensor) -> Tensor: ...


class Cache(Protocol):
    """What earlier tokens a forward's tokens see, and at which positions.

    :meth:`CausalLM.hidden_states` asks it once per forward for the attention of every layer,
    and runs the block loop itself: a cache decides what is kept and where it sits (keys are
    stored before rotary, so a cache may re-assign positions), never how a block is built.
    :class:`KVCache` keeps everything it is given; the streaming caches of ``sinklm.eval``
    keep a start and a recent window.
    """

    def query_positions(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """The positions [B, T] that the next :meth:`step` with these arguments gives the new
        tokens as queries, without changing the cache. A model with learned absolute positions
        asks before the embedding (and before ``step``); others never call it."""
        ...

    def step(self, rotary: RotaryEmbedding, input_ids: Tensor, position_ids: Tensor | None,
             dtype: torch.dtype, attentions: list[Tensor] | None) -> LayerAttention: ...


class KVCache:
    """Per-layer keys (before rotary) and values, [B, H, S, D], and the position of each key.

    ``positions`` ([B, S]) is what each cached key is rotated to on the next forward; a caller
    may overwrite it (StreamingLLM's position shift) or drop entries with ``keep``.
    """

    def __init__(self, n_layer: int) -> None:
        self.keys: list[Tensor | None] = [None] * n_layer
        self.values: list[Tensor | None] = [None] * n_layer
        self.positions: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def keep(self, index: Tensor) -> None:
        """Keep only the cache entries at ``index`` (1-D, over the S axis), in that order."""
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None and v is not None:
                self.keys[layer] = k.index_select(2, index)
                self.values[layer] = v.index_select(2, index)
        if self.positions is not None:
            self.positions = self.positions.index_select(1, index)

    def query_positions(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """``position_ids``, else the positions after the cached ones."""
        return resolve_positions(position_ids, len(self), input_ids)

    def step(self, rotary: RotaryEmbedding, input_ids: Tensor, position_ids: Tensor | None,
             dtype: torch.dtype, attentions: list[Tensor] | None) -> LayerAttention:
        """The new tokens at ``position_ids`` (default: after the cache) see every cached key at
        its stored position; their keys and values are appended."""
        b = input_ids.shape[0]
        positions = self.query_positions(input_ids, position_ids)
        rope_q = rope_k = rotary.cos_sin(positions, dtype)
        if self.positions is not None:
            positions = torch.cat([self.positions.expand(b, -1), positions], dim=1)
            rope_k = rotary.cos_sin(positions, dtype)
        self.positions = positions

        def attend(layer: int, attention: Attention, x: Tensor) -> Tensor:
            k, v = self.keys[layer], self.values[layer]
            past = None if k is None or v is None else (k, v)
            out, new_past, probs = attention(x, rotary, rope_q, rope_k, past,
                                             attentions is not None, use_cache=True)
            self.keys[layer], self.values[layer] = new_past
            if attentions is not None:
                attentions.append(probs)
            return out

        return attend


class RotaryEmbedding(nn.Module):
    """GPT-NeoX rotate-half rotary on the first ``rotary_dims`` dims of each head.

    Holds no buffer: the frequencies are kept in fp32 per device outside the module's state,
    so ``model.to(torch.bfloat16)`` cannot round them (bf16 frequencies put the angle ~0.4 rad
    off at position 4000). Angles are fp32, or float64 in a float64 model; only cos and sin
    take the activations' dtype.
    """

    def __init__(self, rotary_dims: int, base: float) -> None:
        super().__init__()
        self.rotary_dims = rotary_dims
        self.base = base
        # Per device, computed once: one-token decoding calls cos_sin twice per token.
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        """base^(-2i / rotary_dims) for i < rotary_dims / 2, in fp32 (as GPT-NeoX computes it)."""
        if device not in self._inv_freq:
            exponents = torch.arange(0, self.rotary_dims, 2, dtype=torch.float32, device=device)
            self._inv_freq[device] = 1.0 / (self.base ** (exponents / self.rotary_dims))
        return self._inv_freq[device]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for ``positions`` [B, T], shaped [B, 1, T, rotary_dims], in ``dtype``
        (the angles in fp32 at least)."""
        angle_dtype = torch.promote_types(dtype, torch.float32)
        inv_freq = self.inv_freq(positions.device).to(angle_dtype)
        freqs = positions.unsqueeze(-1).to(angle_dtype) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` rotated by the angles of ``cos``/``sin`` (named so as not to shadow
        ``nn.Module.apply``, which ``model.apply(init_fn)`` needs)."""
        r = self.rotary_dims
        x_rot, x_pass = x[..., :r], x[..., r:]
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
        return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class Attention(nn.Module):
    """GPT-NeoX attention in the variant of ``config.attention.softmax``. What a variant changes
    is defined once, here and in ``attention.sink_softmax``: :meth:`sink` (the softmax's extra
    denominator term), :meth:`output` (the gate); the streaming evaluator's fast path calls
    them too."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.softmax = config.attention.softmax
        self.backend = config.attention.backend
        self.query_key_value = nn.Linear(config.d_model, 3 * config.d_model)
        self.dense = nn.Linear(config.d_model, config.d_model)
        if self.softmax == "sink_logit":
            self.sink_logit = nn.Parameter(torch.zeros(config.n_head))
        elif self.softmax == "softmax1":
            self.register_buffer("zero_sink", torch.zeros(config.n_head), persistent=False)
        elif self.softmax == "gated":
            self.gate = nn.Linear(config.d_model, config.d_model)

    def sink(self) -> Tensor | None:
        """The extra denominator logit per head, or None for plain softmax."""
        if self.softmax == "sink_logit":
            return self.sink_logit
        if self.softmax == "softmax1":
            return self.zero_sink
        return None

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values [..., H, T, D] of ``x`` [..., T, d], before rotary (the
        fused projection holds [q_h, k_h, v_h] per head). The model and the streaming
        evaluator's fast path both split heads here."""
        qkv = self.query_key_value(x)
        qkv = qkv.view(*x.shape[:-1], self.n_head, 3 * self.head_dim).transpose(-3, -2)
        q, k, v = qkv.chunk(3, dim=-1)
        return q, k, v

    def output(self, y: Tensor, x: Tensor) -> Tensor:
        """The layer's output from the heads' ``y`` [..., H, T, D] and the layer input ``x``
        [..., T, d]: heads merged, the ``gated`` variant's gate, the output projection. Shared
        with the streaming evaluator's fast path, so a variant's output side lives here only."""
        y = y.transpose(-3, -2).flatten(-2)
        if self.softmax == "gated":
            y = y * torch.sigmoid(self.gate(x))
        return self.dense(y)

    def forward(
        self,
        x: Tensor,
        rotary: RotaryEmbedding,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        past: tuple[Tensor, Tensor] | None,
        need_weights: bool,
        use_cache: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None, Tensor | None]:
        """Returns (output, (keys before rotary, values) including ``past`` when ``use_cache``,
        probabilities when ``need_weights``)."""
        q, k, v = self.heads(x)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        new_past = (k, v) if use_cache else None  # no views escape otherwise (FSDP2 warns)
        q = rotary.rotate(q, *rope_q)
        k = rotary.rotate(k, *rope_k)
        probs = None
        if need_weights or self.backend == "eager":
            y, probs = eager_attention(q, k, v, self.sink())
        else:
            y = FUSED_KERNELS[self.backend](q, k, v, self.sink())
        return self.output(y, x), new_past, probs if need_weights else None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.d_model, config.d_mlp)
        self.dense_4h_to_h = nn.Linear(config.d_mlp, config.d_model)
        self.approximate = config.gelu_approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class Block(nn.Module):
    """Parallel residual x + attn(ln1(x)) + mlp(ln2(x)) (Pythia), or sequential
    h = x + attn(ln1(x)), h + mlp(ln2(h)) when ``use_parallel_residual`` is off."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attention = Attention(config)
        self.mlp = MLP(config)
        self.parallel = config.use_parallel_residual

    def residual(self, x: Tensor, attention: Callable[[Tensor], Tensor]) -> Tensor:
        """The block around ``attention`` (any function of ln1(x) with the attention's output):
        the model's forward and the streaming evaluator's cache share this one definition."""
        attn = attention(self.input_layernorm(x))
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(
        self, x: Tensor, rotary: RotaryEmbedding, rope: tuple[Tensor, Tensor], need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The block over tokens that see only each other (no cache): the output and, with
        ``need_weights``, the attention probabilities. Tensors in and out, so that a compiled
        or FSDP-wrapped block is called the same way every step."""
        probs: list[Tensor | None] = []

        def attention(x_in: Tensor) -> Tensor:
            out, _, weights = self.attention(x_in, rotary, rope, rope, None, need_weights)
            probs.append(weights)
            return out

        return self.residual(x, attention), probs[0]


class Decoder(nn.Module):
    """Embedding, blocks and final norm: ``gpt_neox`` in transformers' naming. With
    ``learned_positions``, also ``embed_positions``: one row per position 0..max_seq_len-1."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = (
            nn.Embedding(config.max_seq_len, config.d_model) if config.learned_positions else None
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dims, config.rotary_base)


class CausalLM(nn.Module):
    """A GPT-NeoX language model with the attention variant and backend of ``config``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        check_backend_available(config.attention.backend)
        self.config = config
        self.gpt_neox = Decoder(config)
        self.embed_out = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Pythia's initialisation (GPT-NeoX ``small_init`` and ``wang_init``).

        std sqrt(2 / (5 d)) for embeddings (learned positions too), QKV, the gate, the first MLP
        layer and the head; 2 / (L sqrt(d)) for the two layers that write into the residual
        stream. Biases and sink logits start at zero, LayerNorms at identity.
        """
        d, n_layer = self.config.d_model, self.config.n_layer
        small = math.sqrt(2.0 / (5.0 * d))
        wang = 2.0 / (n_layer * math.sqrt(d))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = wang if name.endswith(("attention.dense", "dense_4h_to_h")) else small
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=small)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, Attention) and module.softmax == "sink_logit":
                nn.init.zeros_(module.sink_logit)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cache: Cache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits [B, T, vocab_size] for ``input_ids`` [B, T] (with ``need_weights``, also the
        attention probabilities: see :meth:`forward_with_attentions`).

        ``position_ids`` [B, T] default to the next positions after a ``KVCache`` (0.. without
        one). With a ``cache``, the new keys and values are added to it.
        """
        attentions: list[Tensor] | None = [] if need_weights else None
        logits = self.logits(self.hidden_states(input_ids, position_ids, cache, attentions))
        return (logits, attentions) if attentions is not None else logits

    def forward_with_attentions(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits and each layer's attention probabilities [B, H, T, S] (eager, for diagnostics).

        For softmax1 and sink_logit, a row sums to less than one; the rest went to the sink.
        Runs through ``__call__``, so wrappers' hooks (FSDP2 gathering sharded weights) apply.
        """
        return self(input_ids, position_ids, cache, need_weights=True)

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cache: Cache | None = None,
        attentions: list[Tensor] | None = None,
    ) -> Tensor:
        """Hidden states [B, T, d] before the final norm: the one block loop that training, the
        evaluators and generation all run.

        Without a cache every block is called as a module (hooks and ``torch.compile`` apply);
        with one, the cache's :meth:`Cache.step` gives each layer's attention. ``attentions``,
        when given, receives each layer's probabilities. With ``learned_positions``, each token's
        embedding gets the row of the position it enters at (the cache's
        :meth:`Cache.query_positions`, else ``position_ids`` or 0..T-1).
        """
        decoder = self.gpt_neox
        x = decoder.embed_in(input_ids)
        if cache is not None:
            if decoder.embed_positions is not None:
                x = x + self.position_embeddings(cache.query_positions(input_ids, position_ids))
            attend = cache.step(decoder.rotary, input_ids, position_ids, x.dtype, attentions)
            for i, block in enumerate(decoder.layers):
                x = block.residual(x, functools.partial(attend, i, block.attention))
            return x
        positions = resolve_positions(position_ids, 0, input_ids)
        if decoder.embed_positions is not None:
            top = input_ids.shape[1] - 1 if position_ids is None else None  # 0..T-1: known
            x = x + self.position_embeddings(positions, top)
        rope = decoder.rotary.cos_sin(positions, x.dtype)
        for block in decoder.layers:
            x, probs = block(x, decoder.rotary, rope, attentions is not None)
            if attentions is not None and probs is not None:
                attentions.append(probs)
        return x

    def position_embeddings(self, positions: Tensor, top: int | None = None) -> Tensor:
        """The learned position rows [B, T, d] of ``positions`` (``learned_positions`` only),
        refused past the table. ``top``, the largest position when the caller knows it, spares
        reading the tensor back (a device sync per training step)."""
        table = self.gpt_neox.embed_positions
        if table is None:
            raise ValueError("this model has no learned positions (learned_positions=False)")
        if top is None:
            top = int(positions.max()) if positions.numel() else -1
        check_embeddable(self.config, top, "tokens",
                         "keep positions below max_seq_len: inputs of at most "
                         f"{self.config.max_seq_len} tokens, a start+recent cache of at most "
                         f"{self.config.max_seq_len - 1} (x+y)")
        return table(positions)

    def logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """Vocabulary logits of hidden states: the final norm, then the head. With ``out`` (rows x
        vocab), written there, so that an evaluator reuses one buffer for every block."""
        normed = self.gpt_neox.final_layer_norm(hidden)
        if out is None:
            return self.embed_out(normed)
        if normed.dtype == out.dtype:
            return torch.mm(normed, self.embed_out.weight.t(), out=out)
        return out.copy_(self.embed_out(normed))
