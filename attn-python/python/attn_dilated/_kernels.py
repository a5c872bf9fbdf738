"""The native calls: configs (validated, cached), tensors described to the kernels
(address, shape and strides, no copies), and the forward and backward writing outputs
that torch allocates on the inputs' device (CUDA calls on the current stream)."""

from __future__ import annotations

import functools
import numbers
import operator
import os
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _native

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MIXINGS = ("head_groups", "longnet", "window")

Window = Tuple[int, int]
CuSeqlens = Union[torch.Tensor, Sequence[int]]


# The op's schema holds integers as int64.
_INT64_MAX = 2**63 - 1


def _is_numpy_bool(x) -> bool:
    np = sys.modules.get("numpy")  # a NumPy bool exists only where NumPy is imported
    return np is not None and isinstance(x, np.bool_)


def as_int(name: str, x) -> int:
    """`x` as a Python int (`operator.index`: ints, NumPy integers, integer 0-d tensors;
    no float truncated, no str parsed, no bool), within int64; TypeError or ValueError
    naming the argument otherwise."""
    if isinstance(x, bool) or _is_numpy_bool(x) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer, got bool {x!r}")
    try:
        i = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(x).__name__} {x!r}") from None
    if not -_INT64_MAX <= i <= _INT64_MAX:
        raise ValueError(f"{name} ({i}) is out of range: at most 2**63 - 1 in magnitude")
    return i


