"""One rank of the distributed tests, run by `torchrun --standalone --nproc_per_node N
dist_worker.py MODE OUT_DIR` (gloo): each rank writes `OUT_DIR/rank{r}.json` with what it
saw, which `test_distributed.py` judges.

Modes:
- `conformance`: every `dilated`, `features` and `blocks` file, for both layouts and the
  strategies `auto` and `ring`: this rank's rows through `attn_dilated.distributed`,
  gathered, against the file (within its `rel_tol`) and against the single-process op on
  the whole tensors: out, LSE, the gradients of `out . grad_out` and of
  `out . grad_out + lse . grad_lse`. Records the cases run and every failure.
- `strategies`: every `dilated` and `features` file through the strategies `allgather`,
  `ulysses` and `hybrid` (`ulysses=1`), contiguous layout, judged as in `conformance`; a
  refusal (NotImplementedError: fewer heads than ranks) is counted apart.
- `exit` / `raise`: rank 1 leaves (`os._exit(0)`) or raises inside its third transport
  round of a forward; the others record what they raised and how long it took.
- `mismatch`: rank 1 passes another config (causal), then another key padding mask, then
  another block mask; every rank records what it raised.
- `rows`: rank 0 passes one row too many and rank 1 one too few; every rank records what
  it raised.
- `cuda` (NCCL process group, one GPU a rank): every `dilated` and `features` file on
  CUDA tensors under both layouts, strategy `ring`, judged as in `conformance` against
  the single-process CUDA op; records the cases, failures and the NCCL links cached.
- `nccl_id` (gloo, no GPU needed): the NCCL link cache with a stand-in id maker and
  join: the ids made, the ids each rank joined with (gathered), whether a second call
  and another device or group reused or made links, and what a failing id maker raised.
- `modules`: `RingDilatedAttention` against `DilatedAttention` and
  `RingMultiheadDilatedAttention` (loaded from a single-process layer's state_dict, and its
  own state_dict loaded back into one) against `MultiheadDilatedAttention`: outputs and
  input and parameter gradients, for both layouts; records the cases and failures."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import attn_dilated as ad  # noqa: E402
import attn_dilated.distributed as ddist  # noqa: E402
from attn_dilated import _transport  # noqa: E402
from checks import assert_close, assert_lse  # noqa: E402
from test_golden import block_args, config_args, files, masks, read  # noqa: E402

LAYOUTS = ("contiguous", "zigzag")
# The (layout, strategy) pairs each world size runs: both layouts and both strategies at
# every size, and every pairing over sizes 2 and 3 (a sampled sweep that keeps CI short).
PAIRS = {
    2: (("contiguous", "ring"), ("zigzag", "auto")),
    3: (("contiguous", "auto"), ("zigzag", "ring")),
}
FAULT_TIMEOUT = 5.0


def conformance(rank: int, world: int) -> dict:
    cases, failures = 0, []
    paths = files("dilated", "features", "blocks")
    for layout, strategy in PAIRS[world]:
        for path in paths:
            name = f"{path.parent.name}/{path.stem} {layout} {strategy}"
            try:
                one_file(path, rank, world, layout, strategy)
                cases += 1
            except Exception as e:  # recorded; the rank keeps step with the others
                failures.append(f"{name}: {type(e).__name__}: {e}")
    return {"cases": cases, "failures": failures, "files": len(paths)}


def strategies(rank: int, world: int) -> dict:
    cases, refused, failures = 0, [], []
    for strategy, ulysses in (("allgather", None), ("ulysses", None), ("hybrid", 1)):
        for path in files("dilated", "features"):
            name = f"{path.parent.name}/{path.stem} {strategy}"
            try:
                one_file(path, rank, world, "contiguous", strategy, ulysses)
                cases += 1
            except NotImplementedError:
                refused.append(name)
            except Exception as e:
                failures.append(f"{name}: {type(e).__name__}: {e}")
    return {"cases": cases, "refused": refused, "failures": failures}


def one_file(path, rank: int, world: int, layout: str, strategy: str, ulysses=None, device=None) -> None:
    """One file through the ring on `device` (None: the CPU), judged against the file and
    the single-process op on the same device."""
    meta, t, rel_tol = read(path)
    if device is not None:
        t = {name: x if name == "cu_seqlens" else x.to(device) for name, x in t.items()}
    args = {**config_args(meta), **masks(t), **block_args(meta, t)}
    part = lambda x: ddist.shard(x, rank, world, layout)
    whole = lambda x: ddist.unshard(x.detach(), rank, world, layout)
    q, k, v, go = (t[x] for x in ("q", "k", "v", "grad_out"))
    gl = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(7)).to(q.device)
    # The single-process op on the whole tensors.
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    so, sl = ad.dilated_attention_with_lse(qs, ks, vs, **args)
    single = torch.autograd.grad(so, (qs, ks, vs), go, retain_graph=True)
    single_lse = torch.autograd.grad((so * go).sum() + (torch.nan_to_num(sl, neginf=0.0) * gl).sum(), (qs, ks, vs))
    # This rank's rows through the ring.
    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    ring = {"layout": layout, "strategy": strategy, "ulysses": ulysses, "timeout": 60.0}
    lo, ll = ddist.dilated_attention_with_lse(ql, kl, vl, **args, **ring)
    grads = torch.autograd.grad(lo, (ql, kl, vl), part(go), retain_graph=True)
    loss = (lo * part(go)).sum() + (torch.nan_to_num(ll, neginf=0.0) * part(gl)).sum()
    grads_lse = torch.autograd.grad(loss, (ql, kl, vl))
    out, lse = whole(lo), whole(ll)
    assert_close("out", out, t["out"], rel_tol)
    assert_close("out vs single", out, so, rel_tol)
    assert_lse(lse, sl, rel_tol)
    if "lse" in t:
        assert_lse(lse, t["lse"], rel_tol)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(name, whole(grads[i]), t[name], rel_tol)
        assert_close(f"{name} vs single", whole(grads[i]), single[i], rel_tol)
        assert_close(f"{name} with grad_lse vs single", whole(grads_lse[i]), single_lse[i], rel_tol)


def small_problem(rank: int, world: int):
    """A causal problem whose segments span ranks, this rank's rows of it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 48, 2, 8, generator=g) for _ in range(3))
    return [ddist.shard(x, rank, world) for x in (q, k, v)]


