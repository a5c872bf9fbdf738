"""`python -m attn_dilated.bench --distributed`: `attn_dilated.distributed` on N CPU
processes under gloo (N = 1, 2, 4 by default), each holding its rows of the whole
sequence: the slowest rank's median forward time and the most bytes any rank's op
allocates: the output and LSE tensors it returns plus its scratch, which the extension's
own allocator counts (`_native.allocation_peak`: what the Rust side allocates during one
call beyond what was live before it; not RSS); and the rank's footprint: its q, k, v
shards plus the op's bytes. The fall of each from N = 1 is given as a multiple of N."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _native, distributed


def op_bytes(fn) -> int:
    """Bytes the extension allocates during `fn()` beyond what was live when it began."""
    start = _native.allocation_window_start()
    fn()
    return _native.allocation_peak() - start


def _rank(rank: int, world: int, init: str, job: dict, out_dir: str) -> None:
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        shape = (1, job["seq"], job["heads"], job["head_dim"])
        q, k, v = (distributed.shard(torch.randn(shape, generator=gen), rank, world, job["layout"]) for _ in range(3))
        segs, rates = job["segments"], job["dilations"]

        def call():
            with torch.no_grad():
                return distributed.dilated_attention_with_lse(
                    q, k, v, segs, rates, layout=job["layout"], strategy=job["strategy"]
                )

        call()  # warm-up: thread pools, first-touch pages
        dist.barrier()
        returned = []
        scratch = op_bytes(lambda: returned.extend(call()))
        nbytes = scratch + sum(t.numel() * t.element_size() for t in returned)
        times = []
        for _ in range(job["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        with open(os.path.join(out_dir, f"{world}-{rank}.json"), "w") as f:
            shards = 3 * q.numel() * q.element_size()
            record = {"ms": statistics.median(times) * 1e3, "bytes": nbytes, "scratch": scratch}
            json.dump({**record, "rank_bytes": shards + nbytes}, f)
    finally:
        dist.destroy_process_group()


def measure(worlds: Sequence[int], job: dict) -> List[dict]:
    """One row a world size: `{"world", "ms" (slowest rank), "bytes" (the op's, most of any
    rank), "scratch" (the extension's part of it), "rank_bytes" (the largest footprint)}`."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            init = f"file://{os.path.join(tmp, f'store-{world}')}"
            mp.spawn(_rank, args=(world, init, job, tmp), nprocs=world, join=True)
            ranks = []
            for r in range(world):
                with open(os.path.join(tmp, f"{world}-{r}.json")) as f:
                    ranks.append(json.load(f))
            most = lambda key: max(x[key] for x in ranks)
            rows.append({"world": world, **{k: most(k) for k in ("ms", "bytes", "scratch", "rank_bytes")}})
    return rows


def fall(base: dict, row: dict, key: str):
    """How far `row[key]` fell from `base[key]` scaled to one rank, over N (None for 0)."""
    if not base[key] or not row[key]:
        return None
    return base[key] * base["world"] / row[key] / row["world"]


def report(rows: List[dict]) -> Dict[str, dict]:
    """Print the table; returns the figures keyed by world size, with the falls of the
    op's bytes and of the rank's footprint from the first row's, as multiples of N."""
    text = lambda f: "n/a" if f is None else f"{f:.2f}·N"
    print(f"{'N':>3} {'ms (slowest rank)':>18} {'op MB/rank':>11} {'fall':>7} {'scratch MB':>11} {'rank MB':>9} {'fall':>7}")
    figures = {}
    for r in rows:
        op, rank = fall(rows[0], r, "bytes"), fall(rows[0], r, "rank_bytes")
        print(
            f"{r['world']:>3} {r['ms']:>18.1f} {r['bytes'] / 2**20:>11.2f} {text(op):>7} "
            f"{r['scratch'] / 2**20:>11.2f} {r['rank_bytes'] / 2**20:>9.1f} {text(rank):>7}"
        )
        figures[str(r["world"])] = {**r, "op_fall_over_n": op, "rank_fall_over_n": rank}
    return figures


def run(args) -> Dict[str, dict]:
    job = {
        "seq": args.dist_seq,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "segments": [int(x) for x in args.segments.split(",")],
        "dilations": [int(x) for x in args.dilations.split(",")],
        "layout": args.layout,
        "strategy": args.strategy,
        "reps": args.reps,
        "threads": args.threads,
    }
    worlds = [int(x) for x in args.worlds.split(",")]
    print(
        f"attn_dilated.distributed bench: gloo, CPU, batch 1, seq {job['seq']}, heads {job['heads']}, head_dim "
        f"{job['head_dim']}, segments {job['segments']}, dilations {job['dilations']}, float32, forward, layout "
        f"{job['layout']}, strategy {job['strategy']}, {job['threads']} threads a rank, median of {job['reps']}; "
        "the Python library's RingDilatedAttention: not installed here"
    )
    return report(measure(worlds, job))
