"""The op against the plain-PyTorch composition of the definition: forward, LSE and
gradients for random configs (both mixings, windows, causal, grouped K/V, key padding,
packed sequences, cross-attention, strided layouts) in every dtype; tensors read in
place; results independent of the thread count; the interpreter released meanwhile."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.utils.checkpoint

import attn_dilated as ad
from attn_dilated import _native
from checks import BOUND, assert_close, assert_lse, assert_lse_rows, assert_rows, magnitudes, rel_l2, score_gradient_floor
import composition


def make_case(rng: random.Random) -> dict:
    """A random problem: config, sizes, masks and a memory layout."""
    mixing = rng.choice(["head_groups", "longnet", "window"])
    packed = rng.random() < 0.25
    cross = not packed and rng.random() < 0.2
    batch = 1 if packed else rng.choice([1, 2])
    n = rng.randint(1, 100)
    case = {
        "mixing": mixing,
        "causal": rng.random() < 0.5,
        "batch": batch,
        "n": n,
        "m": rng.randint(1, 100) if cross else n,
        "d": rng.choice([4, 8, 16, 32, 64]),
        "scale": None if rng.random() < 0.5 else rng.uniform(0.05, 0.5),
        "segs": [],
        "rates": [],
        "win": None,
        "layout": rng.choice(["contiguous", "bhsd", "fused"]),
    }
    if mixing == "window":
        case["win"] = (rng.randint(0, 20), rng.randint(0, 20))
        heads = rng.randint(1, 6)
    else:
        groups = rng.randint(1, 3)
        case["segs"] = [rng.randint(1, 64) for _ in range(groups)]
        case["rates"] = [rng.randint(1, min(4, w)) for w in case["segs"]]
        heads = rng.randint(groups if mixing == "head_groups" else 1, 6)
    case["heads"] = heads
    case["kv_heads"] = rng.choice([x for x in range(1, heads + 1) if heads % x == 0])
    case["pad_p"] = rng.choice([0.0, 0.0, 0.3, 0.9])
    if packed and n > 1:
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1))))
        case["cu"] = [0, *cuts, n]
    else:
        case["cu"] = None
    return case


def layout(shape, layout_name: str, gen: torch.Generator, dtype, device="cpu") -> torch.Tensor:
    """A leaf on `device` holding a `[b, s, h, d]` tensor in the given memory layout, and
    the view."""
    b, s, h, d = shape
    leaf = lambda *dims: torch.randn(*dims, generator=gen).to(dtype).to(device).requires_grad_()
    if layout_name == "bhsd":
        base = leaf(b, h, s, d)
        return base, base.transpose(1, 2)
    if layout_name == "fused":
        base = leaf(b, s, 2, h, d)
        return base, base[:, :, 1]
    base = leaf(b, s, h, d)
    return base, base


def run_case(case: dict, seed: int, dtype=torch.float32, device="cpu") -> None:
    """The op on `device` against the float64 composition on the CPU: output, LSE and
    gradients within the dtype's whole-tensor bound, and every row within its own bound
    (`checks.assert_rows`)."""
    gen = torch.Generator().manual_seed(seed)
    b, n, m, h, kvh, d = (case[x] for x in ("batch", "n", "m", "heads", "kv_heads", "d"))
    _, q = layout((b, n, h, d), case["layout"], gen, dtype, device)
    _, k = layout((b, m, kvh, d), case["layout"], gen, dtype, device)
    _, v = layout((b, m, kvh, d), case["layout"], gen, dtype, device)
    pad = (torch.rand(b, m, generator=gen) < case["pad_p"]) if case["pad_p"] > 0 else None
    grad_out = torch.randn(b, n, h, d, generator=gen).to(dtype)
    kw = dict(key_padding_mask=None if pad is None else pad.to(device), cu_seqlens=case["cu"], window=case["win"])
    segs, rates, causal, scale = case["segs"], case["rates"], case["causal"], case["scale"]
    mixing = case["mixing"] if case["mixing"] != "window" else "head_groups"
    # Odd seeds also send a gradient into the LSE (partial results merged by their LSEs).
    grad_lse = torch.randn(b, n, h, generator=gen) if seed % 2 else None
    out, lse = ad.dilated_attention_with_lse(q, k, v, segs, rates, causal, scale, mixing, **kw)
    if grad_lse is None:
        grads = torch.autograd.grad(out, (q, k, v), grad_out.to(device))
    else:
        # NaN where a row attends nothing: such a row takes no gradient from its LSE.
        grad_lse = torch.where(torch.isinf(lse.detach().cpu()), float("nan"), grad_lse)
        grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out.to(device), grad_lse.to(device)))
    assert out.device == q.device and all(g.device == q.device for g in grads)
    q, k, v = (x.detach().cpu() for x in (q, k, v))

    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ro, rl = composition.dilated(
        qr, kr, vr, segs, rates, case["mixing"], causal, scale, pad, case["cu"], case["win"]
    )
    if grad_lse is None:
        rgrads = torch.autograd.grad(ro, (qr, kr, vr), grad_out.double())
    else:
        rgrads = torch.autograd.grad((ro, rl), (qr, kr, vr), (grad_out.double(), grad_lse.double()))
    bound = BOUND[dtype]
    label = f"seed {seed} {case}"
    assert out.dtype == dtype and lse.dtype == torch.float32
    s = case["scale"] or d**-0.5
    attend = lambda q, k, v: composition.dilated(
        q, k, v, segs, rates, case["mixing"], causal, scale, pad, case["cu"], case["win"]
    )
    mag = magnitudes(attend, q, k, v, grad_out, grad_lse, s)
    try:
        assert_close("out", out, ro, bound)
        assert_rows("out", out, ro, mag["out"], dtype)
        assert_lse(lse, rl)
        assert_lse_rows(lse, rl, mag["lse"])
        for name, g, r, other in zip(("dq", "dk", "dv"), grads, rgrads, (k, q, None)):
            if other is not None and not r.any():
                # A constant softmax: the exact gradient is zero, the computed one rounding.
                floor = score_gradient_floor(s, grad_out, v, other)
                assert g.double().norm().item() <= floor, f"{name}: {g.norm():.3e} above the floor {floor:.3e}"
            else:
                assert_close(name, g, r, bound)
            assert_rows(name, g, r, mag[name], dtype)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


@pytest.mark.parametrize("seed", range(60))
def test_random_configs_match_the_composition_in_f32(seed):
    run_case(make_case(random.Random(seed)), seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(100, 112))
def test_random_configs_match_the_composition_in_low_precision(seed, dtype):
    run_case(make_case(random.Random(seed)), seed, dtype)


def test_a_planted_error_fails_the_bound():
    """The f32 bound bites: a 3e-5 relative change of the output, or a pattern offset
    moved by one, fails the comparison that the op passes."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=gen) for _ in range(3))
    out = ad.dilated_attention(q, k, v, [16, 32], [1, 2])
    want, _ = composition.dilated(*(x.double() for x in (q, k, v)), [16, 32], [1, 2])
    assert rel_l2(out, want) <= BOUND[torch.float32]
    assert rel_l2(out * (1 + 3e-5), want) > BOUND[torch.float32]
    qd, kd, vd = (x.double() for x in (q, k, v))
    wrong, _ = composition.one_sequence(qd, kd, vd, [16, 32], [2, 2], "head_groups", False, 0.25, None, None)
    assert rel_l2(out, wrong) > BOUND[torch.float32]


