"""Presets, parameter counts, initialisation, configuration errors and `sinklm info`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sinklm.cli.info import count_params
from sinklm.cli.main import main as sinklm_main
from sinklm.models import CausalLM, ConfigError, ModelConfig

# The released Pythia models' parameter counts (vanilla; embedding padded to 50304 rows).
PYTHIA_PARAMS = {
    "pythia-14m": 14_067_712,
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
}


@pytest.mark.parametrize(("preset", "expected"), PYTHIA_PARAMS.items())
def test_pythia_parameter_counts(preset: str, expected: int) -> None:
    assert count_params(ModelConfig.from_preset(preset)) == expected


def test_parameter_count_by_hand() -> None:
    """12 d^2 + 13 d per layer, two embeddings, final norm: Pythia-160M by hand."""
    d, n_layer, vocab = 768, 12, 50304
    per_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    assert 2 * vocab * d + n_layer * per_layer + 2 * d == PYTHIA_PARAMS["pythia-160m"]


def test_variant_parameters() -> None:
    base = ModelConfig.from_preset("pythia-160m")
    n_layer, n_head, d = base.n_layer, base.n_head, base.d_model
    assert count_params(base.replace(attention={"softmax": "softmax1"})) == count_params(base)
    assert count_params(base.replace(attention={"softmax": "sink_logit"})) == (
        count_params(base) + n_layer * n_head
    )
    assert count_params(base.replace(attention={"softmax": "gated"})) == (
        count_params(base) + n_layer * (d * d + d)
    )
    # Sink tokens are rows of the padded embedding: the shape (and count) stay Pythia's.
    assert count_params(base.replace(sink_tokens=2)) == count_params(base)


def test_named_variants() -> None:
    zero = ModelConfig.from_preset("pythia-160m", variant="zero_sink")
    token = ModelConfig.from_preset("pythia-160m", variant="sink_token")
    assert (zero.attention.softmax, zero.sink_tokens) == ("softmax1", 0)
    assert (token.attention.softmax, token.sink_tokens) == ("softmax", 1)


def test_pythia_initialisation() -> None:
    config = ModelConfig(vocab_size=4096, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = CausalLM(config)
    small = math.sqrt(2 / (5 * 512))
    wang = 2 / (4 * math.sqrt(512))
    block = model.gpt_neox.layers[0]
    for weight, std in [
        (model.gpt_neox.embed_in.weight, small),
        (model.embed_out.weight, small),
        (block.attention.query_key_value.weight, small),
        (block.mlp.dense_h_to_4h.weight, small),
        (block.attention.dense.weight, wang),
        (block.mlp.dense_4h_to_h.weight, wang),
    ]:
        assert weight.std().item() == pytest.approx(std, rel=0.02)
    assert torch.all(block.attention.query_key_value.bias == 0)
    assert torch.all(block.input_layernorm.weight == 1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_head": 5}, "n_head"),
        ({"rotary_pct": 1.5}, "rotary_pct"),
        ({"rotary_pct": -0.1}, "rotary_pct"),
        ({"attention": {"softmax": "softmax2"}}, "attention.softmax"),
        ({"attention": {"backend": "cuda"}}, "attention.backend"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"gelu_approximate": "erf"}, "gelu_approximate"),
        ({"d_model": 0}, "d_model"),
    ],
)
def test_bad_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_preset("tiny-1m", **changes)


def test_flash_without_flash_attn_fails_at_construction() -> None:
    pytest.importorskip("torch")
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    config = ModelConfig.from_preset("tiny-1m", attention={"backend": "flash"})
    with pytest.raises(ConfigError, match="flash-attn"):
        CausalLM(config)


def test_unknown_dict_keys_rejected() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        ModelConfig.from_dict({"n_heads": 4})


def test_config_round_trips_through_dict() -> None:
    config = ModelConfig.from_preset("pythia-70m", variant="sink_logit")
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_cli_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert sinklm_main(["info", "pythia-160m"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "pythia-160m"
    assert out["params"] == PYTHIA_PARAMS["pythia-160m"]
    assert out["config"]["attention"] == {"softmax": "softmax", "backend": "sdpa"}
    assert ModelConfig.from_dict(out["config"]) == ModelConfig.from_preset("pythia-160m")


def test_cli_info_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert sinklm_main(["info", "--list"]) == 0
    listed = {row["name"]: row["params"] for row in json.loads(capsys.readouterr().out)["presets"]}
    for name, params in PYTHIA_PARAMS.items():
        assert listed[name] == params
    assert "tiny-1m" in listed


def test_cli_info_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert sinklm_main(["info", "pythia-999m"]) == 2
    assert "pythia-160m" in capsys.readouterr().err


def test_training_flops_per_token_by_hand() -> None:
    """Pythia-160M at seq 2048: 6 x (85M block weights + 38.6M head) + 12 x 12 x 2048 x 768."""
    config = ModelConfig.from_preset("pythia-160m")
    block_weights = 12 * (12 * 768 * 768)
    head = 768 * 50304
    expected = 6 * (block_weights + head) + 12 * 12 * 2048 * 768
    assert config.training_flops_per_token(2048) == expected
    assert 0.95e9 < expected < 1.0e9  # ~0.97 GFLOP per token: the figure MFU papers quote


def test_a_stream_cache_keeps_the_sink_ids_and_fills_the_context_with_the_query() -> None:
    """The default start+recent sizes: the sink ids (4 without) + the rest of the context
    less the query's slot, so that cache and query together are the trained context."""
    small = {"vocab_size": 97, "n_layer": 1, "n_head": 1, "d_model": 8}
    assert ModelConfig(**small, max_seq_len=16, sink_tokens=1).stream_cache() == (1, 14)
    assert ModelConfig(**small, max_seq_len=16, sink_tokens=2).stream_cache() == (2, 13)
    assert ModelConfig(**small, max_seq_len=2048).stream_cache() == (4, 2043)
    assert ModelConfig(**small, max_seq_len=3).stream_cache() == (2, 0)


def test_a_changed_preset_is_named_by_what_it_is() -> None:
    # The preset's own values and the variant's axes leave the name alone; a changed network
    # field enters it, in the order given.
    assert ModelConfig.from_preset("lab-1l", "sink_token").name == "lab-1l"
    assert ModelConfig.from_preset("lab-1l", "vanilla", use_parallel_residual=False,
                                   n_head=1).name == "lab-1l"
    config = ModelConfig.from_preset("lab-1l", "vanilla", n_layer=2, learned_positions=True,
                                     use_parallel_residual=True)
    assert config.name == "lab-1l+n_layer=2+learned_positions+use_parallel_residual"
    assert config.n_layer == 2 and config.learned_positions
    assert ModelConfig.from_preset("tiny-1m", learned_positions=False, d_model=64,
                                   attention={"backend": "eager"}).name == "tiny-1m+d_model=64"
    assert ModelConfig.from_preset("tiny-1m", n_layer=3, name="mine").name == "mine"
    with pytest.raises(ConfigError, match=r"unknown model config keys \['n_layers'\]"):
        ModelConfig.from_preset("lab-1l", n_layers=2)
