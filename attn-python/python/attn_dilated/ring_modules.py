"""dilated-attention-pytorch's ring modules over `attn_dilated.distributed`:
`RingDilatedAttention` (that library's constructor and forward arguments; every rank
passes the whole q, k, v and gets the whole output, the module shards them internally)
and `RingMultiheadDilatedAttention` (`MultiheadDilatedAttention`'s layer and parameter
names with the ring inside, so a state_dict moves between one process and many).

The sharding is exact for replicated inputs: each rank attends its rows through the ring,
the outputs are gathered, and in the backward every rank receives the whole gradient of
its inputs (each rank's rows of it, gathered), so a loss computed alike on every rank
gives every rank the single-process gradients. Without an initialised process group (or
in a group of one) the modules compute in this process."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import distributed as ddist
from ._kernels import as_int
from ._op import CuSeqlens, Window
from ._transport import Transport
from .modules import DilatedAttention, MultiheadDilatedAttention


class _ShardReplicated(torch.autograd.Function):
    """This rank's rows of a tensor every rank holds whole; the backward gathers every
    rank's rows of the gradient, so each rank gets the whole input gradient."""

    @staticmethod
    def forward(ctx, x, transport: Transport, layout: str, timeout: float):
        ctx.spec = (transport, layout, timeout)
        return ddist.shard(x, transport.rank, transport.world, layout)

    @staticmethod
    def backward(ctx, grad):
        transport, layout, timeout = ctx.spec
        gather = transport.all_gather_device if grad.is_cuda else transport.all_gather_rows
        parts = gather(grad, 1, timeout)
        return ddist._place(parts, transport.world, layout, 1), None, None, None


class RingDilatedAttention(DilatedAttention):
    """Dilated attention over the ranks of a process group, with dilated-attention-pytorch's
    `RingDilatedAttention` arguments: `segment_lengths`, `dilation_rates`, `dropout`
    (accepted, not applied, as `DilatedAttention`'s), and `use_tf32`, `block_size`,
    `use_checkpointing`, `device`, `dtype`, which tune that library's own kernels and are
    accepted for compatibility. `ring_size`, where given, must be the group's size.

    Keyword-only extras: `mixing`, `window`, `softmax_scale` (as `DilatedAttention`),
    `group` (None: the default group), `layout`, `strategy`, `ulysses` and `timeout` (as
    `attn_dilated.distributed.dilated_attention`)."""

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        dropout: float = 0.0,
        use_tf32: bool = True,
        block_size: int = 1024,
        ring_size: Optional[int] = None,
        use_checkpointing: bool = True,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        mixing: str = "head_groups",
        window: Optional[Window] = None,
        softmax_scale: Optional[float] = None,
        group=None,
        layout: str = "contiguous",
        strategy: str = "auto",
        ulysses: Optional[int] = None,
        timeout: float = 60.0,
    ):
        super().__init__(segment_lengths, dilation_rates, softmax_scale, dropout, mixing=mixing, window=window)
        self.block_size = as_int("block_size", block_size)
        self.ring_size = None if ring_size is None else as_int("ring_size", ring_size)
        self.group = group
        self.layout = ddist._check_layout(layout)
        self.strategy, self.ulysses = strategy, ulysses
        ddist._strategy(strategy, ulysses)
        self.timeout = ddist._timeout(timeout)

    def _world(self) -> int:
        """The group's size (1 without torch.distributed); ValueError where `ring_size`
        says otherwise."""
        world = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if self.ring_size is not None and self.ring_size != world:
            raise ValueError(f"ring_size {self.ring_size} is not the process group's size {world}")
        return world

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        is_causal: bool = False,
        attention_mask: Optional[Tensor] = None,
        *,
        key_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[CuSeqlens] = None,
    ) -> Tensor:
        """The whole `[batch, seq, heads, head_dim]` output from the whole inputs (equal
        on every rank); a collective. `attention_mask` is refused (use `is_causal`,
        `key_padding_mask`, `cu_seqlens` or `window`)."""
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported: use is_causal, key_padding_mask, cu_seqlens or window")
        if self._world() == 1:
            return super().forward(query, key, value, is_causal, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        transport = Transport(self.group, query.device)
        local = [_ShardReplicated.apply(x, transport, self.layout, self.timeout) for x in (query, key, value)]
        out = ddist.dilated_attention(
            *local, self.segment_lengths, self.dilation_rates, is_causal, self.softmax_scale, self.mixing,
            key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, window=self.window, group=self.group,
            layout=self.layout, strategy=self.strategy, ulysses=self.ulysses, timeout=self.timeout,
        )
        return ddist._Unshard.apply(out, transport, self.layout, 1, self.timeout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout!r}, strategy={self.strategy!r}"


class RingMultiheadDilatedAttention(MultiheadDilatedAttention):
    """`MultiheadDilatedAttention` (its arguments, parameter names and initialisation)
    with its attention through `RingDilatedAttention`: every rank passes the whole
    `[batch, seq, embed_dim]` inputs and gets the whole output. Keyword-only extras as
    `MultiheadDilatedAttention`'s plus `group`, `layout`, `strategy`, `ulysses` and
    `timeout`. Training dropout draws from each rank's torch generator: seed the ranks
    alike for equal outputs."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dilation_rates: Sequence[int],
        segment_lengths: Sequence[int],
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        group=None,
        layout: str = "contiguous",
        strategy: str = "auto",
        ulysses: Optional[int] = None,
        timeout: float = 60.0,
        **extras,
    ):
        super().__init__(
            embed_dim, num_heads, dilation_rates, segment_lengths, dropout, bias, layer_norm, layer_norm_eps,
            gamma_init, device, dtype, **extras,
        )
        single = self.attention
        self.attention = RingDilatedAttention(
            single.segment_lengths, single.dilation_rates, mixing=single.mixing, window=single.window,
            softmax_scale=single.softmax_scale, group=group, layout=layout, strategy=strategy, ulysses=ulysses,
            timeout=timeout,
        )
