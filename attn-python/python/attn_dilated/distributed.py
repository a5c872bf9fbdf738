"""Dilated attention across the ranks of a torch.distributed process group (sequence
parallelism): each rank passes its rows of the sequence and gets exactly the rows the
single-process op would give, forward, LSE and exact gradients, computed by attn's ring
(`attn_ring`) with its frames carried over the group by point-to-point transfers of
uint8 tensors (CPU tensors under gloo). CUDA tensors (an extension built with `cuda`) run
attn's chunk ring on the device: its blocks on the CUDA kernels, queued on the current
stream, its k/v rows and dk/dv moving by attn's own NCCL communicator (joined once per
group and device from a unique id rank 0 broadcasts over the group: `_nccl_link`), the
handshake and completion rounds over the group as on the CPU; outputs, LSEs and
gradients stay on the device.

- `shard(x, rank, world_size, layout, seq_dim)`: a rank's rows of a whole tensor (the
  layout's ranges: `contiguous`, or `zigzag` for causal balance).
- `unshard(x_local, rank, world_size, layout, seq_dim, group)`: every rank's rows
  gathered in sequence order (a collective).
- `dilated_attention(...)`, `dilated_attention_with_lse(...)`: the op on each rank's rows,
  the positional arguments of `attn_dilated.dilated_attention`, then the group, layout,
  strategy (`auto`, `ring`, `allgather`, `ulysses`, `hybrid` with `ulysses=U`) and
  `timeout` (seconds any one round may wait).

Every call is collective: each rank of the group calls it with the same config, masks,
layout and strategy, or every rank raises RuntimeError (the ring's handshake compares
them). A rank that dies or stalls makes every other rank raise within `timeout`, and the
group is then refused by later calls. Key padding masks, `cu_seqlens` and block masks are
whole-sequence values, equal on every rank. CPU and CUDA tensors; on CUDA tensors
`ulysses` and `hybrid` exchange heads by the chunk ring's NCCL all-to-all."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from . import _native
from ._kernels import as_int, describe, inner_unit, make_config
from ._op import _autocast, _check_block_mask, _check_cu, _check_mask, _check_tensor
from ._nccl_link import LINKS
from ._transport import Transport

__all__ = ["dilated_attention", "dilated_attention_with_lse", "layout_ranges", "shard", "unshard"]

_LAYOUTS = ("contiguous", "zigzag")
_STRATEGIES = ("auto", "ring", "allgather", "ulysses", "hybrid")


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    return layout


def layout_ranges(seq: int, rank: int, world_size: int, layout: str = "contiguous") -> List[Tuple[int, int]]:
    """The `(start, end)` ranges of global positions rank `rank` holds, ascending (a
    `zigzag` rank holds chunks `rank` and `2 * world_size - 1 - rank` of `2 * world_size`).
    ValueError where some rank would hold no row."""
    seq, rank, world = as_int("seq", seq), as_int("rank", rank), as_int("world_size", world_size)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if seq < 0:
        raise ValueError(f"seq must be non-negative, got {seq}")
    return _native.Ring.layout_ranges(_check_layout(layout), seq, world, rank)


def _seq_dim(x: torch.Tensor, seq_dim) -> int:
    d = as_int("seq_dim", seq_dim)
    if not -x.dim() <= d < x.dim():
        raise ValueError(f"seq_dim {seq_dim} is outside a tensor of {x.dim()} dimensions")
    return d % x.dim()


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", seq_dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s rows of `x` along `seq_dim` (a copy; differentiable)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    d = _seq_dim(x, seq_dim)
    ranges = layout_ranges(x.shape[d], rank, world_size, layout)
    return torch.cat([x.narrow(d, a, b - a) for a, b in ranges], dim=d)


def _place(parts: Sequence[torch.Tensor], world: int, layout: str, d: int) -> torch.Tensor:
    """The whole tensor from every rank's rows (`parts` by rank); RuntimeError, the same
    on every rank, where the counts are not the layout's split of their sum."""
    counts = [p.shape[d] for p in parts]
    seq = sum(counts)
    for r, n in enumerate(counts):
        want = sum(b - a for a, b in layout_ranges(seq, r, world, layout))
        if n != want:
            raise RuntimeError(
                f"rank {r} holds {n} rows, but the {layout} layout of {seq} rows over {world} ranks gives it "
                f"{want} (row counts {counts})"
            )
    shape = list(parts[0].shape)
    shape[d] = seq
    out = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        at = 0
        for a, b in layout_ranges(seq, r, world, layout):
            out.narrow(d, a, b - a).copy_(part.narrow(d, at, b - a))
            at += b - a
    return out