def fault(rank: int, world: int, kind: str) -> dict:
    ql, kl, vl = small_problem(rank, world)
    if rank == 1:
        rounds = {"n": 0}
        real = _transport.Transport.group

        def failing(self, sends, recvs, timeout):
            rounds["n"] += 1
            if rounds["n"] == 3:
                if kind == "exit":
                    os._exit(0)
                raise ConnectionError("planted transport failure")
            return real(self, sends, recvs, timeout)

        _transport.Transport.group = failing
    start = time.monotonic()
    try:
        ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], True, strategy="ring", timeout=FAULT_TIMEOUT)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    # A second call on the same group must be refused at once.
    start2 = time.monotonic()
    try:
        ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], True, timeout=FAULT_TIMEOUT)
        again = None
    except Exception as e:
        again = f"{type(e).__name__}: {e}"
    return {"raised": raised, "elapsed": elapsed, "timeout": FAULT_TIMEOUT, "again": again,
            "again_elapsed": time.monotonic() - start2}


def attempt(f) -> str:
    try:
        f()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def mismatch(rank: int, world: int) -> dict:
    ql, kl, vl = small_problem(rank, world)
    causal = rank == 1
    first = attempt(lambda: ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], causal, timeout=FAULT_TIMEOUT))
    mask = torch.zeros(1, 48, dtype=torch.bool)
    mask[0, 40 + rank] = True
    second = attempt(
        lambda: ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], key_padding_mask=mask, timeout=FAULT_TIMEOUT)
    )
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[2, rank % 2] = False
    blocks = attempt(
        lambda: ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], block_mask=keep, block_size=16, timeout=FAULT_TIMEOUT)
    )
    # The group still works after refusals: a matching call succeeds.
    third = attempt(lambda: ddist.dilated_attention(ql, kl, vl, [16, 48], [1, 2], timeout=FAULT_TIMEOUT))
    return {"config": first, "mask": second, "blocks": blocks, "after": third}


def rows(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 48, 2, 8, generator=g)
    (a, b), = ddist.layout_ranges(48, rank, world)
    b += {0: 1, 1: -1}.get(rank, 0)
    a += {1: 1}.get(rank, 0)
    local = x[:, a:b]
    return {"raised": attempt(lambda: ddist.dilated_attention(local, local, local, [16, 48], [1, 2], timeout=FAULT_TIMEOUT))}


