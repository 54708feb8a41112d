"""Attention kernels: one function per backend, all computing the same thing.

Queries ``q`` are [B, H, T, D] (rotary applied); keys and values ``k``, ``v`` are [B, H, S, D]
with S >= T: the S - T keys in front are cached, the last T belong to the queries. Query t sees
every key up to and including its own, i.e. the causal mask is aligned bottom-right.

``sink_logit`` ([H], or None) adds one term exp(sink_logit[h]) to each head's softmax
denominator: zeros give softmax-off-by-one (zero sink), a parameter gives gpt-oss's learned
sink. The variant math lives in one place each: :func:`sink_softmax` turns scores into weights
(the sink as a leading score column whose value is zero), used by :func:`eager_attention` and
by the streaming evaluator's fast path; the head split and the output side (gate, projection)
are methods of ``models.model.Attention``.

Fused kernels cannot add a bare term to the denominator, but they return each row's
log-sum-exp ``lse`` of the scores: the sink softmax is the plain one scaled by
w = sigmoid(lse - sink_logit), so y = out * w. :class:`_SinkAttention` does this for any
:class:`SinkKernel` (a forward giving out and lse, and the kernel's own backward), picked per
device and shape by :func:`sink_kernel`: SDPA's flash kernel on CPU and, in fp16/bf16, on CUDA;
on CUDA otherwise, or for 1 < T < S, the memory-efficient kernel with a bottom-right bias. The
``flash`` backend takes the same path for sink variants (torch's bundled FlashAttention-2: the
flash-attn package's own forward-with-lse and backward are private functions whose signature
changed between 2.5 and 2.7); ``flex`` asks FlexAttention for its lse, which autograd
differentiates. Inputs no fused kernel takes (fp64 on CUDA, other devices) get the eager path.
SDPA's kernels that return the lse are private torch ops, called through ``compat.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .compat import (
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cuda_flash_attention,
    cuda_flash_attention_backward,
    efficient_attention,
    efficient_attention_backward,
)
from .config import ConfigError

try:  # flash-attn is optional: it needs CUDA.
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:
    flash_attn_func = None


def check_backend_available(backend: str) -> None:
    """Raise at model construction if ``backend`` cannot run in this installation."""
    if backend == "flash" and flash_attn_func is None:
        raise ConfigError(
            "attention.backend='flash' needs the flash-attn package (CUDA only): "
            "install it with `pip install -e '.[flash]'`, or pick one of eager, sdpa, flex"
        )
    if backend == "flex":
        try:  # AuxRequest: how FlexAttention returns the lse that the sink variants need
            from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
        except ImportError as error:
            raise ConfigError(
                f"attention.backend='flex' needs torch>=2.9 FlexAttention ({error}); "
                "pick eager or sdpa"
            ) from error


def causal_mask(t: int, s: int, device: torch.device) -> Tensor:
    """Boolean [T, S] mask, True where query t may see key s (bottom-right aligned)."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def sink_softmax(scores: Tensor, sink: Tensor | None, out: Tensor | None = None) -> Tensor:
    """Attention weights of ``scores`` [..., S]; with a sink, [..., 1 + S] whose column 0 is
    the sink's slot: ``sink`` (its logit, broadcast over ``scores[..., 0]``) is written there,
    so the S keys' weights sum to less than one, the rest going to a key whose value is zero.

    The softmax accumulates in fp32 at least (fp64 stays fp64), as the fused kernels do; the
    weights come back in the scores' dtype, into ``out`` if given (``scores``: in place).
    """
    if sink is not None:
        scores[..., 0] = sink
    accumulate = torch.promote_types(scores.dtype, torch.float32)
    if accumulate == scores.dtype:
        return torch.softmax(scores, dim=-1, out=out)
    weights = torch.softmax(scores, dim=-1, dtype=accumulate)
    return weights.to(scores.dtype) if out is None else out.copy_(weights)


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
    if sink_logit is None:
        probs = sink_softmax(scores, None)
    else:  # a leading column for the sink
        probs = sink_softmax(F.pad(scores, (1, 0)), sink_logit.view(-1, 1))[..., 1:]
    return probs @ v, probs


