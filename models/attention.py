"""Attention kernels: one function per backend, all computing the same thing.

Queries ``q`` are [B, H, T, D] (rotary applied); keys and values ``k``, ``v`` are [B, H, S, D]
with S >= T: the S - T keys in front are cached, the last T belong to the queries. Query t sees
every key up to and including its own, i.e. the causal mask is aligned bottom-right.

``sink_logit`` ([H], or None) adds one term exp(sink_logit[h]) to each head's softmax
denominator: zeros give softmax-off-by-one (zero sink), a parameter gives gpt-oss's learned
sink. Fused kernels cannot add a bare term to the denominator, so they get it exactly as an
extra key: its score is sink_logit (the key lives in extra zero-padded dims, so
q'.k_sink = sink_logit / scale) and its value is zero. The gradient of sink_logit then flows
through an ordinary key tensor, which every backend differentiates.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ConfigError

try:  # flash-attn is optional: it needs CUDA.
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:
    flash_attn_func = None

# Head-dim padding for the sink key: fused kernels want head dims in multiples of 8.
SINK_PAD = 8


def check_backend_available(backend: str) -> None:
    """Raise at model construction if ``backend`` cannot run in this installation."""
    if backend == "flash" and flash_attn_func is None:
        raise ConfigError(
            "attention.backend='flash' needs the flash-attn package (CUDA only): "
            "install it with `pip install -e '.[flash]'`, or pick one of eager, sdpa, flex"
        )
    if backend == "flex":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as error:
            raise ConfigError(
                f"attention.backend='flex' needs torch>=2.5 FlexAttention ({error}); "
                "pick eager or sdpa"
            ) from error


def causal_mask(t: int, s: int, device: torch.device) -> Tensor:
    """Boolean [T, S] mask, True where query t may see key s (bottom-right aligned)."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The reference: explicit scores and probabilities. Returns (output, probabilities).

    With a sink, probabilities over the real keys sum to less than one; the rest went to the
    sink, whose value is zero.
    """
    t, s = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~causal_mask(t, s, q.device), float("-inf"))
    accumulate = torch.promote_types(scores.dtype, torch.float32)  # fp32 at least, fp64 kept
    if sink_logit is None:
        probs = torch.softmax(scores, dim=-1, dtype=accumulate)
    else:
        sink = sink_logit.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=accumulate)
        probs = probs[..., :-1]
    probs = probs.to(q.dtype)
    return probs @ v, probs


def _append_sink_key(
    q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad head dims by SINK_PAD and put a sink key (score = sink_logit, value 0) in front."""
    b, h, t, d = q.shape
    scale = 1.0 / math.sqrt(d)
    pad_q = q.new_zeros(b, h, t, SINK_PAD)
    pad_q[..., 0] = 1.0
    q = torch.cat([q, pad_q], dim=-1)
    k = F.pad(k, (0, SINK_PAD))
    v = F.pad(v, (0, SINK_PAD))
    # Sink key: zeros in the real dims, sink_logit / scale in the first padded dim.
    sink_score = (sink_logit / scale).to(k.dtype).view(h, 1)
    sink_key = torch.cat(
        [k.new_zeros(h, d), sink_score, k.new_zeros(h, SINK_PAD - 1)], dim=-1
    )
    k = torch.cat([sink_key.view(1, h, 1, -1).expand(b, h, 1, -1), k], dim=-2)
    v = torch.cat([v.new_zeros(b, h, 1, d + SINK_PAD), v], dim=-2)
    return q, k, v


class _CpuSinkAttention(torch.autograd.Function):
    """Sink softmax from SDPA's CPU flash kernel: y = o * sigmoid(lse - sink_logit).

    With the sink, each row's probabilities shrink by w = sigmoid(lse - sink_logit). The
    backward is the kernel's own, fed grad w*G and output y: its row term rowsum(dO * out)
    then equals the sink softmax's, so q, k, v get exact gradients; the sink logit's is
    -sum (G.y)(1 - w). Saves the padded-key copies of the generic path on CPU.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor,
        mask: Tensor | None, is_causal: bool, scale: float,
    ) -> Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        w = torch.sigmoid(lse - sink_logit.view(1, -1, 1).to(lse.dtype)).unsqueeze(-1)
        y = out * w.to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse, w, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, y, lse, w, mask = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            (grad * w.to(grad.dtype)).contiguous(), q, k, v, y, lse, 0.0, ctx.is_causal,
            attn_mask=mask, scale=ctx.scale,
        )
        d_sink = -((grad * y).sum(-1, keepdim=True) * (1 - w)).sum(dim=(0, 2, 3))
        return dq, dk, dv, d_sink, None, None, None


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None) -> Tensor:
    t, s = q.shape[-2], k.shape[-2]
    if sink_logit is None or q.device.type != "cpu":
        return sdpa_padded_sink_attention(q, k, v, sink_logit)
    mask = None
    if 1 < t < s:  # additive float mask: the CPU kernel takes masks in the input dtype
        mask = torch.zeros(t, s, dtype=q.dtype, device=q.device).masked_fill(
            ~causal_mask(t, s, q.device), float("-inf")
        )
    return _CpuSinkAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), sink_logit, mask, t == s and t > 1,
        1.0 / math.sqrt(q.shape[-1]),
    )


def sdpa_padded_sink_attention(
    q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None
) -> Tensor:
    """SDPA on any device; a sink, if any, enters as an extra key (see the module doc)."""
    d = q.shape[-1]
    if sink_logit is not None:
        q, k, v = _append_sink_key(q, k, v, sink_logit)
    t, s = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(d)
    if t == s:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif t == 1:  # one new token sees everything cached
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_mask(t, s, q.device), scale=scale
        )
    return out[..., :d]


@functools.lru_cache(maxsize=32)
def _flex_block_mask(t: int, s: int, device: str) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    offset = s - t

    def bottom_right_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return create_block_mask(bottom_right_causal, None, None, t, s, device=device)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None) -> Tensor:
    """FlexAttention, compiled on CUDA. On CPU it runs unfused and forward-only (torch's
    limit): use it there for checks, or compile the whole model."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    flex = _compiled_flex() if q.is_cuda else eager_flex
    d = q.shape[-1]
    if sink_logit is not None:
        q, k, v = _append_sink_key(q, k, v, sink_logit)
    t, s = q.shape[-2], k.shape[-2]
    block_mask = _flex_block_mask(t, s, str(q.device))
    out = flex(q, k, v, block_mask=block_mask, scale=1.0 / math.sqrt(d))
    return out[..., :d]


def flash_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None) -> Tensor:
    """flash-attn aligns the causal mask bottom-right when T < S, as we need."""
    assert flash_attn_func is not None, "check_backend_available() runs at construction"
    d = q.shape[-1]
    if sink_logit is not None:
        q, k, v = _append_sink_key(q, k, v, sink_logit)
    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        causal=True, softmax_scale=1.0 / math.sqrt(d),
    )
    return out.transpose(1, 2)[..., :d]


FUSED_KERNELS = {"sdpa": sdpa_attention, "flex": flex_attention, "flash": flash_attention}
