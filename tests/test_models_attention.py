"""Attention variants and backends against independent float64 references; the K/V cache."""

from __future__ import annotations

import math

import pytest
import torch

from sinklm.models import CausalLM, KVCache, ModelConfig
from sinklm.models.attention import (
    eager_attention,
    flex_attention,
    sdpa_attention,
)

VARIANTS = ("softmax", "softmax1", "sink_logit", "gated")
CPU_BACKENDS = ("eager", "sdpa", "flex")
# FlexAttention has no CPU backward in torch (NotImplementedError); it runs forward here.
CPU_BACKWARD = ("eager", "sdpa")


def tiny_config(
    softmax: str = "softmax", backend: str = "eager", n_layer: int = 2
) -> ModelConfig:
    return ModelConfig(
        name="test", vocab_size=97, n_layer=n_layer, n_head=4, d_model=64, max_seq_len=64,
        attention={"softmax": softmax, "backend": backend},
    )


def make_model(softmax: str, backend: str = "eager", n_layer: int = 2) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(softmax, backend, n_layer)).double()
    with torch.no_grad():  # non-trivial sink logits and biases, so every term is exercised
        for name, param in model.named_parameters():
            if name.endswith(("sink_logit", "bias")):
                param.normal_(0.0, 1.0 if name.endswith("sink_logit") else 0.02)
    return model


def reference_attention(
    attn: torch.nn.Module, x: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """One attention layer written out by hand: per-head projections, complex-number rotary,
    explicit softmax with an extra denominator term, gate, output projection."""
    b, t, d = x.shape
    h, hd, r = config.n_head, config.head_dim, config.rotary_dims
    w = attn.query_key_value.weight.view(h, 3, hd, d)
    bias = attn.query_key_value.bias.view(h, 3, hd)
    q = torch.einsum("btd,hed->bhte", x, w[:, 0]) + bias[:, 0][None, :, None]
    k = torch.einsum("btd,hed->bhte", x, w[:, 1]) + bias[:, 1][None, :, None]
    v = torch.einsum("btd,hed->bhte", x, w[:, 2]) + bias[:, 2][None, :, None]

    def rotate(u: torch.Tensor) -> torch.Tensor:
        # GPT-NeoX pairs dim i with dim i + r/2; as a complex number that pair turns by pos*f_i.
        # f_i = base^(-2i/r), rounded to float32 as GPT-NeoX and transformers compute it.
        freqs = (config.rotary_base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)).float()
        freqs = freqs.double()
        angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]
        z = torch.complex(u[..., : r // 2], u[..., r // 2 : r]) * torch.polar(
            torch.ones_like(angle), angle
        )
        return torch.cat([z.real, z.imag, u[..., r:]], dim=-1)

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bhte,bhse->bhts", q, k) / math.sqrt(hd)
    sink = {"softmax1": torch.zeros(h, dtype=x.dtype)}.get(config.attention.softmax)
    if config.attention.softmax == "sink_logit":
        sink = attn.sink_logit
    out = torch.zeros(b, h, t, hd, dtype=x.dtype)
    for i in range(t):
        s = scores[:, :, i, : i + 1]
        m = s.max(dim=-1, keepdim=True).values
        if sink is not None:
            m = torch.maximum(m, sink.view(1, h, 1))
        e = torch.exp(s - m)
        denominator = e.sum(-1, keepdim=True)
        if sink is not None:
            denominator = denominator + torch.exp(sink.view(1, h, 1) - m)
        out[:, :, i] = torch.einsum("bhs,bhse->bhe", e / denominator, v[:, :, : i + 1])
    y = out.transpose(1, 2).reshape(b, t, d)
    if config.attention.softmax == "gated":
        y = y * torch.sigmoid(x @ attn.gate.weight.T + attn.gate.bias)
    return y @ attn.dense.weight.T + attn.dense.bias


@pytest.mark.parametrize("softmax", VARIANTS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_layer_matches_hand_reference(softmax: str, backend: str) -> None:
    model = make_model(softmax, backend)
    config = model.config
    torch.manual_seed(1)
    x = torch.randn(2, 11, config.d_model, dtype=torch.float64)
    positions = torch.arange(11).expand(2, 11)
    rope = model.gpt_neox.rotary.cos_sin(positions, x.dtype)
    attn = model.gpt_neox.layers[0].attention
    with torch.no_grad():
        ours, _, _ = attn(x, model.gpt_neox.rotary, rope, rope, None, False)
        expected = reference_attention(attn, x, config)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softmax", VARIANTS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_matches_eager_forward_and_backward(softmax: str, backend: str) -> None:
    reference = make_model(softmax, "eager")
    model = make_model(softmax, backend)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(tokens, -1, dims=1)

    def loss_and_grads(m: CausalLM) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = m(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return logits.detach(), {n: p.grad for n, p in m.named_parameters()}

    expected_logits, expected_grads = loss_and_grads(reference)
    if backend not in CPU_BACKWARD:
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), expected_logits, rtol=1e-9, atol=1e-9)
        return
    logits, grads = loss_and_grads(model)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-9, atol=1e-9)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-8, atol=1e-10, msg=name)
    if softmax == "sink_logit":  # the learned sink really receives gradient
        assert grads["gpt_neox.layers.0.attention.sink_logit"].abs().min() > 0


