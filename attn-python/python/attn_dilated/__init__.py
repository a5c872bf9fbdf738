"""attn_dilated: exact dilated attention (LongNet, dilated-attention-pytorch) for
PyTorch CPU and CUDA tensors, computed by attn's Rust and CUDA kernels with an exact
backward.

- `dilated_attention(query, key, value, segment_lengths, dilation_rates, ...)`: the op.
- `cuda_unavailable_reason(device=0)`: why the CUDA kernels cannot run there, or None.
- `nvrtc_library()`: the libnvrtc file and version the CUDA kernels compile with.
- `DilatedAttention`, `MultiheadDilatedAttention`: `torch.nn.Module`s with the
  constructor arguments and parameter names of dilated-attention-pytorch.
- `SparsePatternConfig`, `BlockSparseRingDilatedAttention`: that library's block-sparse
  attention, with an exact softmax.
"""

from ._op import cuda_unavailable_reason, dilated_attention, dilated_attention_with_lse, make_config, nvrtc_library
from .block_sparse import BlockSparseRingDilatedAttention, SparsePatternConfig, sparse_pattern_mask
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = [
    "BlockSparseRingDilatedAttention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "SparsePatternConfig",
    "cuda_unavailable_reason",
    "dilated_attention",
    "dilated_attention_with_lse",
    "make_config",
    "nvrtc_library",
    "sparse_pattern_mask",
]
