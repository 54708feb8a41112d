"""The sink variants' log-sum-exp path (y = out * sigmoid(lse - sink_logit) around a fused
kernel's forward and backward) against the eager reference and hand computations; the CUDA
kernel pairs' call signatures on meta tensors; the shared softmax with a sink column."""

from __future__ import annotations

import math

import pytest
import torch

from sinklm.models import ModelConfig
from sinklm.models.attention import (
    CpuFlashKernel,
    CudaEfficientKernel,
    CudaFlashKernel,
    SinkKernel,
    _bottom_right_bias,
    _SinkAttention,
    eager_attention,
    flex_attention,
    sdpa_attention,
    sink_kernel,
    sink_softmax,
)
from sinklm.models.model import Attention

# (T, S): one causal block, one new token against a cache, a chunk against a cache.
SHAPES = [(7, 7), (1, 9), (4, 9)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def inputs(t: int, s: int, dtype: torch.dtype, sink: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=dtype) for n in (t, s, s))
    if sink == "softmax1":  # the zero sink: a buffer, no gradient
        sink_logit = torch.zeros(3, dtype=dtype)
    else:
        sink_logit = torch.randn(3, generator=g, dtype=dtype).requires_grad_()
    return [x.requires_grad_() for x in (q, k, v)], sink_logit


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("t", "s"), SHAPES)
@pytest.mark.parametrize("sink", ["softmax1", "sink_logit"])
def test_lse_path_matches_eager_forward_and_backward(
    dtype: torch.dtype, t: int, s: int, sink: str
) -> None:
    (q, k, v), sink_logit = inputs(t, s, dtype, sink)
    leaves = [q, k, v] + ([sink_logit] if sink_logit.requires_grad else [])
    assert isinstance(sink_kernel(q, k, v), CpuFlashKernel)
    y = sdpa_attention(q, k, v, sink_logit)
    assert type(y.grad_fn).__name__ == "_SinkAttentionBackward"  # the lse path, not eager
    expected = eager_attention(q, k, v, sink_logit)[0]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    got = torch.autograd.grad(y, leaves, grad)
    want = torch.autograd.grad(expected, leaves, grad)
    for name, a, b in zip(["q", "k", "v", "sink_logit"], got, want, strict=False):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_sink_logit_gradient_by_hand() -> None:
    """One query, two keys: d y / d sink_logit = -p_sink * y, with p_sink computed by hand."""
    q = torch.tensor([[[[2.0, 0.0]]]], dtype=torch.float64)  # scores q.k / sqrt(2)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0, -1.0], [0.5, 2.0]]]], dtype=torch.float64)
    sink_logit = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    y = sdpa_attention(q, k, v, sink_logit)
    e = [math.exp(2 / math.sqrt(2)), 1.0, math.exp(0.3)]  # two keys, then the sink
    z = sum(e)
    y_hand = [(e[0] * 3.0 + e[1] * 0.5) / z, (e[0] * -1.0 + e[1] * 2.0) / z]
    torch.testing.assert_close(y.flatten(), torch.tensor(y_hand, dtype=torch.float64))
    (d_sink,) = torch.autograd.grad(y.sum(), sink_logit)
    assert d_sink.item() == pytest.approx(-(e[2] / z) * sum(y_hand), rel=1e-12)


@pytest.mark.parametrize(("t", "s"), SHAPES)
def test_flex_lse_path_matches_eager(t: int, s: int) -> None:
    """FlexAttention's lse gives the sink too (forward only: torch has no CPU backward)."""
    tensors, sink_logit = inputs(t, s, torch.float64, "sink_logit")
    q, k, v = (x.detach() for x in tensors)
    torch.testing.assert_close(flex_attention(q, k, v, sink_logit.detach()),
                               eager_attention(q, k, v, sink_logit.detach())[0])


def test_lse_path_under_cpu_autocast() -> None:
    """Under autocast rotary leaves q, k in fp32 and v in bf16; the kernel gets one dtype."""
    (q, k, v), sink_logit = inputs(5, 8, torch.float32, "sink_logit")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sdpa_attention(q, k, v.bfloat16(), sink_logit)
    assert y.dtype == torch.bfloat16
    expected = eager_attention(q, k, v, sink_logit)[0]
    torch.testing.assert_close(y.float(), expected, rtol=3e-2, atol=3e-2)
    y.float().sum().backward()
    assert sink_logit.grad is not None and torch.isfinite(sink_logit.grad).all()


