"""The op registered with `torch.library` (`torch.ops.attn_dilated.attention` and its
backward), so `torch.compile` traces through it without a graph break: a fake
implementation gives output shapes (and validates the config) at trace time, and the
autograd formula runs the kernels' exact backward from the saved output and LSE.

No `from __future__ import annotations` here: `custom_op` reads the schema from the
annotations."""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _kernels


@torch.library.custom_op("attn_dilated::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segment_lengths: List[int],
    dilation_rates: List[int],
    is_causal: bool,
    softmax_scale: Optional[float],
    mixing: str,
    window: Optional[List[int]],
    key_padding_mask: Optional[Tensor],
    cu_seqlens: Optional[List[int]],
) -> Tuple[Tensor, Tensor]:
    """`(out, lse)` of `[batch, seq, heads, head_dim]` CPU or CUDA tensors."""
    cfg = _kernels.config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    q, k, v = (_kernels.inner_unit(x) for x in (q, k, v))
    return _kernels.forward(cfg, q, k, v, key_padding_mask, cu_seqlens)


@attention.register_fake
def _(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window, key_padding_mask, cu_seqlens):
    _kernels.config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    b, n, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, n, h), dtype=torch.float32)


@torch.library.custom_op("attn_dilated::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segment_lengths: List[int],
    dilation_rates: List[int],
    is_causal: bool,
    softmax_scale: Optional[float],
    mixing: str,
    window: Optional[List[int]],
    key_padding_mask: Optional[Tensor],
    cu_seqlens: Optional[List[int]],
) -> Tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)`: the gradients of `sum(out * grad_out)`."""
    cfg = _kernels.config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    grad_out, q, k, v, out = (_kernels.inner_unit(x) for x in (grad_out, q, k, v, out))
    return _kernels.backward(cfg, grad_out, q, k, v, out, lse, key_padding_mask, cu_seqlens)


@attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, *_config_and_masks):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *spec, mask, cu = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.spec, ctx.cu = spec, cu
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    none = (None,) * 8
    if grad_out is None:
        return (None, None, None, *none)
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, *ctx.spec, mask, ctx.cu)
    return (dq, dk, dv, *none)


attention.register_autograd(_backward, setup_context=_setup_context)


LSE_GRADIENT_MESSAGE = (
    "attn_dilated: a gradient reached the LSE returned by dilated_attention_with_lse, but gradient "
    "through the LSE is not supported: the kernels' backward takes the output's gradient only, so a "
    "result computed from the LSE (partial results merged by their LSEs, a loss of the LSE) would get "
    "wrong gradients. Where only the LSE's value is needed (logging, inspection), use lse.detach()."
)


@torch.library.custom_op("attn_dilated::lse_gradient_check", mutates_args=())
def lse_gradient_check(grad_lse: Tensor, dtype: torch.dtype) -> Tensor:
    """NotImplementedError where `grad_lse` (the gradient that reached the LSE) has a
    nonzero entry; otherwise a 0-d zero of `dtype`, the output's (zero) share of it.

    An op, so that the check runs when the backward does, compiled or not: a compiled
    backward receives a zero gradient for an LSE it returned that nothing used, so only
    the values tell a gradient from none, and they are known at run time only."""
    if bool(grad_lse.ne(0).any()):
        raise NotImplementedError(LSE_GRADIENT_MESSAGE)
    return grad_lse.new_zeros((), dtype=dtype)


@lse_gradient_check.register_fake
def _(grad_lse, dtype):
    return grad_lse.new_empty((), dtype=dtype)


class GuardLse(torch.autograd.Function):
    """`lse` (a copy) made part of `out`'s graph, so that it requires grad where `out`
    does and a gradient reaching it is checked ([`lse_gradient_check`]). The backward
    runs only where the LSE is part of what is differentiated; its result, zero, goes to
    `out` so that a compiled backward keeps the check."""

    @staticmethod
    def forward(lse: Tensor, out: Tensor) -> Tensor:
        # A copy, not a view: the caller may modify the LSE in place.
        return lse.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, out = inputs
        ctx.out_shape, ctx.out_dtype = out.shape, out.dtype

    @staticmethod
    def backward(ctx, grad_lse):
        return None, lse_gradient_check(grad_lse, ctx.out_dtype).expand(ctx.out_shape)