def int_list(name: str, xs) -> List[int]:
    """Each entry of `xs` (None: none) through [`as_int`], named `name[i]`."""
    if xs is None:
        return []
    if isinstance(xs, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integers, got {type(xs).__name__} {xs!r}")
    try:
        items = list(xs)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of integers, got {type(xs).__name__}") from None
    return [as_int(f"{name}[{i}]", x) for i, x in enumerate(items)]


def as_bool(name: str, x) -> bool:
    """A Python or NumPy bool, as `scaled_dot_product_attention` takes `is_causal`; a str,
    int or tensor is a TypeError (`"False"` would otherwise be true)."""
    if isinstance(x, bool) or _is_numpy_bool(x):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")


def as_scale(x) -> Optional[float]:
    """`softmax_scale`: None or a real number (NumPy scalars and 0-d tensors too) as a
    float; a str or bool is a TypeError. Its value is the native config's to check."""
    if x is None:
        return None
    if isinstance(x, (str, bytes, bool)):
        raise TypeError(f"softmax_scale must be a real number, got {type(x).__name__} {x!r}")
    if not isinstance(x, numbers.Real):
        try:
            return float(x)
        except (TypeError, ValueError):
            raise TypeError(f"softmax_scale must be a real number, got {type(x).__name__} {x!r}") from None
    return float(x)


def as_window(window) -> Optional[List[int]]:
    """`window`: None or `(left, right)`, two integers (their signs are checked by
    [`make_config`] and the native config)."""
    if window is None:
        return None
    try:
        parts = list(window)
    except TypeError:
        raise TypeError(f"window must be (left, right), got {type(window).__name__} {window!r}") from None
    if len(parts) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")
    return int_list("window", parts)


def make_config(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    mixing: str = "head_groups",
    window: Optional[Window] = None,
) -> "_native.Config":
    """A validated native config; a bad value raises ValueError naming it (TypeError for
    a value of the wrong kind). With a window, `mixing` may stay `head_groups` (the
    default) or be `window`."""
    if not isinstance(mixing, str):
        raise TypeError(f"mixing must be a str, got {type(mixing).__name__} {mixing!r}")
    if mixing not in _MIXINGS:
        raise ValueError(f"mixing must be one of {_MIXINGS}, got {mixing!r}")
    segs = int_list("segment_lengths", segment_lengths)
    rates = int_list("dilation_rates", dilation_rates)
    causal = as_bool("is_causal", is_causal)
    if any(x < 0 for x in segs + rates):
        raise ValueError(f"segment_lengths {segs} and dilation_rates {rates} must be non-negative")
    win = as_window(window)
    if win is not None:
        if win[0] < 0 or win[1] < 0:
            raise ValueError(f"window {tuple(window)} must be two non-negative integers")
        win = (win[0], win[1])
        if mixing == "head_groups":
            mixing = "window"
    scale = as_scale(softmax_scale)
    return _native.Config(segs, rates, mixing, "causal" if causal else "full", scale, win)


@functools.lru_cache(maxsize=256)
def _cached_config(segs: tuple, rates: tuple, is_causal: bool, scale, mixing: str, window) -> "_native.Config":
    return make_config(segs, rates, is_causal, scale, mixing, window)


def config(segs, rates, is_causal: bool, scale, mixing: str, window) -> "_native.Config":
    """[`make_config`] for the op's arguments, built once per distinct value."""
    win = None if window is None else tuple(int(x) for x in window)
    return _cached_config(tuple(segs), tuple(rates), bool(is_causal), scale, mixing, win)


def describe(t: torch.Tensor) -> tuple:
    """What the kernels read of a tensor: its address, sizes, strides and dtype name."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPE_NAMES.get(t.dtype, str(t.dtype)[6:]))


def inner_unit(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy where its innermost stride is not 1 (the kernels read
    rows of head_dim consecutive elements)."""
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def nvidia_lib_dirs() -> List[str]:
    """The lib directories of the NVIDIA wheels PyTorch installs (`nvidia/cu13/lib`,
    `nvidia/cuda_nvrtc/lib`, ...) and torch's own, where pip puts the libnvrtc that
    matches torch's CUDA."""
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    dirs = [os.path.join(r, sub, "lib") for r in roots for sub in sorted(os.listdir(r))]
    dirs.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    return [d for d in dirs if os.path.isdir(d)]


# Once, at import (a directory listing; nothing is loaded): the native side searches
# these for libnvrtc after the dynamic linker's path, so no `LD_LIBRARY_PATH` is needed.
_native.add_library_search_dirs(nvidia_lib_dirs())


def placement(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """None for a CPU tensor; for a CUDA tensor its device and that device's current
    stream, so the kernels are ordered with the caller's work like a torch op."""
    if not t.is_cuda:
        return None
    return (t.get_device(), torch.cuda.current_stream(t.device).cuda_stream)


def on_query_device(q: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    """ValueError unless every given tensor is on query's device: the kernels read the
    memory of one device (a CUDA address read on the host would fault)."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but query is on {q.device}")


def call_native(entry, q: torch.Tensor, *args, **kwargs) -> None:
    """`entry(*args, threads, placement(q), **kwargs)`; for a CUDA tensor with q's device
    current while it runs (the driver calls make that device's context current, which
    would otherwise change torch's current device)."""
    if not q.is_cuda:
        entry(*args, torch.get_num_threads(), None, **kwargs)
        return
    with torch.cuda.device(q.device):
        entry(*args, torch.get_num_threads(), placement(q), **kwargs)


BlockArgs = Tuple[Optional[torch.Tensor], Optional[int]]


def host_blocks(blocks: BlockArgs) -> BlockArgs:
    """The block mask on the host, where the native call reads it (a byte per tile: its
    values are checked there, and on a CUDA call it is uploaded on the call's stream).
    Kept in a name until the call returns: the native call reads its memory."""
    mask, size = blocks
    return (None if mask is None else mask.cpu().contiguous(), size)


def block_kwargs(blocks: BlockArgs) -> dict:
    """The native call's `block_mask` (described) and `block_size` arguments."""
    mask, size = blocks
    return {"block_mask": None if mask is None else describe(mask), "block_size": size}


def forward(cfg, q, k, v, mask, cu, blocks: BlockArgs = (None, None)) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)`: out like q (contiguous), lse float32 `[batch, seq, heads]`."""
    on_query_device(q, key=k, value=v, key_padding_mask=mask, block_mask=blocks[0])
    b, n, h, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, n, h), dtype=torch.float32, device=q.device)
    m = None if mask is None else describe(mask)
    args = (cfg, describe(q), describe(k), describe(v), describe(out), describe(lse), m, cu)
    blocks = host_blocks(blocks)
    call_native(_native.forward, q, *args, **block_kwargs(blocks))
    return out, lse


def backward(
    cfg, grad_out, q, k, v, out, lse, mask, cu, grad_lse=None, blocks: BlockArgs = (None, None)
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)`, each like its input (contiguous), from the forward's out and lse and
    the gradients into out and (where given) the LSE."""
    on_query_device(
        q, grad_out=grad_out, key=k, value=v, out=out, lse=lse, key_padding_mask=mask, grad_lse=grad_lse,
        block_mask=blocks[0],
    )
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    m = None if mask is None else describe(mask)
    args = (cfg, *(describe(t) for t in (q, k, v, out, lse, grad_out, dq, dk, dv)), m, cu)
    # The LSE's gradient as the kernels read it: float32, contiguous (autograd hands
    # `lse.sum()`'s gradient over as an expanded, stride-0 view). Kept in a name until the
    # call returns: the kernels read its memory.
    gl = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    blocks = host_blocks(blocks)
    kwargs = {"grad_lse": None if gl is None else describe(gl), **block_kwargs(blocks)}
    if q.is_cuda:
        # The kernels' f32 scratch (dq, dk, dv accumulators, then delta) from torch's
        # caching allocator, so a repeated shape maps no new device memory.
        scratch = torch.empty(q.numel() + 2 * k.numel() + lse.numel(), dtype=torch.float32, device=q.device)
        kwargs["scratch"] = describe(scratch)
    call_native(_native.backward, q, *args, **kwargs)
    return dq, dk, dv


def cuda_unavailable_reason(device: Union[int, torch.device, str] = 0) -> Optional[str]:
    """Why the CUDA kernels cannot run on `device` (a wheel built without CUDA, no
    driver or NVRTC, no such device, a GPU older than sm_80), or None where they can."""
    index = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    ordinal = 0 if index.index is None else index.index
    if torch.cuda.is_available() and ordinal < torch.cuda.device_count():
        # Opening the device makes its context current: keep torch's current device.
        with torch.cuda.device(ordinal):
            return _native.cuda_unavailable_reason(ordinal)
    return _native.cuda_unavailable_reason(ordinal)


def nvrtc_library() -> Tuple[str, Tuple[int, int]]:
    """`(file, (major, minor))` of the libnvrtc the CUDA kernels compile with: found
    through the dynamic linker (`libnvrtc.so.13`, `.so.12`, `.so`), then in PyTorch's
    NVIDIA wheels and the CUDA toolkit's directories, or the file `ATTN_NVRTC_PATH`
    names. RuntimeError saying what was searched where none loads."""
    return _native.nvrtc_library()
