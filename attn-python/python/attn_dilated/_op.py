"""The dilated attention op: argument checks, the hand-over of tensors to the Rust
kernels (address, shape and strides, no copies), and the autograd function whose
backward runs the exact backward from the forward's saved output and LSE."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import _native

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MIXINGS = ("head_groups", "longnet", "window")

Window = Tuple[int, int]
CuSeqlens = Union[torch.Tensor, Sequence[int]]


def make_config(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    mixing: str = "head_groups",
    window: Optional[Window] = None,
) -> "_native.Config":
    """A validated native config; a bad value raises ValueError naming it. With a
    window, `mixing` may stay `head_groups` (the default) or be `window`."""
    if mixing not in _MIXINGS:
        raise ValueError(f"mixing must be one of {_MIXINGS}, got {mixing!r}")
    segs = [int(x) for x in (segment_lengths or ())]
    rates = [int(x) for x in (dilation_rates or ())]
    if any(x < 0 for x in segs + rates):
        raise ValueError(f"segment_lengths {segs} and dilation_rates {rates} must be non-negative")
    win = None
    if window is not None:
        left, right = window
        if int(left) < 0 or int(right) < 0:
            raise ValueError(f"window {window} must be two non-negative integers")
        win = (int(left), int(right))
        if mixing == "head_groups":
            mixing = "window"
    scale = None if softmax_scale is None else float(softmax_scale)
    return _native.Config(segs, rates, mixing, "causal" if is_causal else "full", scale, win)


def _describe(t: torch.Tensor) -> tuple:
    """What the kernels read of a tensor: its address, sizes, strides and dtype name."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPE_NAMES.get(t.dtype, str(t.dtype)[6:]))


_DEVICE_TYPES = ("cpu", "cuda")


def _check_tensor(
    name: str, t: object, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
) -> torch.Tensor:
    """A strided CPU or CUDA tensor of a supported dtype (`dtype` when given) on `device`
    (when given: query's), whose innermost stride is 1 (copied to contiguous only when it
    is not)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(f"{name} is on {t.device}; attn_dilated computes on CPU and CUDA tensors")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; a strided (dense) tensor is required")
    if t.dtype not in _DTYPE_NAMES:
        raise TypeError(f"{name} has dtype {t.dtype}; float32, bfloat16 or float16 is required")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but query has {dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    if t.numel() > 0 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _check_mask(mask: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The key padding mask as a bool tensor (True = padding) on query's device; on a
    CUDA device it is made contiguous (the kernels read it as `[batch, key_seq]` bytes)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but query is on {device}")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"key_padding_mask has dtype {mask.dtype}; bool (True = padding) is required")
    if mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be [batch, key_seq], got shape {tuple(mask.shape)}")
    return mask.contiguous() if device.type == "cuda" else mask


def cuda_unavailable_reason(device: Union[int, torch.device, str] = 0) -> Optional[str]:
    """Why the CUDA kernels cannot run on `device` (a wheel built without CUDA, no
    driver or NVRTC, no such device, a GPU older than sm_80), or None where they can."""
    index = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return _native.cuda_unavailable_reason(0 if index.index is None else index.index)


def _check_cu(cu_seqlens: Optional[CuSeqlens]) -> Optional[list]:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        return [int(x) for x in cu_seqlens.tolist()]
    return [int(x) for x in cu_seqlens]


def _placement(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """None for a CPU tensor; for a CUDA tensor its device and that device's current
    stream, so the kernels are ordered with the caller's work like a torch op."""
    if not t.is_cuda:
        return None
    return (t.get_device(), torch.cuda.current_stream(t.device).cuda_stream)


def _forward(cfg, q, k, v, mask, cu) -> Tuple[torch.Tensor, torch.Tensor]:
    b, n, h, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, n, h), dtype=torch.float32, device=q.device)
    m = None if mask is None else _describe(mask)
    args = (cfg, _describe(q), _describe(k), _describe(v), _describe(out), _describe(lse), m, cu)
    _native.forward(*args, torch.get_num_threads(), _placement(q))
    return out, lse


class _DilatedAttentionFn(torch.autograd.Function):
    """Forward by the kernels; backward by the kernels' exact backward, which reads the
    saved inputs, output and LSE (the LSE itself gets no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg, mask, cu):  # type: ignore[override]
        out, lse = _forward(cfg, q, k, v, mask, cu)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.mask, ctx.cu = cfg, mask, cu
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = _check_tensor("grad_out", grad_out, q.dtype, q.device)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        m = None if ctx.mask is None else _describe(ctx.mask)
        args = (ctx.cfg, *(_describe(t) for t in (q, k, v, out, lse, grad_out, dq, dk, dv)), m, ctx.cu)
        _native.backward(*args, torch.get_num_threads(), _placement(q))
        return dq, dk, dv, None, None, None


def attention_with_cfg(cfg, query, key, value, key_padding_mask=None, cu_seqlens=None):
    """The op on a prepared config: returns `(out, lse)`."""
    q = _check_tensor("query", query)
    k = _check_tensor("key", key, q.dtype, q.device)
    v = _check_tensor("value", value, q.dtype, q.device)
    mask = _check_mask(key_padding_mask, q.device)
    return _DilatedAttentionFn.apply(q, k, v, cfg, mask, _check_cu(cu_seqlens))


def dilated_attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    mixing: str = "head_groups",
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[CuSeqlens] = None,
    window: Optional[Window] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """[`dilated_attention`][attn_dilated.dilated_attention] that also returns the
    float32 LSE `[batch, seq, heads]` (natural log; `-inf` where a row attends nothing)."""
    cfg = make_config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    return attention_with_cfg(cfg, query, key, value, key_padding_mask, cu_seqlens)


def dilated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    mixing: str = "head_groups",
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[CuSeqlens] = None,
    window: Optional[Window] = None,
) -> torch.Tensor:
    """Dilated attention of CPU or CUDA tensors `[batch, seq, heads, head_dim]` (float32,
    bfloat16 or float16), differentiable in query, key and value. On a CUDA device the
    kernels run on the current stream (every tensor, the mask too, on query's device).

    `mixing` is `head_groups` (equal to dilated-attention-pytorch's DilatedAttention)
    or `longnet` (patterns merged by their softmax denominators). Keys and values may
    have fewer heads (grouped K/V; query head j reads head j // (heads // kv_heads)) and
    their own length (cross-attention). `key_padding_mask` is `[batch, key_seq]` bool,
    True = padding; `cu_seqlens` packs variable-length sequences into batch 1;
    `window=(left, right)` replaces the dilated patterns by a sliding window (pass empty
    segment_lengths and dilation_rates). Invalid input raises ValueError or TypeError.
    """
    out, _ = dilated_attention_with_lse(
        query,
        key,
        value,
        segment_lengths,
        dilation_rates,
        is_causal,
        softmax_scale,
        mixing,
        key_padding_mask=key_padding_mask,
        cu_seqlens=cu_seqlens,
        window=window,
    )
    return out