def test_strided_inputs_are_read_in_place(monkeypatch):
    """A view with unit inner stride reaches the kernels as its own address and strides
    (no copy); one whose inner stride is not 1 is made contiguous first."""
    seen = []
    real = _native.forward

    def spy(cfg, q, k, v, *rest, **kwargs):
        seen.append((q, k, v))
        return real(cfg, q, k, v, *rest, **kwargs)

    monkeypatch.setattr(_native, "forward", spy)
    qkv = torch.randn(2, 40, 3, 4, 8)
    q, k, v = qkv.unbind(2)
    out = ad.dilated_attention(q, k, v, [8, 16], [1, 2])
    (rq, rk, rv) = seen[-1]
    assert rq[0] == q.data_ptr() and rq[2] == q.stride() and rk[0] == k.data_ptr() and rv[2] == v.stride()
    assert torch.equal(out, ad.dilated_attention(q.contiguous(), k.contiguous(), v.contiguous(), [8, 16], [1, 2]))
    odd = torch.randn(2, 40, 4, 16)[..., ::2]
    out2 = ad.dilated_attention(odd, odd, odd, [8, 16], [1, 2])
    assert seen[-1][0][2][-1] == 1
    c = odd.contiguous()
    assert torch.equal(out2, ad.dilated_attention(c, c, c, [8, 16], [1, 2]))
    expanded = torch.randn(1, 40, 1, 8).expand(3, 40, 4, 8)
    out3 = ad.dilated_attention(expanded, expanded, expanded, [8, 16], [1, 2])
    assert seen[-1][0][2][0] == 0
    e = expanded.contiguous()
    assert torch.equal(out3, ad.dilated_attention(e, e, e, [8, 16], [1, 2]))