# sdpa_attention takes the CPU flash kernel's log-sum-exp path with a custom backward.
@pytest.mark.parametrize("kernel", [eager_attention, sdpa_attention])
@pytest.mark.parametrize("past", [0, 3])
def test_sink_logit_gradcheck(kernel, past: int) -> None:
    """Analytic gradients of q, k, v and the sink logit equal finite differences."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 4 + past, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 4 + past, 8, dtype=torch.float64, generator=g, requires_grad=True)
    sink = torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)

    def output(q, k, v, sink):
        result = kernel(q, k, v, sink)
        return result[0] if isinstance(result, tuple) else result

    assert torch.autograd.gradcheck(output, (q, k, v, sink))


def test_flex_kernel_matches_eager_with_cache() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 9, 16, dtype=torch.float64, generator=g)
    v = torch.randn(1, 2, 9, 16, dtype=torch.float64, generator=g)
    sink = torch.randn(2, dtype=torch.float64, generator=g)
    for s in (None, sink):
        torch.testing.assert_close(flex_attention(q, k, v, s), eager_attention(q, k, v, s)[0])


def test_softmax1_by_hand_and_stable_for_large_logits() -> None:
    """exp(x_i) / (1 + sum_j exp(x_j)) for one query, computed with Python floats."""
    for scale in (1.0, 300.0, -300.0, 1e4):
        scores = [0.5 * scale, -1.0 * scale, 2.0 * scale]
        # q . k_j / sqrt(3) = scores[j] with q = (sqrt(3), 0, 0) and k_j = (scores[j], 0, 0).
        q = torch.tensor([math.sqrt(3), 0.0, 0.0], dtype=torch.float64).view(1, 1, 1, 3)
        k = torch.zeros(1, 1, 3, 3, dtype=torch.float64)
        k[0, 0, :, 0] = torch.tensor(scores, dtype=torch.float64)
        v = torch.eye(3, dtype=torch.float64).view(1, 1, 3, 3)
        _, probs = eager_attention(q, k, v, torch.zeros(1, dtype=torch.float64))
        top = max([*scores, 0.0])
        denominator = math.exp(-top) + sum(math.exp(s - top) for s in scores)
        expected = [math.exp(s - top) / denominator for s in scores]
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.flatten(), torch.tensor(expected, dtype=torch.float64))
        sdpa_out = sdpa_attention(q, k, v, torch.zeros(1, dtype=torch.float64))
        assert torch.isfinite(sdpa_out).all()
        torch.testing.assert_close(sdpa_out.flatten(), torch.tensor(expected, dtype=torch.float64))


def test_eager_returns_probabilities_and_sink_mass() -> None:
    model = make_model("sink_logit")
    tokens = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    logits, probs = model.forward_with_attentions(tokens)
    torch.testing.assert_close(logits, model(tokens))
    assert len(probs) == 2 and probs[0].shape == (1, 4, 9, 9)
    row_sums = probs[0].sum(-1)
    assert torch.all(row_sums < 1) and torch.all(row_sums > 0)
    assert torch.all(probs[0].triu(diagonal=1) == 0)  # causal


@pytest.mark.parametrize("softmax", VARIANTS)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_cache_token_by_token_equals_full_forward(softmax: str, backend: str) -> None:
    model = make_model(softmax, backend)
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.config.n_layer)
        stepwise = torch.cat([model(tokens[:, i : i + 1], cache=cache) for i in range(13)], 1)
        chunked_cache = KVCache(model.config.n_layer)
        chunked = torch.cat(
            [model(tokens[:, :4], cache=chunked_cache), model(tokens[:, 4:], cache=chunked_cache)],
            dim=1,
        )
    torch.testing.assert_close(stepwise, full, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(chunked, full, rtol=1e-9, atol=1e-9)
    assert len(cache) == 13
    assert torch.equal(cache.positions, torch.arange(13).expand(2, 13))


@pytest.mark.parametrize("softmax", ["softmax", "sink_logit"])
def test_cache_positions_can_be_reassigned(softmax: str) -> None:
    """StreamingLLM's position shift: evict, renumber the kept keys 0..n-1, go on. In a
    one-layer model (whose keys depend on their own token only) that equals encoding the kept
    tokens afresh at those positions, since keys are cached before rotary."""
    model = make_model(softmax, "sdpa", n_layer=1)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    kept = torch.tensor([0, 1, 8, 9, 10])
    with torch.no_grad():
        cache = KVCache(model.config.n_layer)
        model(tokens[:, :11], cache=cache)
        cache.keep(kept)
        cache.positions = torch.arange(5).view(1, 5)
        shifted = model(tokens[:, 11:], position_ids=torch.tensor([[5]]), cache=cache)
        afresh = model(torch.cat([tokens[:, kept], tokens[:, 11:]], dim=1))[:, -1:]
    torch.testing.assert_close(shifted, afresh, rtol=1e-9, atol=1e-9)


def test_explicit_positions_shift_rotary() -> None:
    """Rotary scores depend on position differences only: shifting every position by a
    constant leaves the logits unchanged, while changing one position does not."""
    model = make_model("softmax", "sdpa")
    tokens = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        base = model(tokens)
        shifted = model(tokens, position_ids=torch.arange(100, 108).view(1, 8))
        jumbled = model(tokens, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 40]]))
    torch.testing.assert_close(shifted, base, rtol=1e-7, atol=1e-7)
    assert (jumbled[:, -1] - base[:, -1]).abs().max() > 1e-3
