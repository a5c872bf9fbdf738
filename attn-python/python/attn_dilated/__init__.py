"""attn_dilated: exact dilated attention (LongNet, dilated-attention-pytorch) for
PyTorch CPU tensors, computed by attn's Rust kernels with an exact backward.

- `dilated_attention(query, key, value, segment_lengths, dilation_rates, ...)`: the op.
- `DilatedAttention`, `MultiheadDilatedAttention`: `torch.nn.Module`s with the
  constructor arguments and parameter names of dilated-attention-pytorch.
"""

from ._op import dilated_attention, dilated_attention_with_lse, make_config
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = [
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "dilated_attention",
    "dilated_attention_with_lse",
    "make_config",
]