def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 4, 32, generator=gen).requires_grad_() for _ in range(3))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = ad.dilated_attention(q, k, v, [64, 128], [1, 2], is_causal=True, mixing="longnet")
            results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))


def test_the_interpreter_runs_other_threads_during_a_call():
    """While one thread computes, another keeps running Python: timestamps taken by the
    main thread fall inside the middle half of the call."""
    q = torch.randn(1, 8192, 8, 64)
    span = {}

    def work():
        span["t0"] = time.perf_counter()
        ad.dilated_attention(q, q, q, [4096, 8192], [1, 2])
        span["t1"] = time.perf_counter()

    t = threading.Thread(target=work)
    stamps = []
    t.start()
    while t.is_alive():
        stamps.append(time.perf_counter())
    t.join()
    t0, t1 = span["t0"], span["t1"]
    assert t1 - t0 > 0.02, f"call took {t1 - t0:.3f} s, too short to observe"
    lo, hi = t0 + 0.25 * (t1 - t0), t0 + 0.75 * (t1 - t0)
    assert sum(lo < s < hi for s in stamps) > 10


def split_keys_merged(q, k, v):
    """The attention of q over all of k, v as two halves of the keys merged by their LSEs
    (the ring / context-parallel pattern), one pattern that sees every key."""
    n = k.shape[1]
    o1, l1 = ad.dilated_attention_with_lse(q, k[:, : n // 2], v[:, : n // 2], [n], [1])
    o2, l2 = ad.dilated_attention_with_lse(q, k[:, n // 2 :], v[:, n // 2 :], [n], [1])
    lse = torch.logaddexp(l1, l2)[..., None]
    return torch.exp(l1[..., None] - lse) * o1 + torch.exp(l2[..., None] - lse) * o2


def test_partial_results_merged_by_their_lses_get_exact_gradients():
    """Two halves of the keys merged by their LSEs (the ring / context-parallel pattern)
    give the whole attention's output and gradients; a loss of the LSE alone gets the
    float64 composition's gradients."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 32, 2, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 64, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 32, 2, 8, generator=gen)
    merged = split_keys_merged(q, k, v)
    whole = ad.dilated_attention(q, k, v, [64], [1])
    assert_close("merged", merged, whole, BOUND[torch.float32])
    got = torch.autograd.grad(merged, (q, k, v), g)
    want = torch.autograd.grad(whole, (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(name, a, b, BOUND[torch.float32])
    # Dropping the LSE's gradient (the merge's weights as constants) is far off.
    o1, l1 = ad.dilated_attention_with_lse(q, k[:, :32], v[:, :32], [64], [1])
    o2, l2 = ad.dilated_attention_with_lse(q, k[:, 32:], v[:, 32:], [64], [1])
    l1, l2 = l1.detach(), l2.detach()
    lse = torch.logaddexp(l1, l2)[..., None]
    detached = torch.exp(l1[..., None] - lse) * o1 + torch.exp(l2[..., None] - lse) * o2
    assert rel_l2(torch.autograd.grad(detached, q, g)[0], want[0]) > 0.1
    # The LSE does not depend on v: its gradient there is zero.
    _, lse = ad.dilated_attention_with_lse(q, k, v, [16, 64], [1, 2], True, None, "longnet")
    qr, kr = (x.detach().double().requires_grad_() for x in (q, k))
    _, rl = composition.dilated(qr, kr, v.detach().double(), [16, 64], [1, 2], "longnet", True)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    for name, a, b in zip(("dq", "dk"), (dq, dk), torch.autograd.grad(rl.sum(), (qr, kr))):
        assert_close(name, a, b, BOUND[torch.float32])
    assert not dv.any()


def test_the_lse_for_its_value_costs_no_gradient():
    """The LSE read for its value, or returned from a reentrant checkpoint (which hands
    the unused LSE a zero gradient): the gradients are those of the output alone, bit for
    bit. Modified in place before the backward (which reads it), it is torch's usual
    error, never a silent wrong gradient."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 48, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 48, 4, 8, generator=gen)
    want = torch.autograd.grad(ad.dilated_attention(q, k, v, [16, 48], [1, 2]), (q, k, v), g)
    out, lse = ad.dilated_attention_with_lse(q, k, v, [16, 48], [1, 2])
    assert lse.requires_grad and torch.isfinite(lse).any()
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        lse.clamp_(min=-1e4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (q, k, v), g)
    out, lse = torch.utils.checkpoint.checkpoint(
        ad.dilated_attention_with_lse, q, k, v, [16, 48], [1, 2], use_reentrant=True
    )
    assert lse.requires_grad
    out.backward(g)  # a reentrant checkpoint takes no torch.autograd.grad
    assert all(torch.equal(x.grad, b) for x, b in zip((q, k, v), want))
    out, lse = ad.dilated_attention_with_lse(q, k, v, [16, 48], [1, 2])
    (out * lse.detach().exp()[..., None]).sum().backward()
    with torch.no_grad():
        assert not ad.dilated_attention_with_lse(q, k, v, [16, 48], [1, 2])[1].requires_grad
    q0 = q.detach()
    assert not ad.dilated_attention_with_lse(q0, q0, q0, [16, 48], [1, 2])[1].requires_grad


def test_autocast_casts_query_key_and_value_like_sdpa():
    """Under `torch.autocast`, as `scaled_dot_product_attention` does, query, key and value
    are cast to the autocast dtype (mixed dtypes included); the gradients reach the
    float32 leaves. Without autocast mixed dtypes stay an error."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(2, 32, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    kb = k.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ad.dilated_attention(q, kb, v, [8, 16], [1, 2], is_causal=True)
        out2, lse = ad.dilated_attention_with_lse(q, k, v, [8, 16], [1, 2], is_causal=True)
        layer_out = ad.DilatedAttention([8, 16], [1, 2])(q, kb, v, is_causal=True)
    want = ad.dilated_attention(q.bfloat16(), kb, v.bfloat16(), [8, 16], [1, 2], is_causal=True)
    assert out.dtype == out2.dtype == layer_out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, want) and torch.equal(out2, want) and torch.equal(layer_out, want)
    out.float().sum().backward()
    assert q.grad.dtype == v.grad.dtype == torch.float32 and kb.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        with pytest.raises(TypeError, match="key has dtype torch.bfloat16 but query has torch.float32"):
            ad.dilated_attention(q, kb, v, [8, 16], [1, 2])


def test_meta_tensors_give_shapes_and_dtypes():
    """On the `meta` device (shape probing, deferred initialisation) the registered op's
    fake implementation answers: output like query, LSE float32 `[batch, seq, heads]`,
    gradients like the inputs; the layer built on `meta` too."""
    meta = torch.device("meta")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.empty(2, 40, 6, 16, device=meta, dtype=dtype, requires_grad=True)
        k = torch.empty(2, 24, 3, 16, device=meta, dtype=dtype, requires_grad=True)
        out, lse = ad.dilated_attention_with_lse(q, k, k, [8, 16], [1, 2], is_causal=True)
        assert out.device == lse.device == meta
        assert out.shape == q.shape and out.dtype == dtype
        assert lse.shape == (2, 40, 6) and lse.dtype == torch.float32
        dq, dk = torch.autograd.grad(out, (q, k), torch.empty_like(out))
        assert (dq.shape, dq.dtype, dq.device) == (q.shape, dtype, meta)
        assert (dk.shape, dk.dtype, dk.device) == (k.shape, dtype, meta)
    layer = ad.MultiheadDilatedAttention(64, 4, [1, 2], [16, 32], device=meta)
    y, _ = layer(torch.empty(2, 48, 64, device=meta))
    assert y.shape == (2, 48, 64) and y.device == meta
    with pytest.raises(ValueError, match="key is on meta but query is on cpu"):
        ad.dilated_attention(torch.randn(2, 40, 6, 16), k, k, [8, 16], [1, 2])
