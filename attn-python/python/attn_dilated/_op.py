"""The dilated attention op's public functions: argument checks with messages that name
the argument, then `torch.ops.attn_dilated.attention` (`_ops`), whose backward is the
kernels' exact backward."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _ops
from ._kernels import (
    CuSeqlens,
    Window,
    as_bool,
    as_int,
    as_scale,
    as_window,
    cuda_unavailable_reason,
    int_list,
    make_config,
    nvrtc_library,
)

__all__ = [
    "CuSeqlens",
    "Window",
    "attention",
    "cuda_unavailable_reason",
    "dilated_attention",
    "dilated_attention_with_lse",
    "make_config",
    "nvrtc_library",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# `meta`: the registered op's fake implementation gives shapes and dtypes.
_DEVICE_TYPES = ("cpu", "cuda", "meta")
# Where `torch.autocast` applies: scaled_dot_product_attention is a lower-precision op
# on both, so query, key and value are cast to the autocast dtype there.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _check_tensor(
    name: str, t: object, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
) -> torch.Tensor:
    """A strided CPU, CUDA or meta tensor of a supported dtype (`dtype` when given) on `device`
    (when given: query's), of rank 4. One whose innermost stride is not 1 is copied to
    contiguous by the registered op (`_kernels.inner_unit`), which sees the strides a
    compiled graph gives it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(f"{name} is on {t.device}; attn_dilated computes on CPU and CUDA tensors (and meta ones)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; a strided (dense) tensor is required")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; float32, bfloat16 or float16 is required")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but query has {dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
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


def _flex_block_mask_type():
    """FlexAttention's `BlockMask` class, or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    return BlockMask


def _check_block_mask(block_mask, block_size, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[int]]:
    """The block mask as a bool or uint8 tensor `[batch or 1, heads or 1, q_blocks,
    k_blocks]` (1 = kept; a 2-D `[q_blocks, k_blocks]` one serves every batch and head) on
    query's device, and its block size. A FlexAttention `BlockMask` goes through its dense
    form (`to_dense()`: every block it computes, partial or full; its `mask_mod` is not
    applied inside a block) at its block size, which must be one size for queries and
    keys and agree with `block_size` where both are given."""
    if block_mask is None:
        if block_size is not None:
            raise ValueError("block_size was given without a block_mask")
        return None, None
    flex = _flex_block_mask_type()
    if flex is not None and isinstance(block_mask, flex):
        q_size, kv_size = (int(x) for x in block_mask.BLOCK_SIZE)
        if q_size != kv_size:
            raise ValueError(f"the BlockMask's block sizes differ ({q_size} for queries, {kv_size} for keys)")
        if block_size is not None and as_int("block_size", block_size) != q_size:
            raise ValueError(f"block_size {block_size} disagrees with the BlockMask's {q_size}")
        block_mask, block_size = block_mask.to_dense().to(device) != 0, q_size
    if not isinstance(block_mask, torch.Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor or a FlexAttention BlockMask, got {type(block_mask).__name__}")
    if block_mask.device != device:
        raise ValueError(f"block_mask is on {block_mask.device} but query is on {device}")
    if block_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"block_mask has dtype {block_mask.dtype}; bool or uint8 (1 = kept) is required")
    if block_mask.dim() == 2:
        block_mask = block_mask[None, None]
    if block_mask.dim() != 4:
        raise ValueError(
            f"block_mask must be [batch, heads, q_blocks, k_blocks] (or [q_blocks, k_blocks]), "
            f"got shape {tuple(block_mask.shape)}"
        )
    if block_size is None:
        raise ValueError("block_mask needs block_size (positions per block)")
    size = as_int("block_size", block_size)
    if size < 1:
        raise ValueError(f"block_size must be at least 1, got {size}")
    return block_mask.contiguous() if device.type == "cuda" else block_mask, size


def _check_cu(cu_seqlens: Optional[CuSeqlens]) -> Optional[list]:
    """The packed sequences' offsets as a list of ints: a 1-D integer tensor or a
    sequence of integers (no float truncated)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        dt = cu_seqlens.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor, got dtype {dt}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is on meta: its values are needed (pass a list or a CPU tensor)")
        return [int(x) for x in cu_seqlens.tolist()]
    return int_list("cu_seqlens", cu_seqlens)


def _autocast(t: object) -> object:
    """`t` cast to the autocast dtype where `torch.autocast` is enabled for its device,
    as for `scaled_dot_product_attention` (a float32, bfloat16 or float16 tensor; float64
    is not cast by autocast)."""
    if not isinstance(t, torch.Tensor) or t.device.type not in _AUTOCAST_DEVICE_TYPES:
        return t
    kind = t.device.type
    if not torch.is_autocast_enabled(kind):
        return t
    dtype = torch.get_autocast_dtype(kind)
    return t.to(dtype) if t.dtype in _DTYPES and t.dtype != dtype else t


def attention(
    query,
    key,
    value,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: Optional[float],
    mixing: str,
    window: Optional[Window],
    key_padding_mask=None,
    cu_seqlens=None,
    block_mask=None,
    block_size=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The checked arguments handed to the registered op: returns `(out, lse)`, both
    differentiable. Under `torch.autocast` query, key and value are first cast to the
    autocast dtype, as `scaled_dot_product_attention`'s are."""
    query, key, value = (_autocast(x) for x in (query, key, value))
    q = _check_tensor("query", query)
    k = _check_tensor("key", key, q.dtype, q.device)
    v = _check_tensor("value", value, q.dtype, q.device)
    mask = _check_mask(key_padding_mask, q.device)
    win = as_window(window)
    segs = int_list("segment_lengths", segment_lengths)
    rates = int_list("dilation_rates", dilation_rates)
    causal = as_bool("is_causal", is_causal)
    scale = as_scale(softmax_scale)
    if not isinstance(mixing, str):
        raise TypeError(f"mixing must be a str, got {type(mixing).__name__} {mixing!r}")
    cu = _check_cu(cu_seqlens)
    blocks, size = _check_block_mask(block_mask, block_size, q.device)
    return _ops.attention(q, k, v, segs, rates, causal, scale, mixing, win, mask, cu, blocks, size)


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
    block_mask=None,
    block_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """[`dilated_attention`][attn_dilated.dilated_attention] that also returns the
    float32 LSE `[batch, seq, heads]` (natural log; `-inf` where a row attends nothing).

    Both are differentiable: partial results merged by their LSEs (attention over key
    blocks, ring or context parallelism) get exact gradients, the gradient that reaches
    the LSE entering the kernels' backward. A row whose LSE is `-inf` takes no gradient
    from it."""
    return attention(
        query, key, value, segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window,
        key_padding_mask, cu_seqlens, block_mask, block_size,
    )


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
    block_mask=None,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """Dilated attention of CPU or CUDA tensors `[batch, seq, heads, head_dim]` (float32,
    bfloat16 or float16), differentiable in query, key and value. On a CUDA device the
    kernels run on the current stream (every tensor, the mask too, on query's device);
    meta tensors give the output's shape and dtype. Under `torch.autocast` query, key and
    value are cast to the autocast dtype first, as for `scaled_dot_product_attention`.

    `mixing` is `head_groups` (each group of heads runs one pattern, the outputs scaled by
    1/G, as docs/definition.md defines it; the README says where dilated-attention-pytorch's
    code gives other values) or `longnet` (patterns merged by their softmax
    denominators). Keys and values may have fewer heads (grouped K/V; query head j reads
    head j // (heads // kv_heads)) and their own length (cross-attention).
    `key_padding_mask` is `[batch, key_seq]` bool, True = padding; `cu_seqlens` packs
    variable-length sequences into batch 1; `window=(left, right)` replaces the dilated
    patterns by a sliding window (pass empty segment_lengths and dilation_rates).
    `block_mask` (bool or uint8 `[batch or 1, heads or 1, q_blocks, k_blocks]`, 1 = kept,
    or a FlexAttention `BlockMask` through its dense form) with `block_size` removes whole
    (query block, key block) tiles, ANDed with everything else; the softmax stays exact
    over the keys that remain (on a CUDA device the mask is copied to the host, a byte
    per tile, checked there and uploaded on the current stream).
    Integer arguments must be integers and `is_causal` a bool. Invalid input raises
    ValueError or TypeError.
    """
    out, _ = attention(
        query, key, value, segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window,
        key_padding_mask, cu_seqlens, block_mask, block_size,
    )
    return out