def modules(rank: int, world: int) -> dict:
    cases, failures = 0, []
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 64, 4, 8, generator=g) for _ in range(3))
    x, go = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    for layout in LAYOUTS:
        for causal in (False, True):
            name = f"RingDilatedAttention {layout} causal={causal}"
            try:
                single = ad.DilatedAttention([16, 32, 64], [1, 2, 4])
                ring = ad.RingDilatedAttention([16, 32, 64], [1, 2, 4], ring_size=world, layout=layout)
                a = [t.clone().requires_grad_() for t in (q, k, v)]
                b = [t.clone().requires_grad_() for t in (q, k, v)]
                want, got = single(*a, causal), ring(*b, causal)
                gw = torch.autograd.grad(want, a, go.view(2, 64, 4, 8))
                gg = torch.autograd.grad(got, b, go.view(2, 64, 4, 8))
                assert_close("out", got, want, 1e-5)
                for n, x1, x2 in zip(("dq", "dk", "dv"), gg, gw):
                    assert_close(n, x1, x2, 1e-5)
                cases += 1
            except Exception as e:
                failures.append(f"{name}: {type(e).__name__}: {e}")
        name = f"RingMultiheadDilatedAttention {layout}"
        try:
            torch.manual_seed(5)
            single = ad.MultiheadDilatedAttention(32, 4, [1, 2], [16, 64], num_kv_heads=2)
            ring = ad.RingMultiheadDilatedAttention(32, 4, [1, 2], [16, 64], num_kv_heads=2, layout=layout)
            ring.load_state_dict(single.state_dict(), strict=True)
            assert set(ring.state_dict()) == set(single.state_dict())
            back = ad.MultiheadDilatedAttention(32, 4, [1, 2], [16, 64], num_kv_heads=2)
            back.load_state_dict(ring.state_dict(), strict=True)
            outs = []
            for layer in (single, ring, back):
                xi = x.clone().requires_grad_()
                out, _ = layer(xi, is_causal=True)
                grads = torch.autograd.grad(out, [xi, *layer.parameters()], go)
                outs.append((out, dict(zip(["input", *(n for n, _ in layer.named_parameters())], grads))))
            for (o, gr), label in zip(outs[1:], ("ring", "reloaded")):
                assert_close(f"{label} out", o, outs[0][0], 1e-5)
                assert set(gr) == set(outs[0][1])
                for n, g0 in outs[0][1].items():
                    if n == "k_proj.bias":
                        # Zero by the definition (a shift of every key changes nothing):
                        # both hold roundoff, judged against the key weight's gradient.
                        err = (gr[n] - g0).norm() / outs[0][1]["k_proj.weight"].norm()
                        assert err <= 1e-5, f"{label} {n}: {err:.2e} of the key weight gradient"
                    else:
                        assert_close(f"{label} {n}", gr[n], g0, 1e-5)
            cases += 1
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
    return {"cases": cases, "failures": failures}


def cuda_files(rank: int, world: int) -> dict:
    from attn_dilated._nccl_link import LINKS

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    cases, failures = 0, []
    for layout in LAYOUTS:
        for path in files("dilated", "features"):
            try:
                one_file(path, rank, world, layout, "ring", device=device)
                cases += 1
            except Exception as e:
                failures.append(f"{path.parent.name}/{path.stem} {layout}: {type(e).__name__}: {e}")
    return {"cases": cases, "failures": failures, "links": len(LINKS)}


def nccl_id(rank: int, world: int) -> dict:
    """The link cache over the default gloo group with stand-ins for the native id maker
    and join (no GPU or NCCL involved)."""
    from attn_dilated._nccl_link import ID_BYTES, LinkCache

    made, joined = [], []

    def make_id() -> bytes:
        made.append(rank)
        return bytes([rank + 1, len(made)]) * (ID_BYTES // 2)

    def join(r, w, device, uid, timeout):
        joined.append((r, w, device, uid.hex()))
        return ("link", len(joined))

    cache = LinkCache(make_id, join)
    t = _transport.Transport(None)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = cache.get(t, cuda0, FAULT_TIMEOUT)
    again = cache.get(t, cuda0, FAULT_TIMEOUT)
    other_device = cache.get(t, cuda1, FAULT_TIMEOUT)
    other = _transport.Transport(dist.new_group(list(range(world))))
    other_group = cache.get(other, cuda0, FAULT_TIMEOUT)

    def broken() -> bytes:
        raise OSError("planted: no NCCL here")

    try:
        LinkCache(broken, join).get(t, cuda0, FAULT_TIMEOUT)
        failed = None
    except Exception as e:
        failed = f"{type(e).__name__}: {e}"
    everyone = [None] * world
    dist.all_gather_object(everyone, joined)
    return {
        "made": made, "joined": everyone, "reused": again == first, "other_device": other_device != first,
        "other_group": other_group not in (first, other_device), "cached": len(cache), "failed": failed,
    }


def main() -> None:
    mode, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    dist.init_process_group("nccl" if mode == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    try:
        if mode == "conformance":
            report = conformance(rank, world)
        elif mode in ("exit", "raise"):
            report = fault(rank, world, mode)
        elif mode == "mismatch":
            report = mismatch(rank, world)
        elif mode == "rows":
            report = rows(rank, world)
        elif mode == "strategies":
            report = strategies(rank, world)
        elif mode == "modules":
            report = modules(rank, world)
        elif mode == "cuda":
            report = cuda_files(rank, world)
        elif mode == "nccl_id":
            report = nccl_id(rank, world)
        else:
            raise SystemExit(f"unknown mode {mode}")
    except Exception:
        report = {"crashed": traceback.format_exc()}
    report.update(rank=rank, world=world, mode=mode)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    # Leave without tearing the group down: a failed round may have left transfers posted.
    os._exit(0)


if __name__ == "__main__":
    main()
