"""`python -m attn_dilated.bench`: this package's dilated attention against the plain
PyTorch composition (per head group: cut into segments, take every r-th row,
`scaled_dot_product_attention`, scatter back, divide by the group count), forward and
forward+backward, median wall time of several runs (synchronised on a GPU), on CPU or
CUDA tensors.

Default problem: batch 1, 8 heads, head_dim 64, segments 2048,4096,8192, dilations
1,2,4, head-groups mixing, float32 CPU tensors, sequence lengths 8192 and 65536."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List, Sequence

import torch
import torch.nn.functional as F

from . import _native
from ._op import dilated_attention


def torch_dilated(q, k, v, segs: Sequence[int], rates: Sequence[int]) -> torch.Tensor:
    """Head-groups dilated attention composed of PyTorch ops (seq a multiple of every
    segment length): what a user writes without this package."""
    b, n, h, d = q.shape
    if any(n % w for w in segs):
        raise ValueError(f"the composition needs seq ({n}) to be a multiple of every segment length {list(segs)}")
    out = torch.zeros_like(q)
    groups = len(segs)
    # tensor_split gives the first `h % groups` groups one head more, as head groups do.
    for i, (heads_i, w, r) in enumerate(zip(torch.arange(h).tensor_split(groups), segs, rates)):
        lo, hi = int(heads_i[0]), int(heads_i[-1]) + 1
        off, g = i % r, hi - lo

        def pick(x):  # [b, n, h, d] -> [b * n/w, g, w/r, d]
            x = x[:, :, lo:hi].reshape(b, n // w, w, g, d)[:, :, off::r]
            return x.permute(0, 1, 3, 2, 4).reshape(b * (n // w), g, -1, d)

        x = F.scaled_dot_product_attention(pick(q), pick(k), pick(v))
        x = x.reshape(b, n // w, g, -1, d).permute(0, 1, 3, 2, 4)
        out.view(b, n // w, w, h, d)[:, :, off::r, lo:hi] = x / groups
    return out


def median_seconds(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    """Median wall time of `reps` calls after one warm-up (thread pools, allocator, kernel
    compilation); on a GPU each call is timed from an idle device to its completion."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def measure(seq: int, heads: int, head_dim: int, segs, rates, reps: int, device, dtype) -> List[tuple]:
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(1, seq, heads, head_dim, generator=gen).to(device, dtype)
    q, k, v = make(), make(), make()
    grad = make()
    ours = lambda a, b, c: dilated_attention(a, b, c, segs, rates)
    theirs = lambda a, b, c: torch_dilated(a, b, c, segs, rates)
    with torch.no_grad():
        want = theirs(q, k, v).float()
        err = (ours(q, k, v).float() - want).norm() / want.norm()
    rows = []
    for name, fn in (("attn_dilated", ours), ("torch composition", theirs)):

        def fwd():
            with torch.no_grad():
                fn(q, k, v)

        def fwd_bwd():
            a, b, c = (x.detach().requires_grad_() for x in (q, k, v))
            fn(a, b, c).backward(grad)

        rows.append((name, median_seconds(fwd, reps, device), median_seconds(fwd_bwd, reps, device)))
    return rows, err.item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="8192,65536", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segments", default="2048,4096,8192")
    p.add_argument("--dilations", default="1,2,4")
    p.add_argument("--reps", type=int, default=5, help="timed runs per figure (median), after one warm-up")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    segs = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.dilations.split(",")]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, kernels cuda"
    else:
        where = f"{torch.get_num_threads()} threads, kernels {_native.cpu_isa()}"
    print(
        f"attn_dilated bench: batch 1, heads {args.heads}, head_dim {args.head_dim}, segments {segs}, "
        f"dilations {rates}, {args.dtype}, torch {torch.__version__}, {where}, median of {args.reps}"
    )
    print(f"{'seq':>7}  {'implementation':<18} {'forward ms':>11} {'fwd+bwd ms':>11}")
    for seq in (int(x) for x in args.seqs.split(",")):
        rows, err = measure(seq, args.heads, args.head_dim, segs, rates, args.reps, device, dtype)
        for name, f, fb in rows:
            print(f"{seq:>7}  {name:<18} {f * 1e3:>11.1f} {fb * 1e3:>11.1f}")
        (_, f0, fb0), (_, f1, fb1) = rows
        print(f"{seq:>7}  {'speed-up':<18} {f1 / f0:>10.2f}x {fb1 / fb0:>10.2f}x   (outputs differ by {err:.1e} rel. L2)")


if __name__ == "__main__":
    main()