def _sink_weight(lse: Tensor, sink_logit: Tensor, t: int) -> Tensor:
    """w = sigmoid(lse - sink_logit) [B, H, T, 1]: the share of each row's softmax mass that
    its keys keep once exp(sink_logit) joins the denominator (``lse`` may be padded past T)."""
    return torch.sigmoid(lse[..., :t] - sink_logit.view(1, -1, 1).to(lse.dtype)).unsqueeze(-1)


def _autocast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in autocast's dtype when it is on: it reaches F.scaled_dot_product_attention but
    not the kernels called here, and rotary leaves q and k in fp32 while v is bf16."""
    if not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


class Attended(NamedTuple):
    """A fused kernel's forward: its inputs, output, each row's log-sum-exp of the scores
    ([B, H, >= T], fp32 at least) and any further tensors its backward needs."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    extra: tuple[Tensor, ...] = ()


Grads = tuple[Tensor, Tensor, Tensor]


class SinkKernel(Protocol):
    """A fused attention's forward, which also gives each row's lse, and that kernel's own
    backward: (dq, dk, dv) of its softmax attention for output gradient ``grad``."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Attended: ...

    def backward(self, grad: Tensor, run: Attended) -> Grads: ...


@dataclass(frozen=True)
class CpuFlashKernel:
    """SDPA's CPU flash kernel. Its causal mask is top-left aligned, so 1 < T < S takes an
    additive mask (in the input dtype, which the kernel wants) instead."""

    scale: float
    is_causal: bool
    mask: Tensor | None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Attended:
        out, lse = cpu_flash_attention(q, k, v, self.is_causal, self.mask, self.scale)
        return Attended(q, k, v, out, lse)

    def backward(self, grad: Tensor, run: Attended) -> Grads:
        q, k, v, out, lse, _ = run
        return cpu_flash_attention_backward(
            grad, q, k, v, out, lse, self.is_causal, self.mask, self.scale
        )


@dataclass(frozen=True)
class CudaFlashKernel:
    """FlashAttention-2 as torch ships it (fp16/bf16, head dim a multiple of 8): causal for
    T == S, unmasked for T == 1. 1 < T < S takes the efficient kernel's explicit mask instead:
    SDPA documents is_causal as top-left aligned (this op aligns it bottom-right, which torch's
    CausalBias relies on, but no document promises it)."""

    scale: float
    is_causal: bool

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Attended:
        out, lse, seed, offset = cuda_flash_attention(q, k, v, self.is_causal, self.scale)
        return Attended(q, k, v, out, lse, (seed, offset))

    def backward(self, grad: Tensor, run: Attended) -> Grads:
        q, k, v, out, lse, (seed, offset) = run
        return cuda_flash_attention_backward(
            grad, q, k, v, out, lse, seed, offset, self.is_causal, self.scale
        )


@dataclass(frozen=True)
class CudaEfficientKernel:
    """The memory-efficient kernel (fp32 too): causal for T == S, ``bias`` (an additive
    bottom-right mask, :func:`_bottom_right_bias`) for 1 < T < S. Its lse is padded along T."""

    scale: float
    is_causal: bool
    bias: Tensor | None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Attended:
        out, lse, seed, offset = efficient_attention(
            q, k, v, self.bias, self.is_causal, self.scale
        )
        return Attended(q, k, v, out, lse, (seed, offset))

    def backward(self, grad: Tensor, run: Attended) -> Grads:
        q, k, v, out, lse, (seed, offset) = run
        return efficient_attention_backward(
            grad, q, k, v, self.bias, out, lse, seed, offset, self.is_causal, self.scale
        )


def _bottom_right_bias(q: Tensor, s: int) -> Tensor:
    """The causal mask as an additive bias [B, H, T, S] in q's dtype. Rows are padded to 16
    elements, as SDPA pads its masks: the memory-efficient kernel wants aligned rows."""
    b, h, t, _ = q.shape
    rows = q.new_zeros(t, -(-s // 16) * 16)
    rows[:, :s].masked_fill_(~causal_mask(t, s, q.device), float("-inf"))
    return rows[:, :s].expand(b, h, t, s)


def sink_kernel(q: Tensor, k: Tensor, v: Tensor) -> SinkKernel | None:
    """The fused kernel for these inputs, or None where none applies (fp64 on CUDA, devices
    other than CPU and CUDA)."""
    t, s = q.shape[-2], k.shape[-2]
    scale, is_causal = 1.0 / math.sqrt(q.shape[-1]), t == s and t > 1
    if q.device.type == "cpu":
        mask = None
        if 1 < t < s:
            mask = torch.zeros(t, s, dtype=q.dtype, device=q.device).masked_fill(
                ~causal_mask(t, s, q.device), float("-inf")
            )
        return CpuFlashKernel(scale, is_causal, mask)
    if q.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
        if ((t == s or t == 1) and q.shape[-1] % 8 == 0
                and torch.backends.cuda.can_use_flash_attention(params)):
            return CudaFlashKernel(scale, is_causal)
        if torch.backends.cuda.can_use_efficient_attention(params):
            bias = _bottom_right_bias(q, s) if 1 < t < s else None
            return CudaEfficientKernel(scale, is_causal, bias)
    return None


class _SinkAttention(torch.autograd.Function):
    """y = out * w with w = sigmoid(lse - sink_logit), from a :class:`SinkKernel`.

    The sink shrinks each row's probabilities by w. The backward is the kernel's own, fed grad
    w*G and output y: its row term rowsum(dO * out) then equals the sink softmax's, so q, k, v
    get exact gradients; the sink logit's is -sum (G.y)(1 - w).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor, kernel: SinkKernel
    ) -> Tensor:
        run = kernel.forward(q, k, v)
        w = _sink_weight(run.lse, sink_logit, q.shape[-2])
        y = run.out * w.to(run.out.dtype)
        ctx.save_for_backward(q, k, v, y, run.lse, w, *run.extra)
        ctx.kernel, ctx.sink_dtype = kernel, sink_logit.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, y, lse, w, *extra = ctx.saved_tensors
        run = Attended(q, k, v, y, lse, tuple(extra))  # y for out: see the class docstring
        dq, dk, dv = ctx.kernel.backward(grad * w.to(grad.dtype), run)
        d_sink = None
        if ctx.needs_input_grad[3]:  # softmax1's zero sink is a buffer
            accumulate = torch.promote_types(grad.dtype, torch.float32)
            row = (grad.to(accumulate) * y.to(accumulate)).sum(-1, keepdim=True)
            d_sink = -(row * (1 - w)).sum(dim=(0, 2, 3)).to(ctx.sink_dtype)
        return dq, dk, dv, d_sink, None


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor) -> Tensor:
    """Attention with the sink term: the lse form of a fused kernel, else the eager path."""
    q, k, v = _autocast(q, k, v)
    kernel = sink_kernel(q, k, v)
    if kernel is None:
        return eager_attention(q, k, v, sink_logit)[0]
    return _SinkAttention.apply(q, k, v, sink_logit, kernel)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None) -> Tensor:
    """F.scaled_dot_product_attention; a sink through :func:`sink_attention`."""
    if sink_logit is not None:
        return sink_attention(q, k, v, sink_logit)
    t, s = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if t == 1:  # one new token sees everything cached
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_mask(t, s, q.device), scale=scale
    )


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
    limit): use it there for checks, or compile the whole model. A sink scales the output by
    the w of FlexAttention's lse, which autograd differentiates: no custom backward."""
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    flex = _compiled_flex() if q.is_cuda else eager_flex
    q, k, v = _autocast(q, k, v)
    t, s = q.shape[-2], k.shape[-2]
    block_mask = _flex_block_mask(t, s, str(q.device))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if sink_logit is None:
        return flex(q, k, v, block_mask=block_mask, scale=scale)
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    return out * _sink_weight(aux.lse, sink_logit, t).to(out.dtype)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, sink_logit: Tensor | None) -> Tensor:
    """flash-attn, whose causal mask is aligned bottom-right when T < S, as we need. A sink goes
    through :func:`sink_attention` (torch's FlashAttention-2: flash-attn's own forward with lse
    and backward are private, their signature changed between its releases 2.5 and 2.7)."""
    assert flash_attn_func is not None, "check_backend_available() runs at construction"
    if sink_logit is not None:
        return sink_attention(q, k, v, sink_logit)
    q, k, v = _autocast(q, k, v)
    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        causal=True, softmax_scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return out.transpose(1, 2)


FUSED_KERNELS = {"sdpa": sdpa_attention, "flex": flex_attention, "flash": flash_attention}
