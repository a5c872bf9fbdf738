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
- `distributed`: the op across the ranks of a torch.distributed group (`shard`,
  `unshard`, `dilated_attention`); `RingDilatedAttention`, `RingMultiheadDilatedAttention`:
  that library's ring modules over it.
"""

from ._op import cuda_unavailable_reason, dilated_attention, dilated_attention_with_lse, make_config, nvrtc_library
from .block_sparse import BlockSparseRingDilatedAttention, SparsePatternConfig, sparse_pattern_mask
from . import distributed
from .modules import DilatedAttention, MultiheadDilatedAttention
from .ring_modules import RingDilatedAttention, RingMultiheadDilatedAttention

__all__ = [
    "BlockSparseRingDilatedAttention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "RingDilatedAttention",
    "RingMultiheadDilatedAttention",
    "SparsePatternConfig",
    "cuda_unavailable_reason",
    "dilated_attention",
    "dilated_attention_with_lse",
    "distributed",
    "make_config",
    "nvrtc_library",
    "sparse_pattern_mask",
]