class _Unshard(torch.autograd.Function):
    """Gather rows; the gradient of this rank's rows is its rows of the whole gradient
    (each rank is taken to compute the same loss from the whole tensor)."""

    @staticmethod
    def forward(ctx, x_local, transport, layout, d, timeout):
        if x_local.is_cuda:
            parts = transport.all_gather_device(x_local, d, timeout)
        else:
            parts = transport.all_gather_rows(x_local, d, timeout)
        ctx.spec = (transport.rank, transport.world, layout, d)
        return _place(parts, transport.world, layout, d)

    @staticmethod
    def backward(ctx, grad):
        rank, world, layout, d = ctx.spec
        return shard(grad, rank, world, layout, d), None, None, None, None


def _timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _transport(group, rank, world_size, device: Optional[torch.device] = None) -> Transport:
    t = Transport(group, device)
    if rank is not None and (as_int("rank", rank), as_int("world_size", world_size)) != (t.rank, t.world):
        raise ValueError(f"rank {rank} of {world_size} is not this process's rank {t.rank} of {t.world} in the group")
    return t


def unshard(
    x_local: torch.Tensor,
    rank: int,
    world_size: int,
    layout: str = "contiguous",
    seq_dim: int = 1,
    group=None,
    timeout: float = 60.0,
) -> torch.Tensor:
    """Every rank's rows of the group (`rank` and `world_size` must be this process's in
    `group`; None: the default group) gathered along `seq_dim` in sequence order. A
    collective: every rank calls it; a rank's rows that are not the layout's share of the
    whole raise RuntimeError on every rank. Differentiable: each rank takes its rows of
    the gradient (as when every rank computes the same loss from the whole tensor). CUDA
    tensors are gathered by the group's all_gather on their device."""
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    if x_local.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x_local is on {x_local.device}; attn_dilated.distributed gathers CPU and CUDA tensors")
    transport = _transport(group, rank, world_size, x_local.device)
    return _Unshard.apply(x_local, transport, _check_layout(layout), _seq_dim(x_local, seq_dim), _timeout(timeout))


@dataclass
class _RingCall:
    """One call's fixed arguments: the native ring, the transport, config and masks (host
    tensors: the ring reads them on the host), and on CUDA tensors the NCCL link."""

    ring: object
    transport: Transport
    cfg: object
    mask: Optional[torch.Tensor]
    cu: Optional[list]
    block_mask: Optional[torch.Tensor]
    block_size: Optional[int]
    link: Optional[object] = None

    def mask_kwargs(self) -> dict:
        return {
            "key_padding_mask": None if self.mask is None else describe(self.mask),
            "cu_seqlens": self.cu,
            "block_mask": None if self.block_mask is None else describe(self.block_mask),
            "block_size": self.block_size,
        }


class _RingAttention(torch.autograd.Function):
    """This rank's `(out, lse)`; the backward is the ring's exact backward (a collective,
    as the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, call: _RingCall):
        ctx.call = call
        if call.link is not None:
            q, k, v = (x.contiguous() for x in (q, k, v))
            out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            with torch.cuda.device(q.device):
                tensors = (describe(x) for x in (q, k, v, out, lse))
                call.ring.forward_cuda(call.cfg, call.transport, call.link, _stream(q), *tensors, **call.mask_kwargs())
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse
        q, k, v = (inner_unit(x) for x in (q, k, v))
        b, n, h, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype)
        lse = torch.empty((b, n, h), dtype=torch.float32)
        tensors = (describe(x) for x in (q, k, v, out, lse))
        call.ring.forward(call.cfg, call.transport, *tensors, **call.mask_kwargs())
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if call.link is not None:
            return _cuda_backward(call, (q, k, v), grad_out, grad_lse)
        grad_out = inner_unit(grad_out)
        # Kept in a name until the call returns: the ring reads its memory.
        gl = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
        tensors = (describe(x) for x in (q, k, v, out, lse, grad_out, dq, dk, dv))
        kwargs = call.mask_kwargs()
        kwargs["grad_lse"] = None if gl is None else describe(gl)
        call.ring.backward(call.cfg, call.transport, *tensors, **kwargs)
        return dq, dk, dv, None


def _stream(t: torch.Tensor) -> int:
    """The raw handle of `t`'s device's current stream, which the kernels queue on."""
    return torch.cuda.current_stream(t.device).cuda_stream


def _cuda_backward(call: _RingCall, saved, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]):
    """The CUDA ring's backward: `(dq, dk, dv, None)` on the device; the LSE's gradient
    travels to the ring as a host float32 tensor."""
    q, k, v = saved
    grad_out = grad_out.contiguous()
    gl = None if grad_lse is None else grad_lse.to(torch.float32).cpu().contiguous()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    kwargs = call.mask_kwargs()
    kwargs["grad_lse"] = None if gl is None else describe(gl)
    with torch.cuda.device(q.device):
        tensors = (describe(x) for x in (q, k, v, grad_out, dq, dk, dv))
        call.ring.backward_cuda(call.cfg, call.transport, call.link, _stream(q), *tensors, **kwargs)
    return dq, dk, dv, None


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why CUDA tensors on `device` cannot take the ring (an extension built without
    `cuda`, no CUDA driver, NCCL, NVRTC or device), naming the fix; None where they can."""
    return _native.ring_cuda_unavailable_reason(0 if device.index is None else device.index)