def test_bottom_right_bias_is_the_causal_mask_with_aligned_rows() -> None:
    q = torch.zeros(2, 3, 4, 8, dtype=torch.float32)
    bias = _bottom_right_bias(q, 9)
    assert bias.shape == (2, 3, 4, 9) and bias.dtype == q.dtype
    assert bias.stride(2) % 16 == 0 and bias.stride(3) == 1
    for i in range(4):  # query i sits at position 5 + i and sees keys 0..5 + i
        for j in range(9):
            assert bias[1, 2, i, j].item() == (0.0 if j <= 5 + i else float("-inf"))


# --- the CUDA kernel pairs, on meta tensors: argument order and shapes, no GPU ----------------


def cuda_kernels(t: int, s: int, q: torch.Tensor) -> list[SinkKernel]:
    """The pairs sink_kernel picks on CUDA for this shape (flash for T == S or T == 1)."""
    scale, causal = 0.25, t == s and t > 1
    efficient = CudaEfficientKernel(scale, causal, _bottom_right_bias(q, s) if 1 < t < s else None)
    return [CudaFlashKernel(scale, causal), efficient] if t in (1, s) else [efficient]


@pytest.mark.parametrize(("t", "s"), SHAPES)
def test_cuda_kernel_pairs_on_meta_tensors(t: int, s: int) -> None:
    b, h, d = 2, 4, 64
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q = torch.empty(b, h, t, d, **meta)
    k, v = torch.empty(b, h, s, d, **meta), torch.empty(b, h, s, d, **meta)
    for kernel in cuda_kernels(t, s, q):
        try:
            run = kernel.forward(q, k, v)
            dq, dk, dv = kernel.backward(run.out, run)
            out, lse = run.out, run.lse
        except NotImplementedError as error:
            pytest.skip(f"this torch has no meta kernel for {type(kernel).__name__}: {error}")
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape[:2] == (b, h) and lse.shape[2] >= t and lse.dtype == torch.float32
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        # The autograd function around it: lse sliced to T, the sink logit's gradient.
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        sink_logit = torch.zeros(h, device="meta", requires_grad=True)
        y = _SinkAttention.apply(*leaves, sink_logit, kernel)
        assert y.shape == q.shape
        grads = torch.autograd.grad(y, [*leaves, sink_logit], torch.empty_like(y))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (h,)]
        assert grads[3].dtype == sink_logit.dtype


# --- the shared softmax and the Attention's shared steps ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_sink_softmax_by_hand(dtype: torch.dtype, in_place: bool) -> None:
    """exp(x_j) / (exp(sink) + sum_i exp(x_i)) per row, the sink's share in column 0."""
    rows = [[0.5, -1.0, 2.0], [3.0, 0.0, float("-inf")]]
    sinks = [0.0, -0.7]
    scores = torch.tensor([[9.0, *r] for r in rows], dtype=dtype)  # column 0: overwritten
    sink = torch.tensor(sinks).view(2)
    weights = sink_softmax(scores, sink, out=scores if in_place else None)
    assert weights.dtype == dtype and (weights is scores) == in_place
    for row, s, got in zip(rows, sinks, weights.double().tolist(), strict=True):
        z = math.exp(s) + sum(math.exp(x) for x in row)
        want = [math.exp(s) / z] + [math.exp(x) / z for x in row]
        assert got == pytest.approx(want, rel=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_attention_heads_and_output_on_unbatched_rows() -> None:
    """The fast path calls heads/output on [T, d] rows, the model on [B, T, d]: GPT-NeoX's
    per-head [q_h, k_h, v_h] layout by hand, and the gated output written out."""
    torch.manual_seed(0)
    config = ModelConfig(name="test", vocab_size=97, n_layer=1, n_head=4, d_model=64,
                         max_seq_len=64, attention={"softmax": "gated"})
    attn = Attention(config).double()
    x = torch.randn(5, 64, dtype=torch.float64)
    weight, bias = attn.query_key_value.weight, attn.query_key_value.bias
    for part, got in enumerate(attn.heads(x)):
        assert got.shape == (4, 5, 16)
        for h in range(4):
            rows = slice(h * 48 + part * 16, h * 48 + part * 16 + 16)
            torch.testing.assert_close(got[h], x @ weight[rows].T + bias[rows])
    y = torch.randn(4, 5, 16, dtype=torch.float64)
    merged = torch.cat(list(y), dim=-1)  # [T, H * D], head after head
    gated = merged * torch.sigmoid(x @ attn.gate.weight.T + attn.gate.bias)
    expected = gated @ attn.dense.weight.T + attn.dense.bias
    torch.testing.assert_close(attn.output(y, x), expected)
    torch.testing.assert_close(attn.output(y[None], x[None])[0], expected)
