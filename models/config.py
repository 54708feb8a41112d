"""Model configuration: one dataclass, named presets, validation at construction.

The two axes of ARCHITECTURE.md live here: ``attention.softmax`` (how a head normalises its
scores) and ``sink_tokens`` (how many dedicated sink ids the collator prepends). They combine
freely; the paper's three models are the presets ``vanilla``, ``zero_sink`` and ``sink_token``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# This module ships inside exported folders (with attention, compat, model and convert), where
# transformers loads it as remote code and sinklm may not be installed: it imports nothing of
# sinklm but, where sinklm is there, the UserError that `sinklm` prints as one line.
try:
    from sinklm.cli.main import UserError
except ImportError:

    class UserError(Exception):  # type: ignore[no-redef]
        """Stands in for sinklm's own where only the exported folder is there."""

Softmax = Literal["softmax", "softmax1", "sink_logit", "gated"]
Backend = Literal["eager", "sdpa", "flex", "flash"]
SOFTMAX_VARIANTS: tuple[str, ...] = ("softmax", "softmax1", "sink_logit", "gated")
BACKENDS: tuple[str, ...] = ("eager", "sdpa", "flex", "flash")
GELU_FORMS: tuple[str, ...] = ("none", "tanh")

# The paper's three models as points on the two axes: (attention.softmax, sink_tokens).
VARIANTS: dict[str, tuple[str, int]] = {
    "vanilla": ("softmax", 0),
    "zero_sink": ("softmax1", 0),
    "sink_token": ("softmax", 1),
    "sink_logit": ("sink_logit", 0),
    "gated": ("gated", 0),
    "two_sink_tokens": ("softmax", 2),
}


def variant_name(config: ModelConfig) -> str:
    """The named variant of a config (``sink_token``, ...), or ``softmax1+2sinks`` style."""
    point = (config.attention.softmax, config.sink_tokens)
    named = [name for name, value in VARIANTS.items() if value == point]
    return named[0] if named else f"{point[0]}+{point[1]}sinks"


class ConfigError(UserError, ValueError):
    """A configuration value is out of range; the message names the field and what is allowed."""


class PositionError(ConfigError):
    """A token was given a position a model with ``learned_positions`` cannot embed; the
    message names the position, the embedded range and what to change."""


def check_embeddable(config: ModelConfig, top: int, what: str, fix: str) -> None:
    """Refuse position ``top`` (the largest ``what`` reaches) if the model's learned position
    table has no row for it; ``fix`` says what to change. Nothing for rotary-only models."""
    if config.learned_positions and top >= config.max_seq_len:
        raise PositionError(
            f"{what} reach position {top}, but learned_positions embeds only positions "
            f"0..{config.max_seq_len - 1} (max_seq_len={config.max_seq_len}); {fix}"
        )


@dataclass
class AttentionConfig:
    """How attention normalises scores and which kernel computes it.

    softmax:  ``softmax`` vanilla; ``softmax1`` zero sink, exp(x_i) / (1 + sum_j exp(x_j));
              ``sink_logit`` one learned logit per head in the denominator (gpt-oss);
              ``gated`` elementwise sigmoid gate on each head's output from the block input
              (Qiu et al., Gated Attention, the G1 position).
    backend:  ``eager`` (reference, can return probabilities), ``sdpa``, ``flex``, ``flash``.
    """

    softmax: Softmax = "softmax"
    backend: Backend = "sdpa"


