"""The Pythia-style (GPT-NeoX) decoder, in one readable file.

Weight names and the fused QKV layout are those of transformers' ``GPTNeoXForCausalLM``
(``gpt_neox.layers.{i}.attention.query_key_value`` holds, per head, [q_h, k_h, v_h]), so
state dicts move between the two without renaming. Parameters the GPT-NeoX architecture has
no slot for (``attention.sink_logit``, ``attention.gate``) exist only in those variants.

The model holds no cache policy: ``forward`` takes explicit positions and an optional
``KVCache`` whose keys are stored before rotary, so a caller (the streaming evaluator) may
evict entries and re-assign the positions of what it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import FUSED_KERNELS, check_backend_available, eager_attention
from .config import ModelConfig


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
        self,
        x: Tensor,
        rotary: RotaryEmbedding,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        past: tuple[Tensor, Tensor] | None,
        need_weights: bool,
        use_cache: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None, Tensor | None]:
        extras: list[tuple[Tensor, Tensor] | Tensor | None] = []

        def attention(x_in: Tensor) -> Tensor:
            out, new_past, probs = self.attention(
                x_in, rotary, rope_q, rope_k, past, need_weights, use_cache
            )
            extras.extend((new_past, probs))
            return out

        x = self.residual(x, attention)
        new_past, probs = extras
        return x, new_past, probs  # type: ignore[return-value]


class Decoder(nn.Module):
    """Embedding, blocks and final norm: ``gpt_neox`` in transformers' naming."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.d_model)
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

        std sqrt(2 / (5 d)) for embeddings, QKV, the gate, the first MLP layer and the head;
        2 / (L sqrt(d)) for the two layers that write into the residual stream. Biases and
        sink logits start at zero, LayerNorms at identity.
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
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits [B, T, vocab_size] for ``input_ids`` [B, T] (with ``need_weights``, also the
        attention probabilities: see :meth:`forward_with_attentions`).

        ``position_ids`` [B, T] default to the next positions after the cache (0.. without one).
        With a ``cache``, the new keys and values are appended to it and its positions grow.
        """
        logits, probs = self._run(input_ids, position_ids, cache, need_weights)
        return (logits, probs) if need_weights else logits

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

    def _run(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None,
        cache: KVCache | None,
        need_weights: bool,
    ) -> tuple[Tensor, list[Tensor]]:
        b, t = input_ids.shape
        past_len = len(cache) if cache is not None else 0
        if position_ids is None:
            start = past_len
            position_ids = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        elif position_ids.dim() == 1:
            position_ids = position_ids.expand(b, t)
        decoder = self.gpt_neox
        x = decoder.embed_in(input_ids)
        rope_q = decoder.rotary.cos_sin(position_ids, x.dtype)
        rope_k = rope_q
        if cache is not None and cache.positions is not None:
            key_positions = torch.cat([cache.positions.expand(b, -1), position_ids], dim=1)
            rope_k = decoder.rotary.cos_sin(key_positions, x.dtype)
        all_probs: list[Tensor] = []
        for i, block in enumerate(decoder.layers):
            past = None
            if cache is not None and cache.keys[i] is not None:
                past = (cache.keys[i], cache.values[i])
            x, new_past, probs = block(x, decoder.rotary, rope_q, rope_k, past, need_weights,
                                       use_cache=cache is not None)
            if cache is not None and new_past is not None:
                cache.keys[i], cache.values[i] = new_past
            if probs is not None:
                all_probs.append(probs)
        if cache is not None:
            previous = cache.positions
            cache.positions = (
                position_ids if previous is None
                else torch.cat([previous.expand(b, -1), position_ids], dim=1)
            )
        return self.embed_out(decoder.final_layer_norm(x)), all_probs
