"""Exact interop with transformers' GPTNeoXForCausalLM, in both directions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sinklm.models import CausalLM, ConfigError, ModelConfig  # noqa: E402
from sinklm.models.convert import (  # noqa: E402
    config_from_hf,
    from_hf_model,
    hf_config_from,
    to_hf_model,
)


def random_hf_model(hidden_act: str = "gelu", **changes) -> transformers.GPTNeoXForCausalLM:
    settings = dict(
        vocab_size=211, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=256, hidden_act=hidden_act, max_position_embeddings=128,
        rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    config = transformers.GPTNeoXConfig(**(settings | changes))
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():  # transformers zero-inits biases and norms; make every weight count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


TOKENS = torch.randint(0, 211, (2, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_transformers_into_ours(hidden_act: str, backend: str) -> None:
    hf_model = random_hf_model(hidden_act)
    ours = from_hf_model(hf_model, backend=backend).eval()
    assert ours.config.gelu_approximate == ("none" if hidden_act == "gelu" else "tanh")
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        got = ours(TOKENS)
    assert (got - expected).abs().max().item() < 1e-4


def test_ours_into_transformers() -> None:
    torch.manual_seed(2)
    ours = CausalLM(ModelConfig(
        vocab_size=211, n_layer=2, n_head=4, d_model=64, max_seq_len=128,
    )).eval()
    hf_model = to_hf_model(ours).eval()
    with torch.no_grad():
        diff = (hf_model(TOKENS).logits - ours(TOKENS)).abs().max().item()
    assert diff < 1e-4


def test_round_trip_through_saved_folder(tmp_path: Path) -> None:
    """save_pretrained writes Pythia's own layout; loading it back gives our logits."""
    torch.manual_seed(3)
    ours = CausalLM(ModelConfig.from_preset("tiny-1m", vocab_size=211)).eval()
    to_hf_model(ours).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    back = from_hf_model(loaded)
    assert back.config.rotary_pct == 0.25 and back.config.n_layer == ours.config.n_layer
    with torch.no_grad():
        assert (loaded(TOKENS).logits - ours(TOKENS)).abs().max().item() < 1e-4
        assert (back(TOKENS) - ours(TOKENS)).abs().max().item() < 1e-5


def test_pythia_style_state_dict_with_legacy_buffers() -> None:
    """Released Pythia checkpoints name the head ``embed_out`` and carry mask buffers."""
    hf_model = random_hf_model()
    state = {("embed_out.weight" if k == "lm_head.weight" else k): v
             for k, v in hf_model.state_dict().items()}
    state["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 128, 128, dtype=torch.bool)
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    from sinklm.models.convert import from_hf_state_dict

    ours = CausalLM(config_from_hf(hf_model.config))
    ours.load_state_dict(from_hf_state_dict(state), strict=True)
    with torch.no_grad():
        assert (ours(TOKENS) - hf_model(TOKENS).logits).abs().max().item() < 1e-4


def test_config_mapping() -> None:
    config = ModelConfig.from_preset("pythia-160m")
    hf_config = hf_config_from(config)
    assert hf_config.hidden_size == 768 and hf_config.intermediate_size == 3072
    assert hf_config.hidden_act == "gelu"  # exact erf GELU, as Pythia
    assert config_from_hf(hf_config).replace(name="pythia-160m") == config


def test_variants_without_a_gpt_neox_slot_are_refused() -> None:
    for softmax in ("softmax1", "sink_logit", "gated"):
        model = CausalLM(ModelConfig.from_preset("tiny-1m", attention={"softmax": softmax}))
        with pytest.raises(ConfigError, match="modeling code"):
            to_hf_model(model)


def test_non_gpt_neox_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="GPT-NeoX"):
        config_from_hf(transformers.GPT2Config())
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        config_from_hf(random_hf_model(tie_word_embeddings=True).config)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_sequential_residual_matches_transformers_both_ways(backend: str) -> None:
    """GPT-2's block (use_parallel_residual=False, the sink lab's model) as GPTNeoX has it."""
    hf_model = random_hf_model(use_parallel_residual=False)
    ours = from_hf_model(hf_model, backend=backend).eval()
    assert ours.config.use_parallel_residual is False
    back = to_hf_model(ours).eval()
    assert back.config.use_parallel_residual is False
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert (ours(TOKENS) - expected).abs().max().item() < 1e-4
        assert (back(TOKENS).logits - expected).abs().max().item() < 1e-4
    parallel = from_hf_model(random_hf_model(use_parallel_residual=True)).eval()
    with torch.no_grad():  # the same weights in the other block give other logits
        assert (parallel(TOKENS) - expected).abs().max().item() > 1e-2
