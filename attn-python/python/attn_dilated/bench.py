"""`python -m attn_dilated.bench`: this package's dilated attention against the plain
PyTorch composition (per head group: cut into segments, take every r-th row,
`scaled_dot_product_attention`, scatter back, divide by the group count), forward and
forward+backward, median wall time of several runs (synchronised on a GPU), on CPU or
CUDA tensors, all in one process with one timing method.

`--sdpa flash,cudnn` adds the composition with SDPA held to each named backend
(`torch.nn.attention.sdpa_kernel`), `--gathered` SDPA alone on the segments gathered
into contiguous tensors beforehand (the kernels' time without the gather and scatter),
and `--json PATH` writes every figure in milliseconds (`null` where a backend refused
the shape). `--distributed` times `attn_dilated.distributed` on N gloo processes instead
(`attn_dilated.bench_distributed`: per-rank time and the bytes the op allocates).

Default problem: batch 1, 8 heads, head_dim 64, segments 2048,4096,8192, dilations
1,2,4, head-groups mixing, float32 CPU tensors, sequence lengths 8192 and 65536."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import _native
from ._op import dilated_attention


def head_groups(h: int, segs: Sequence[int], rates: Sequence[int]):
    """`(lo, hi, w, r, off)` of each head group: tensor_split gives the first `h % groups`
    groups one head more, as head groups do."""
    groups = torch.arange(h).tensor_split(len(segs))
    return [(int(g[0]), int(g[-1]) + 1, w, r, i % r) for i, (g, w, r) in enumerate(zip(groups, segs, rates))]


def gather(x: torch.Tensor, lo: int, hi: int, w: int, r: int, off: int) -> torch.Tensor:
    """`[b, n, h, d]` -> `[b * n/w, g, w/r, d]`: one group's heads, its segments as a batch."""
    b, n, _, d = x.shape
    x = x[:, :, lo:hi].reshape(b, n // w, w, hi - lo, d)[:, :, off::r]
    return x.permute(0, 1, 3, 2, 4).reshape(b * (n // w), hi - lo, -1, d)


def torch_dilated(q, k, v, segs: Sequence[int], rates: Sequence[int]) -> torch.Tensor:
    """Head-groups dilated attention composed of PyTorch ops (seq a multiple of every
    segment length): what a user writes without this package."""
    b, n, h, d = q.shape
    if any(n % w for w in segs):
        raise ValueError(f"the composition needs seq ({n}) to be a multiple of every segment length {list(segs)}")
    out = torch.zeros_like(q)
    groups = len(segs)
    for lo, hi, w, r, off in head_groups(h, segs, rates):
        pick = lambda x: gather(x, lo, hi, w, r, off)
        x = F.scaled_dot_product_attention(pick(q), pick(k), pick(v))
        x = x.reshape(b, n // w, hi - lo, -1, d).permute(0, 1, 3, 2, 4)
        out.view(b, n // w, w, h, d)[:, :, off::r, lo:hi] = x / groups
    return out


def sdpa_backend(name: Optional[str]):
    """A context holding SDPA to backend `name` (`flash`, `cudnn`, `efficient`, `math`), or
    no constraint for None."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(backends[name])


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


def measure(seq: int, heads: int, head_dim: int, segs, rates, reps: int, device, dtype, sdpa=(), gathered=False):
    """`(rows, err)`: `(name, key, forward s, forward+backward s)` per implementation (None
    where it failed, with the reason printed) and the package's relative L2 error against
    the composition."""
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(1, seq, heads, head_dim, generator=gen).to(device, dtype)
    q, k, v = make(), make(), make()
    grad = make()
    ours = lambda a, b, c: dilated_attention(a, b, c, segs, rates)
    theirs = lambda a, b, c: torch_dilated(a, b, c, segs, rates)
    with torch.no_grad():
        want = theirs(q, k, v).float()
        err = (ours(q, k, v).float() - want).norm() / want.norm()
    impls = [("attn_dilated", "python", ours, None), ("torch composition", "sdpa", theirs, None)]
    impls += [(f"composition, {b}", f"sdpa_{b}", theirs, b) for b in sdpa]
    rows = []
    for name, key, fn, backend in impls:

        def fwd():
            with torch.no_grad(), sdpa_backend(backend):
                fn(q, k, v)

        def fwd_bwd():
            a, b, c = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_backend(backend):
                fn(a, b, c).backward(grad)

        rows.append((name, key, *timed(name, fwd, fwd_bwd, reps, device)))
    if gathered:
        groups = head_groups(heads, segs, rates)
        picked = [[gather(x, *g) for x in (q, k, v, grad)] for g in groups]
        # The gradient of each group's output: its share of `grad`, gathered like q.
        backend = sdpa[0] if sdpa else None

        def fwd():
            with torch.no_grad(), sdpa_backend(backend):
                for a, b, c, _ in picked:
                    F.scaled_dot_product_attention(a, b, c)

        def fwd_bwd():
            with sdpa_backend(backend):
                for a, b, c, g in picked:
                    a, b, c = (x.detach().requires_grad_() for x in (a, b, c))
                    F.scaled_dot_product_attention(a, b, c).backward(g)

        rows.append((f"gathered, {backend or 'default'}", "sdpa_gathered", *timed("gathered", fwd, fwd_bwd, reps, device)))
    return rows, err.item()


def timed(name: str, fwd, fwd_bwd, reps: int, device) -> tuple:
    """`(forward s, forward+backward s)`, None for a pass that raised (a backend that does
    not take the shape), its reason printed."""
    out = []
    for fn in (fwd, fwd_bwd):
        try:
            out.append(median_seconds(fn, reps, device))
        except RuntimeError as e:
            print(f"{name}: {str(e).splitlines()[0]}")
            out.append(None)
    return tuple(out)


def ms(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}"


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
    p.add_argument("--sdpa", default="", help="SDPA backends to time the composition under, e.g. flash,cudnn")
    p.add_argument("--gathered", action="store_true", help="SDPA alone on pre-gathered segments")
    p.add_argument("--json", help="write the figures (milliseconds) to this file")
    p.add_argument("--distributed", action="store_true", help="attn_dilated.distributed on N gloo CPU processes")
    p.add_argument("--worlds", default="1,2,4", help="--distributed: process counts N")
    p.add_argument("--dist-seq", type=int, default=65536, help="--distributed: the whole sequence's length")
    p.add_argument("--layout", default="contiguous", help="--distributed: contiguous or zigzag")
    p.add_argument("--strategy", default="auto", help="--distributed: auto, ring, allgather, ulysses")
    p.add_argument("--threads", type=int, default=1, help="--distributed: compute threads a rank")
    args = p.parse_args(argv)
    if args.distributed:
        from . import bench_distributed

        figures = bench_distributed.run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"distributed": figures, "torch": torch.__version__}, f, indent=1)
        return
    segs = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.dilations.split(",")]
    sdpa = [b for b in args.sdpa.split(",") if b]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, kernels cuda"
    else:
        where = f"{torch.get_num_threads()} threads, kernels {_native.cpu_isa()}"
    print(
        f"attn_dilated bench: batch 1, heads {args.heads}, head_dim {args.head_dim}, segments {segs}, "
        f"dilations {rates}, {args.dtype}, torch {torch.__version__}, {where}, median of {args.reps}"
    )
    print(f"{'seq':>7}  {'implementation':<22} {'forward ms':>11} {'fwd+bwd ms':>11}")
    figures: Dict[str, Dict[str, Optional[float]]] = {}
    for seq in (int(x) for x in args.seqs.split(",")):
        rows, err = measure(seq, args.heads, args.head_dim, segs, rates, args.reps, device, dtype, sdpa, args.gathered)
        for name, _, f, fb in rows:
            print(f"{seq:>7}  {name:<22} {ms(f):>11} {ms(fb):>11}")
        (_, _, f0, fb0), (_, _, f1, fb1) = rows[:2]
        ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"
        print(f"{seq:>7}  {'speed-up':<22} {ratio(f1, f0):>11} {ratio(fb1, fb0):>11}   (outputs differ by {err:.1e} rel. L2)")
        figures[str(seq)] = {"rel_l2_vs_composition": err}
        for _, key, f, fb in rows:
            figures[str(seq)][f"{key}_fwd_ms"] = None if f is None else f * 1e3
            figures[str(seq)][f"{key}_fwdbwd_ms"] = None if fb is None else fb * 1e3
    if args.json:
        meta = {"device": where, "dtype": args.dtype, "torch": torch.__version__, "reps": args.reps}
        with open(args.json, "w") as f:
            json.dump({**meta, "seq": figures}, f, indent=1)


if __name__ == "__main__":
    main()
