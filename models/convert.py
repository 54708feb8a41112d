"""Interop with transformers' ``GPTNeoXForCausalLM``.

Our modules use transformers' weight names and fused per-head QKV layout, so converting is
mostly checking: configs map field by field, and state dicts differ only in non-parameter
buffers (older transformers versions saved causal-mask and rotary buffers) and, for variants
GPT-NeoX cannot express, in their extra parameters (``sink_logit``, ``gate``, and the learned
position table ``embed_positions`` of the ``learned_positions`` research option). config.json's
``sinklm`` block records what GPT-NeoX's fields cannot: the attention variant, the sink ids and
whether positions are learned.
Exported folders ship this file, so the block is written and read here (through
``models.checkpoint``, which lists every on-disk key, for the rest of sinklm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor

from .config import ConfigError, ModelConfig
from .model import CausalLM

if TYPE_CHECKING:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

# transformers' activation names and the GELU form each one computes.
HF_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
HF_GELU_NAME = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
# Buffers older transformers versions stored in checkpoints; they carry no learned state.
HF_BUFFER_SUFFIXES = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")
# GPT-NeoX, and sinklm's exports of the variants GPT-NeoX lacks (models/configuration_sinklm.py).
HF_MODEL_TYPES = ("gpt_neox", "sinklm")
# Parameters only our variants have: a plain GPT-NeoX has no slot for them.
VARIANT_PARAM_SUFFIXES = ("attention.sink_logit", "attention.gate.weight", "attention.gate.bias")
# learned_positions' table: GPT-NeoX has rotary positions only.
LEARNED_POSITION_PARAMS = ("gpt_neox.embed_positions.weight",)
# config.json's block of an export: the attention variant and sink ids GPT-NeoX's fields lack.
EXPORT_BLOCK_KEY = "sinklm"


def needs_remote_code(config: ModelConfig) -> bool:
    """Whether transformers needs sinklm's modeling code: GPT-NeoX computes plain softmax only,
    with rotary positions only."""
    return config.attention.softmax != "softmax" or config.learned_positions


def remote_code_reason(config: ModelConfig) -> str:
    """Why a plain GPTNeoXForCausalLM cannot compute ``config``'s model (for messages)."""
    reasons = []
    if config.attention.softmax != "softmax":
        reasons.append(f"attention.softmax={config.attention.softmax!r}: a plain "
                       "GPTNeoXForCausalLM computes vanilla softmax only")
    if config.learned_positions:
        reasons.append("learned_positions=True: a plain GPTNeoXForCausalLM has no learned "
                       "position table (rotary only)")
    return "; ".join(reasons)


def export_block(
    name: str, config: ModelConfig, sink_ids: Sequence[int], version: str
) -> dict[str, Any]:
    """config.json's ``sinklm`` block of an export: the variant and sink ids GPT-NeoX lacks."""
    return {
        "name": name,
        "attention_softmax": config.attention.softmax,
        "sink_tokens": config.sink_tokens,
        "sink_token_ids": list(sink_ids),
        "learned_positions": config.learned_positions,
        "sinklm_version": version,
    }


class ExportBlock(NamedTuple):
    """What loading reads back from config.json's ``sinklm`` block; a plain GPTNeoX (no block)
    reads as vanilla softmax without sink ids."""

    name: str | None
    softmax: str
    sink_tokens: int
    sink_ids: list[int]
    learned_positions: bool = False  # absent from exports written before the option


def read_export_block(hf_config: Any) -> ExportBlock:
    """The ``sinklm`` block of a transformers config (an attribute of it), checked: the sink id
    list must match the sink count."""
    block = getattr(hf_config, EXPORT_BLOCK_KEY, None) or {}
    sink_tokens = int(block.get("sink_tokens", 0))
    sink_ids = [int(i) for i in block.get("sink_token_ids") or []]
    if len(sink_ids) != sink_tokens:
        raise ConfigError(
            f"config.json says sink_tokens={sink_tokens} but lists sink_token_ids={sink_ids}: "
            "the checkpoint's sinklm metadata is incomplete"
        )
    learned = block.get("learned_positions", False)
    if not isinstance(learned, bool):
        raise ConfigError(f"config.json says learned_positions={learned!r}: must be true or false")
    return ExportBlock(block.get("name"), block.get("attention_softmax", "softmax"), sink_tokens,
                       sink_ids, learned)


def _rope_setting(hf_config: Any, key: str, legacy: str, default: float) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if key in rope:
        return float(rope[key])
    return float(getattr(hf_config, legacy, default))