def _ring_device(q: torch.Tensor) -> None:
    """ValueError for a device other than the CPU or CUDA; for a CUDA tensor, RuntimeError
    saying why the CUDA ring cannot run where it cannot."""
    if q.device.type == "cpu":
        return
    if q.device.type != "cuda":
        raise ValueError(f"query is on {q.device}; attn_dilated.distributed computes on CPU and CUDA tensors")
    reason = cuda_unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(f"attn_dilated.distributed cannot run on {q.device} tensors: {reason}")


def _strategy(strategy, ulysses) -> str:
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    if strategy == "hybrid":
        if ulysses is None:
            raise ValueError("strategy 'hybrid' needs ulysses=U (ranks per head group, dividing the world size)")
        return f"hybrid:{as_int('ulysses', ulysses)}"
    if ulysses is not None:
        raise ValueError(f"ulysses is taken by strategy 'hybrid' only, not {strategy!r}")
    return strategy


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
    cu_seqlens=None,
    window=None,
    block_mask=None,
    block_size: Optional[int] = None,
    group=None,
    layout: str = "contiguous",
    strategy: str = "auto",
    ulysses: Optional[int] = None,
    timeout: float = 60.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's `(out, lse)` of the whole sequence's dilated attention: `query`, `key`
    and `value` are this rank's rows (`shard` of the whole tensors), `out` and the float32
    LSE `[batch, rows, heads]` its rows of the single-process results; both
    differentiable (the backward is collective too). Arguments as in
    `attn_dilated.dilated_attention_with_lse`, masks over the whole sequence; see the
    module docs for `group`, `layout`, `strategy`, `ulysses` and `timeout`."""
    query, key, value = (_autocast(x) for x in (query, key, value))
    q = _check_tensor("query", query)
    _ring_device(q)
    k = _check_tensor("key", key, q.dtype, q.device)
    v = _check_tensor("value", value, q.dtype, q.device)
    cfg = make_config(segment_lengths, dilation_rates, is_causal, softmax_scale, mixing, window)
    mask = _check_mask(key_padding_mask, q.device)
    blocks, size = _check_block_mask(block_mask, block_size, q.device)
    plan = _strategy(strategy, ulysses)
    transport = _transport(group, None, None, q.device)
    ring = _native.Ring(
        transport.rank, transport.world, _check_layout(layout), plan, _timeout(timeout), torch.get_num_threads()
    )
    link = LINKS.get(transport, q.device, _timeout(timeout)) if q.is_cuda else None
    mask, blocks = (None if t is None else t.cpu() for t in (mask, blocks))
    call = _RingCall(ring, transport, cfg, mask, _check_cu(cu_seqlens), blocks, size, link)
    return _RingAttention.apply(q, k, v, call)


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
    cu_seqlens=None,
    window=None,
    block_mask=None,
    block_size: Optional[int] = None,
    group=None,
    layout: str = "contiguous",
    strategy: str = "auto",
    ulysses: Optional[int] = None,
    timeout: float = 60.0,
) -> torch.Tensor:
    """This rank's rows of the whole sequence's dilated attention ([`dilated_attention_with_lse`]
    without the LSE)."""
    out, _ = dilated_attention_with_lse(
        query, key, value, segment_lengths, dilation_rates, is_causal, softmax_scale, mixing,
        key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, window=window, block_mask=block_mask,
        block_size=block_size, group=group, layout=layout, strategy=strategy, ulysses=ulysses, timeout=timeout,
    )
    return out
