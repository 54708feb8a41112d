"""Streaming generation with StreamingLLM's start+recent cache, for users of plain transformers.

Shipped as ``custom_generate/generate.py`` in every sinklm export, so that

    model.generate(**inputs, custom_generate=<folder or repo>, trust_remote_code=True,
                   start_size=4, recent_size=1020, max_new_tokens=10_000)

streams as ``sinklm generate --cache 4+1020`` does: the cache keeps the first ``start_size``
tokens of the stream and the ``recent_size`` most recent, and positions are re-assigned inside
it at every step (cached tokens at 0..len-1 in cache order, the new token at len), so a query
never sits past position start_size + recent_size however long the stream. A prompt longer than
the cache is streamed under the same rule, never truncated. Without the two sizes this is
transformers' own ``generate`` (transformers also puts it in place of ``model.generate`` when a
folder with it is loaded with ``trust_remote_code=True``). Greedy, batch size 1.

It imports only torch and transformers: a user needs the folder, not sinklm. Two kinds of model:

- ``gpt_neox`` (``GPTNeoXForCausalLM``) rotates keys before they reach its cache, so each layer's
  :class:`StartRecentLayer` rotates incoming keys back and stores them before rotary, then hands
  the attention every stored key rotated to its current slot: re-rotating from the stored key,
  rather than rotating a rotated key again, keeps rounding from piling up over a long stream.
- ``sinklm`` (remote-code variants) runs sinklm's own network, whose ``KVCache`` already stores
  keys before rotary with explicit positions: evicting is dropping entries and re-assigning
  positions 0..len-1.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation import GenerateDecoderOnlyOutput

# generate()'s keyword arguments transformers passes along to custom_generate (None unless the
# caller set them); with the cache sizes they must stay unset, as nothing here honours them.
PASSED_ALONG = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
                "negative_prompt_attention_mask")


@torch.no_grad()
def generate(
    inputs: Tensor | None = None,
    generation_config: Any = None,
    *,
    model: nn.Module,
    start_size: int | None = None,
    recent_size: int | None = None,
    **kwargs: Any,
) -> Tensor | GenerateDecoderOnlyOutput:
    """Greedy tokens under the ``start_size``+``recent_size`` cache: [1, prompt + new] ids, or
    ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate`` (``output_scores`` and
    ``output_logits`` give each step's logits). Without the sizes, transformers' ``generate``.

    ``model`` is keyword-only because transformers binds it by keyword both when it calls this
    for ``custom_generate=`` and when it puts this in place of ``model.generate``. Honoured:
    ``max_new_tokens`` (else ``max_length``), ``eos_token_id`` (None: never stop),
    ``return_dict_in_generate``, ``output_scores``, ``output_logits``.
    """
    sizes = {name: value for name, value in (("start_size", start_size),
                                             ("recent_size", recent_size)) if value is not None}
    # `custom_generate` arrives here only when this already is `model.generate` (loaded with
    # trust_remote_code): transformers' generate loads the repo named and calls it, which may
    # be this function again, then without `custom_generate`.
    if not sizes or "custom_generate" in kwargs:
        return type(model).generate(model, inputs, generation_config, **sizes, **kwargs)
    learned = bool((getattr(model.config, "sinklm", None) or {}).get("learned_positions"))
    start, recent = check_sizes(start_size, recent_size, model.config.max_position_embeddings,
                                learned)
    config = copy.deepcopy(generation_config or model.generation_config)
    rest = config.update(**kwargs)
    ids = inputs if inputs is not None else rest.pop("input_ids", None)
    prompt = check_prompt(ids, rest.pop("attention_mask", None))
    rest.pop("trust_remote_code", None)  # said for custom_generate; nothing to do with it here
    unknown = sorted(name for name, value in rest.items()
                     if value is not None or name not in PASSED_ALONG)
    if unknown:
        raise ValueError(f"streaming generation (start_size/recent_size) does not take "
                         f"{', '.join(unknown)}")
    # transformers 5 leaves unset options None, 4 gives them their defaults.
    if config.do_sample or (config.num_beams or 1) != 1 or (config.num_return_sequences or 1) != 1:
        raise ValueError("streaming generation (start_size/recent_size) is greedy: pass "
                         "do_sample=False, num_beams=1, num_return_sequences=1")
    max_new = config.max_new_tokens
    if max_new is None and config.max_length is not None:
        max_new = config.max_length - prompt.shape[1]
    if max_new is None or max_new < 1:
        raise ValueError(f"max_new_tokens={max_new}: pass max_new_tokens >= 1")
    eos = config.eos_token_id
    stops = set() if eos is None else {int(i) for i in torch.tensor(eos).flatten()}

    stream = stream_for(model, start, recent)
    prompt = prompt.to(model.device)
    # Until the cache is full, every token sees all earlier ones at their true positions: the
    # first start + recent + 1 tokens go in one forward. After that, one token at a time.
    first = min(prompt.shape[1], start + recent + 1)
    logits = stream(prompt[:, :first])
    for i in range(first, prompt.shape[1]):
        logits = stream(prompt[:, i : i + 1])
    tokens: list[Tensor] = []
    steps: list[Tensor] = []
    for step in range(max_new):
        if step:
            logits = stream(tokens[-1])
        steps.append(logits)
        tokens.append(logits.argmax(-1, keepdim=True))
        if int(tokens[-1]) in stops:
            break
    sequences = torch.cat([prompt, *tokens], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(steps) if config.output_scores else None,
        logits=tuple(steps) if config.output_logits else None,
    )


def check_sizes(start_size: Any, recent_size: Any, trained: int,
                learned: bool = False) -> tuple[int, int]:
    """The two sizes as ints, refused unless both are integers >= 0 with a sum >= 1; a warning
    when queries will sit at positions the model was never trained on, refused instead for a
    model with ``learned`` absolute positions (it has no embedding for them)."""
    if start_size is None or recent_size is None:
        raise ValueError("start_size and recent_size go together (StreamingLLM's x+y cache): "
                         "pass both, or neither for transformers' own generate")
    for name, value in (("start_size", start_size), ("recent_size", recent_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: must be an integer >= 0")
    if start_size + recent_size < 1:
        raise ValueError("start_size + recent_size is 0: the cache would keep no token")
    if learned and start_size + recent_size >= trained:
        raise ValueError(f"start_size + recent_size = {start_size + recent_size}: queries reach "
                         f"position {start_size + recent_size}, but this model's learned "
                         f"positions embed only 0..{trained - 1}; use start_size + recent_size "
                         f"<= {trained - 1}")
    if start_size + recent_size >= trained:
        warnings.warn(f"start_size + recent_size = {start_size + recent_size}: queries reach "
                      f"position {start_size + recent_size}, past the {trained} positions "
                      f"(0..{trained - 1}) the model was trained on", stacklevel=3)
    return start_size, recent_size


def check_prompt(ids: Tensor | None, attention_mask: Tensor | None) -> Tensor:
    """The prompt [1, T], refused if absent, empty, batched or padded."""
    if ids is None or ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError("streaming generation needs input_ids of shape [1, T] with T >= 1")
    if ids.shape[0] != 1:
        raise ValueError(f"streaming generation takes one sequence at a time (batch size 1); "
                         f"got a batch of {ids.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("streaming generation takes an unpadded prompt: the attention mask "
                         "must be all ones")
    return ids


def keep_index(held: int, start: int, recent: int, device: torch.device) -> Tensor | None:
    """Which of ``held`` cache entries stay: the first ``start`` and the last ``recent``, or
    None when all fit."""
    if held <= start + recent:
        return None
    return torch.cat([torch.arange(start), torch.arange(held - recent, held)]).to(device)


def rotate(keys: Tensor, first: int, sign: int, inv_freq: Tensor) -> Tensor:
    """``keys`` [..., n, D] rotated by ``sign`` times GPT-NeoX's rotary angles of positions
    first..first+n-1 (rotate-half on the first 2 * len(inv_freq) dims), computed in fp32 the
    way transformers computes them, so that sign -1 undoes what the model did."""
    r = 2 * inv_freq.numel()
    positions = torch.arange(first, first + keys.shape[-2], device=keys.device).float()
    freqs = positions[:, None] * inv_freq.to(keys.device) * sign
    angles = torch.cat([freqs, freqs], dim=-1)
    x = keys[..., :r].float()
    half = torch.cat([-x[..., r // 2 :], x[..., : r // 2]], dim=-1)
    rotated = x * angles.cos() + half * angles.sin()
    return torch.cat([rotated.to(keys.dtype), keys[..., r:]], dim=-1)


class StartRecentLayer(DynamicLayer):
    """One GPT-NeoX layer's cache: the first ``start`` tokens and the ``recent`` most recent,
    keys stored before rotary, so that it never holds more than start + recent entries.

    ``update`` gets the new keys rotated at the positions after the held ones (the caller's
    position_ids); it returns every held key rotated to its slot (0..held-1) plus the new ones
    for the attention, and keeps the new ones, rotated back, within the sizes.
    """

    def __init__(self, start: int, recent: int, inv_freq: Tensor) -> None:
        super().__init__()
        self.start, self.recent, self.inv_freq = start, recent, inv_freq

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self.keys is None:  # the first update (lazy_initialization's signature varies)
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.is_initialized = True
        held = self.keys.shape[-2]
        keys = torch.cat([rotate(self.keys, 0, 1, self.inv_freq), key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        stored = torch.cat([self.keys, rotate(key_states, held, -1, self.inv_freq)], dim=-2)
        index = keep_index(stored.shape[-2], self.start, self.recent, stored.device)
        if index is None:
            self.keys, self.values = stored, values
        else:
            self.keys, self.values = stored.index_select(-2, index), values.index_select(-2, index)
        return keys, values


class NeoXStream:
    """A ``GPTNeoXForCausalLM`` through its own forward, with a cache of StartRecentLayers."""

    def __init__(self, model: nn.Module, start: int, recent: int) -> None:
        rotary = model.gpt_neox.rotary_emb
        if getattr(rotary, "rope_type", "default") != "default":
            raise ValueError(f"streaming generation re-rotates keys with plain rotary; this "
                             f"model's rope_type is {rotary.rope_type!r}")
        inv_freq = rotary.inv_freq.float()
        self.model = model
        self.cache = Cache(layers=[StartRecentLayer(start, recent, inv_freq)
                                   for _ in range(model.config.num_hidden_layers)])
        # transformers 5 names the forward's cache argument `cache`, 4 `past_key_values`.
        parameters = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"

    def __call__(self, ids: Tensor) -> Tensor:
        """fp32 logits [1, vocab] of the last of ``ids`` [1, T], which follow the held tokens."""
        held = self.cache.get_seq_length()
        positions = torch.arange(held, held + ids.shape[1], device=ids.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                         **{self.cache_name: self.cache})
        return out.logits[:, -1].float()


class SinkLMStream:
    """A sinklm remote-code model through its network, whose ``KVCache`` (keys before rotary,
    explicit positions) this wraps: sinklm's ``Cache`` protocol, ``step``, cuts each layer's
    entries back to the sizes as soon as the layer has attended, and re-assigns positions."""

    def __init__(self, model: nn.Module, start: int, recent: int) -> None:
        self.network = model.network
        # The KVCache of the folder's own model.py, which the network's module imported.
        kv_cache = sys.modules[type(self.network).__module__].KVCache
        self.kv = kv_cache(self.network.config.n_layer)
        self.start, self.recent = start, recent

    def __call__(self, ids: Tensor) -> Tensor:
        """fp32 logits [1, vocab] of the last of ``ids`` [1, T], which follow the held tokens."""
        return self.network(ids, cache=self)[:, -1].float()

    def query_positions(self, *args: Any) -> Tensor:
        """The KVCache's: the new tokens after the held ones (learned positions embed them)."""
        return self.kv.query_positions(*args)

    def step(self, *args: Any) -> Callable[[int, nn.Module, Tensor], Tensor]:
        """The KVCache's step (new tokens at the positions after the held ones), then each
        layer's keys and values cut back to the first ``start`` and last ``recent``, at
        positions 0..len-1 for the next step."""
        attend = self.kv.step(*args)
        index = keep_index(len(self.kv), self.start, self.recent, self.kv.positions.device)
        if index is None:
            return attend
        self.kv.positions = torch.arange(len(index), device=index.device)[None]

        def bounded(layer: int, attention: nn.Module, x: Tensor) -> Tensor:
            out = attend(layer, attention, x)
            self.kv.keys[layer] = self.kv.keys[layer].index_select(2, index)
            self.kv.values[layer] = self.kv.values[layer].index_select(2, index)
            return out

        return bounded


def stream_for(model: nn.Module, start: int, recent: int) -> NeoXStream | SinkLMStream:
    """The stream for ``model``'s kind (its config's model_type)."""
    kinds = {"gpt_neox": NeoXStream, "sinklm": SinkLMStream}
    kind = model.config.model_type
    if kind not in kinds:
        raise ValueError(f"streaming generation supports model types {sorted(kinds)}, not "
                         f"{kind!r}")
    return kinds[kind](model, start, recent)