def config_from_hf(hf_config: GPTNeoXConfig, name: str | None = None) -> ModelConfig:
    """Our config for a transformers GPTNeoX config; refuses what our network cannot express."""
    if getattr(hf_config, "model_type", None) not in HF_MODEL_TYPES:
        raise ConfigError(
            f"model_type={getattr(hf_config, 'model_type', None)!r}: only GPT-NeoX (Pythia) "
            "checkpoints convert; pass a GPTNeoX model"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings=True: sinklm models have untied embeddings")
    if not getattr(hf_config, "attention_bias", True):
        raise ConfigError("attention_bias=False: sinklm models have biases on every linear layer")
    if hf_config.hidden_act not in HF_GELU:
        raise ConfigError(f"hidden_act={hf_config.hidden_act!r}: allowed {sorted(HF_GELU)}")
    if hf_config.intermediate_size % hf_config.hidden_size:
        raise ConfigError(
            f"intermediate_size={hf_config.intermediate_size} is not a multiple of "
            f"hidden_size={hf_config.hidden_size}"
        )
    block = read_export_block(hf_config)
    return ModelConfig(
        name=name or block.name or getattr(hf_config, "name_or_path", "") or "gpt_neox",
        vocab_size=hf_config.vocab_size,
        n_layer=hf_config.num_hidden_layers,
        n_head=hf_config.num_attention_heads,
        d_model=hf_config.hidden_size,
        max_seq_len=hf_config.max_position_embeddings,
        rotary_pct=_rope_setting(hf_config, "partial_rotary_factor", "rotary_pct", 0.25),
        rotary_base=_rope_setting(hf_config, "rope_theta", "rotary_emb_base", 10000.0),
        mlp_ratio=hf_config.intermediate_size // hf_config.hidden_size,
        layer_norm_eps=hf_config.layer_norm_eps,
        gelu_approximate=HF_GELU[hf_config.hidden_act],  # type: ignore[arg-type]
        use_parallel_residual=bool(getattr(hf_config, "use_parallel_residual", True)),
        attention={"softmax": block.softmax, "backend": "sdpa"},
        sink_tokens=block.sink_tokens,
        learned_positions=block.learned_positions,
    )


def hf_config_from(config: ModelConfig) -> GPTNeoXConfig:
    """The transformers GPTNeoX config of our network (its attention variant and learned
    positions aside: the ``sinklm`` block records those)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.d_mlp,
        hidden_act=HF_GELU_NAME[config.gelu_approximate],
        max_position_embeddings=config.max_seq_len,
        layer_norm_eps=config.layer_norm_eps,
        rotary_pct=config.rotary_pct,
        rotary_emb_base=config.rotary_base,
        use_parallel_residual=config.use_parallel_residual,
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=0,
        eos_token_id=0,
    )


def from_hf_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A transformers GPTNeoXForCausalLM state dict as ours: buffers dropped, head renamed.

    Pythia's checkpoints (and transformers 4) call the output head ``embed_out``;
    transformers 5 calls it ``lm_head`` in memory. Ours is ``embed_out``.
    """
    return {
        ("embed_out.weight" if k == "lm_head.weight" else k): v
        for k, v in state_dict.items()
        if not k.endswith(HF_BUFFER_SUFFIXES)
    }


def to_hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """Our weights under transformers' names; refuses parameters GPT-NeoX has no slot for."""
    state = model.state_dict()
    extra = sorted(k for k in state if k.endswith(VARIANT_PARAM_SUFFIXES))
    if extra:
        raise ConfigError(
            f"attention.softmax={model.config.attention.softmax!r} has parameters a plain "
            f"GPTNeoXForCausalLM cannot hold ({extra[0]}, ...); export it with its modeling code"
        )
    positions = sorted(k for k in state if k in LEARNED_POSITION_PARAMS)
    if positions:
        raise ConfigError(
            f"learned_positions=True has a parameter a plain GPTNeoXForCausalLM cannot hold "
            f"({positions[0]}: GPT-NeoX has rotary positions only); export it with its "
            "modeling code"
        )
    return dict(state)


def _rename_head_for(hf_model: GPTNeoXForCausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Use the head name this transformers version has in memory (``embed_out``/``lm_head``)."""
    if hasattr(hf_model, "lm_head") and "embed_out.weight" in state:
        state = dict(state)
        state["lm_head.weight"] = state.pop("embed_out.weight")
    return state


def from_hf_model(hf_model: GPTNeoXForCausalLM, backend: str = "sdpa") -> CausalLM:
    """Our model with the weights of a transformers GPTNeoXForCausalLM."""
    config = config_from_hf(hf_model.config)
    config = config.replace(attention={"backend": backend})
    model = CausalLM(config)
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict()), strict=True)
    return model.to(next(hf_model.parameters()).dtype)


def to_hf_model(model: CausalLM) -> GPTNeoXForCausalLM:
    """A transformers GPTNeoXForCausalLM with our weights (softmax models with rotary
    positions only)."""
    from transformers import GPTNeoXForCausalLM

    if needs_remote_code(model.config):
        raise ConfigError(
            f"{remote_code_reason(model.config)}; export this variant with its modeling code"
        )
    hf_model = GPTNeoXForCausalLM(hf_config_from(model.config))
    missing, unexpected = hf_model.load_state_dict(
        _rename_head_for(hf_model, to_hf_state_dict(model)), strict=False
    )
    missing = [k for k in missing if not k.endswith(HF_BUFFER_SUFFIXES)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hf_model.to(next(model.parameters()).dtype)