@dataclass
class ModelConfig:
    """A Pythia-style (GPT-NeoX) decoder. Defaults are Pythia's; presets fill the sizes."""

    name: str = "custom"
    vocab_size: int = 50304  # embedding rows; Pythia pads the 50277-token vocabulary to 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    max_seq_len: int = 2048  # trained context; rotary itself extrapolates, evaluators warn past it
    rotary_pct: float = 0.25
    rotary_base: float = 10000.0
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5
    gelu_approximate: Literal["none", "tanh"] = "none"  # "none" = exact erf GELU, as HF's "gelu"
    # Pythia's x + attn(ln1(x)) + mlp(ln2(x)); False: GPT-2's sequential h = x + attn(ln1(x)),
    # h + mlp(ln2(h)). GPTNeoXConfig's ``use_parallel_residual``, so both export as GPTNeoX.
    use_parallel_residual: bool = True
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sink_tokens: int = 0
    # Research option, not Pythia's: GPT-2/OPT-style learned absolute position embeddings, a
    # table of max_seq_len rows added to the token embedding (rotary still applies), so that a
    # one-layer model can recognise position 0. Positions >= max_seq_len cannot be embedded.
    # GPT-NeoX has no slot for the table: such a model exports only with sinklm's modeling code.
    learned_positions: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):
            self.attention = AttentionConfig(**self.attention)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def rotary_dims(self) -> int:
        """Rotated dims per head, as GPT-NeoX computes them: int(head_dim * rotary_pct)."""
        return int(self.head_dim * self.rotary_pct)

    def stream_cache(self) -> tuple[int, int]:
        """The start+recent cache sizes a stream defaults to (``sinklm generate``, an export's
        streaming example): the sink ids (4 tokens without, as StreamingLLM) and the rest of
        the trained context less the query's slot, so that queries stay at trained positions."""
        start = min(self.sink_tokens or 4, self.max_seq_len - 1)
        return start, self.max_seq_len - 1 - start

    @property
    def d_mlp(self) -> int:
        return self.mlp_ratio * self.d_model

    def training_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs of one training token (forward + backward), for MFU.

        6 per weight of every matmul (2 forward, 4 backward): QKV, attention output, MLP, gate,
        and the output head; the input embedding is a lookup and costs none. Plus attention's
        scores and weighted sum, 2 * 2 * T * d per layer forward, times 3 with backward, as
        PaLM and nanoGPT count it (the causal mask's skipped half is not subtracted).
        """
        d, n_layer = self.d_model, self.n_layer
        per_layer = 3 * d * d + d * d + 2 * d * self.d_mlp
        if self.attention.softmax == "gated":
            per_layer += d * d
        matmul_weights = n_layer * per_layer + d * self.vocab_size
        return 6.0 * matmul_weights + 12.0 * n_layer * seq_len * d

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")

        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len", "mlp_ratio"):
            positive(name)
        if self.d_model % self.n_head:
            raise ConfigError(
                f"n_head={self.n_head} does not divide d_model={self.d_model}: pick n_head among "
                f"{[h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 64]}"
            )
        if not 0.0 <= self.rotary_pct <= 1.0:
            raise ConfigError(f"rotary_pct={self.rotary_pct}: must lie in [0, 1] (Pythia: 0.25)")
        if self.rotary_dims % 2:
            raise ConfigError(
                f"rotary_pct={self.rotary_pct} gives {self.rotary_dims} rotary dims of "
                f"head_dim={self.head_dim}: rotate-half needs an even number"
            )
        if self.layer_norm_eps <= 0:
            raise ConfigError(f"layer_norm_eps={self.layer_norm_eps}: must be > 0")
        if self.gelu_approximate not in GELU_FORMS:
            raise ConfigError(f"gelu_approximate={self.gelu_approximate!r}: allowed {GELU_FORMS}")
        if self.attention.softmax not in SOFTMAX_VARIANTS:
            raise ConfigError(
                f"attention.softmax={self.attention.softmax!r}: allowed {SOFTMAX_VARIANTS}"
            )
        if self.attention.backend not in BACKENDS:
            raise ConfigError(f"attention.backend={self.attention.backend!r}: allowed {BACKENDS}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"sink_tokens={self.sink_tokens!r}: must be an integer >= 0")
        if self.sink_tokens >= self.max_seq_len:
            raise ConfigError(
                f"sink_tokens={self.sink_tokens} leaves no room in max_seq_len={self.max_seq_len}"
            )
        if not isinstance(self.learned_positions, bool):
            raise ConfigError(
                f"learned_positions={self.learned_positions!r}: must be true or false"
            )

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``; ``attention`` may be a partial dict (``{"softmax": ...}``)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; allowed {sorted(known)}")
        attention = changes.pop("attention", None)
        new_attention = dataclasses.replace(self.attention, **(attention or {}))
        return dataclasses.replace(self, attention=new_attention, **changes)

    def changed_name(self, changes: dict[str, Any]) -> str:
        """This preset's name with the network changes ``changes`` make to it, so that a
        preset with other layers (say) is not reported under the preset's own name:
        ``lab-1l+n_layer=2+learned_positions``. The attention variant and the sink ids are
        named by the variant, the kernel by no one; neither enters the name."""
        parts = [self.name]
        for key, value in changes.items():
            if key in ("name", "attention", "sink_tokens") or getattr(self, key, None) == value:
                continue
            if isinstance(value, bool):
                parts.append(key if value else f"{key}=false")
            else:
                parts.append(f"{key}={value}")
        return "+".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:  # the data configs' check (data/keys.py) is not importable from an export
            raise ConfigError(f"unknown model config keys {unknown}; allowed {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_preset(cls, preset: str, /, variant: str | None = None,
                    **changes: Any) -> ModelConfig:
        """A preset size, optionally with a named variant (``vanilla``, ``zero_sink``, ...)
        and ``changes``, which name the result unless they name it themselves."""
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; available: {sorted(PRESETS)}")
        config = cls(**PRESETS[preset])
        if changes and "name" not in changes:
            changes["name"] = config.changed_name(changes)
        if variant is not None:
            if variant not in VARIANTS:
                raise ConfigError(f"unknown variant {variant!r}; available: {sorted(VARIANTS)}")
            softmax, sink_tokens = VARIANTS[variant]
            config = config.replace(attention={"softmax": softmax}, sink_tokens=sink_tokens)
        return config.replace(**changes) if changes else config


# Pythia sizes follow the released checkpoints' configs; tiny sizes are for CPU work.
PRESETS: dict[str, dict[str, Any]] = {
    "pythia-14m": dict(name="pythia-14m", n_layer=6, n_head=4, d_model=128),
    "pythia-70m": dict(name="pythia-70m", n_layer=6, n_head=8, d_model=512),
    "pythia-160m": dict(name="pythia-160m", n_layer=12, n_head=12, d_model=768),
    "pythia-410m": dict(name="pythia-410m", n_layer=24, n_head=16, d_model=1024),
    # 5.3M parameters with a 4096-token BPE: trains at ~6k tokens/s on 2 CPU cores.
    "tiny-5m": dict(
        name="tiny-5m", vocab_size=4096, n_layer=4, n_head=8, d_model=256, max_seq_len=512
    ),
    # The sink lab's model (configs/experiments/bb-*.yaml): one layer, one head, on the
    # Bigram-Backcopy task's 66 ids plus room for sink ids, with GPT-NeoX's sequential block
    # (the parallel one parks without needing the sink: README, the sink lab).
    "lab-1l": dict(
        name="lab-1l", vocab_size=72, n_layer=1, n_head=1, d_model=128, max_seq_len=128,
        use_parallel_residual=False,
    ),
    # 1.4M parameters: for tests and smoke runs that finish in seconds.
    "tiny-1m": dict(
        name="tiny-1m", vocab_size=4096, n_layer=2, n_head=4, d_model=128, max_seq_len=512
    ),
}
