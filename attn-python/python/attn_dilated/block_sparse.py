"""Block-sparse attention with the Python library's names: `SparsePatternConfig` and
`BlockSparseRingDilatedAttention` take dilated-attention-pytorch's constructor and
forward arguments and compute what its block-sparse path means, with an exact softmax:
one pattern over the whole sequence (`segment_lengths = [n]`, rate 1) under the block
mask its config names (the definition's "Block masks"). That library computes one
softmax per block pair and adds the results, so its values differ from these wherever a
query row keeps more than one key block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from . import _native
from ._kernels import int_list
from ._op import dilated_attention

_PATTERNS = ("local_window", "dilated_sparse", "global_local")


@dataclass
class SparsePatternConfig:
    """dilated-attention-pytorch's sparse pattern config. `pattern_type`,
    `local_window_size`, `global_tokens` and `block_size` choose the mask;
    `sparsity_ratio` is checked as that library checks it but, as in its generators of
    these patterns, does not change them; the adaptive fields are kept for
    compatibility (its `adaptive` pattern is a learned network's output and is refused)."""

    pattern_type: str = "dilated_sparse"
    sparsity_ratio: float = 0.25
    block_size: int = 128
    local_window_size: int = 512
    global_tokens: int = 64
    adaptation_rate: float = 0.1
    min_sparsity: float = 0.05
    max_sparsity: float = 0.95


def sparse_pattern_mask(
    config: SparsePatternConfig, dilation_rates: Sequence[int], q_len: int, k_len: Optional[int] = None
) -> Tensor:
    """The config's block mask, bool `[q_blocks, k_blocks]` (True = kept), for `q_len`
    queries and `k_len` keys (default `q_len`), `dilation_rates` the module's (the rates
    of `dilated_sparse`). ValueError for an unknown pattern type or a bad size."""
    k_len = q_len if k_len is None else k_len
    rates = int_list("dilation_rates", dilation_rates)
    keep, q_blocks, k_blocks = _native.sparse_pattern_mask(
        config.pattern_type, config.local_window_size, config.global_tokens, config.block_size, rates, q_len, k_len
    )
    return torch.frombuffer(bytearray(keep), dtype=torch.uint8).reshape(q_blocks, k_blocks).bool()


def _check_config(config: SparsePatternConfig) -> None:
    """The Python library's checks of its config, and ours of the pattern type."""
    if not 0.0 < config.sparsity_ratio < 1.0:
        raise ValueError(f"sparsity_ratio must be between 0 and 1 (exclusive), got {config.sparsity_ratio}")
    if config.block_size <= 0:
        raise ValueError(f"block_size must be positive, got {config.block_size}")
    if config.local_window_size <= 0:
        raise ValueError(f"local_window_size must be positive, got {config.local_window_size}")
    if config.pattern_type not in _PATTERNS:
        raise ValueError(
            f"pattern_type {config.pattern_type!r} is not supported: one of {_PATTERNS} (the adaptive pattern is "
            "a learned network's output, not a mask this package defines)"
        )


class BlockSparseRingDilatedAttention(nn.Module):
    """dilated-attention-pytorch's block-sparse attention with an exact softmax: the
    module's `sparse_config` names a block mask, and `forward(q, k, v, is_causal)`
    attends `[batch, seq, heads, head_dim]` tensors with one pattern over the whole
    sequence under that mask. `seq` must be a multiple of `block_size` (as that library
    requires). Its performance switches (`enable_memory_pool`, `enable_packed_comm`,
    `enable_hardware_opt`, and `RingDilatedAttention`'s keyword arguments) are accepted
    and have no effect here, except a non-zero `dropout`, which is refused: the
    attention is exact."""

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        sparse_config: Optional[SparsePatternConfig] = None,
        use_adaptive_sparsity: bool = False,
        quality_threshold: float = 0.95,
        enable_memory_pool: bool = True,
        enable_packed_comm: bool = True,
        enable_hardware_opt: bool = True,
        **kwargs,
    ):
        super().__init__()
        if not 0.0 <= quality_threshold <= 1.0:
            raise ValueError(f"quality_threshold must be between 0 and 1, got {quality_threshold}")
        if use_adaptive_sparsity:
            raise ValueError("use_adaptive_sparsity is not supported: its pattern is a learned network's output")
        if float(kwargs.get("dropout", 0.0)) != 0.0:
            raise ValueError(f"dropout {kwargs['dropout']} is not supported: the attention is exact")
        self.segment_lengths = int_list("segment_lengths", segment_lengths)
        self.dilation_rates = int_list("dilation_rates", dilation_rates)
        self.sparse_config = sparse_config or SparsePatternConfig()
        _check_config(self.sparse_config)
        self.quality_threshold = quality_threshold
        self.enable_memory_pool = enable_memory_pool
        self.enable_packed_comm = enable_packed_comm
        self.enable_hardware_opt = enable_hardware_opt

    def block_mask(self, seq_len: int, device: Optional[torch.device] = None) -> Tensor:
        """The bool `[q_blocks, k_blocks]` mask this module applies at `seq_len`."""
        mask = sparse_pattern_mask(self.sparse_config, self.dilation_rates, seq_len)
        return mask if device is None else mask.to(device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, return_attention_weights: bool = False):
        if return_attention_weights:
            raise ValueError(
                "return_attention_weights=True is not supported: the weights of a long sequence are never formed"
            )
        n, size = q.shape[1], self.sparse_config.block_size
        if n % size != 0:
            raise ValueError(f"sequence length {n} must be divisible by block_size {size}")
        mask = self.block_mask(n, q.device)
        return dilated_attention(q, k, v, [n], [1], is_causal, block_mask=mask, block_size=size)
