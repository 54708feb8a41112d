"""Rotary angles stay fp32 in a bf16 model; the rotary module leaves ``nn.Module.apply`` alone."""

from __future__ import annotations

import torch
from torch import nn

from sinklm.models import CausalLM, ModelConfig

POSITIONS = torch.tensor([[0, 1, 1000, 4000, 8000]])
FP32_EPS = 2.0**-24  # unit roundoff of float32
BF16_EPS = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)


def config() -> ModelConfig:
    # Every head dim rotated: 16 frequencies, from 1 down to 10000^(-30/32).
    return ModelConfig(name="test", vocab_size=97, n_layer=1, n_head=2, d_model=64,
                       max_seq_len=64, rotary_pct=1.0)


def reference_cos_sin(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin and angle in float64 from the formula, laid out as [B, 1, T, rotary_dims]."""
    r = cfg.rotary_dims
    inv_freq = cfg.rotary_base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = POSITIONS.double()[..., None] * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    return angle.cos(), angle.sin(), angle


def test_bf16_model_keeps_fp32_rotary_angles() -> None:
    """At position 8000 a bf16 model's cos/sin are the fp32 model's rounded to bf16, and both
    are within rounding of a float64 hand computation (bf16 frequencies were 1.4 rad off)."""
    cfg = config()
    fp32 = CausalLM(cfg)
    bf16 = CausalLM(cfg).to(torch.bfloat16)
    round_trip = CausalLM(cfg).to(torch.bfloat16).to(torch.float32)
    cos64, sin64, angle = reference_cos_sin(cfg)
    # fp32 angle: the frequency and the product each rounded (and pow/div a few ulps), so a
    # few float32 ulps of the angle, plus the rounding of cos/sin themselves.
    fp32_error = 4 * angle * FP32_EPS + FP32_EPS

    for got32, want in zip(fp32.gpt_neox.rotary.cos_sin(POSITIONS, torch.float32),
                           (cos64, sin64), strict=True):
        assert got32.dtype == torch.float32
        assert ((got32.double() - want).abs() <= fp32_error).all()
    for got16, got32, want in zip(bf16.gpt_neox.rotary.cos_sin(POSITIONS, torch.bfloat16),
                                  fp32.gpt_neox.rotary.cos_sin(POSITIONS, torch.float32),
                                  (cos64, sin64), strict=True):
        assert got16.dtype == torch.bfloat16
        assert torch.equal(got16, got32.to(torch.bfloat16))
        bound = BF16_EPS * (want.abs() + fp32_error) + fp32_error
        assert ((got16.double() - want).abs() <= bound).all()
    for a, b in zip(round_trip.gpt_neox.rotary.cos_sin(POSITIONS, torch.float32),
                    fp32.gpt_neox.rotary.cos_sin(POSITIONS, torch.float32), strict=True):
        assert torch.equal(a, b)  # a bf16 round trip loses nothing either


def test_model_apply_reaches_every_module() -> None:
    """``model.apply(init_fn)`` (e.g. a custom initialisation) visits every module once."""
    model = CausalLM(config())
    seen: list[nn.Module] = []

    def init(module: nn.Module) -> None:
        seen.append(module)
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)

    assert model.apply(init) is model
    assert sorted(map(id, seen)) == sorted(map(id, model.modules()))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(bool((m.weight == 0.5).all()) for m in linears)
