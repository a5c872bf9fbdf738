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
    block_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """`(out, lse)` of `[batch, seq, heads, head_dim]` CPU or CUDA tensors."""
    cfg = _kernels.config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    q, k, v = (_kernels.inner_unit(x) for x in (q, k, v))
    return _kernels.forward(cfg, q, k, v, key_padding_mask, cu_seqlens, (block_mask, block_size))


@attention.register_fake
def _(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window, *_masks):
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
    grad_lse: Optional[Tensor] = None,
    block_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)`: the gradients of `sum(out * grad_out) + sum(lse * grad_lse)`."""
    cfg = _kernels.config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    grad_out, q, k, v, out = (_kernels.inner_unit(x) for x in (grad_out, q, k, v, out))
    blocks = (block_mask, block_size)
    return _kernels.backward(cfg, grad_out, q, k, v, out, lse, key_padding_mask, cu_seqlens, grad_lse, blocks)


@attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, *_config_masks_and_grad_lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *spec, mask, cu, block_mask, block_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, block_mask)
    ctx.spec, ctx.cu, ctx.block_size = spec, cu, block_size


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, mask, block_mask = ctx.saved_tensors
    # No gradient for the config, the masks and the block size.
    none = (None,) * 10
    if grad_out is None and grad_lse is None:
        return (None, None, None, *none)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = attention_backward(
        grad_out, q, k, v, out, lse, *ctx.spec, mask, ctx.cu, grad_lse, block_mask, ctx.block_size
    )
    return (dq, dk, dv, *none)


attention.register_autograd(_backward, setup_context=_setup_context)
