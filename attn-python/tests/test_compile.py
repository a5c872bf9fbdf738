"""The op as `torch.ops.attn_dilated.attention`: `torch.library.opcheck` (schema, fake
tensors, autograd registration, AOT dispatch) on configurations with grouped K/V, key
padding, packed sequences, windows and cross-attention, and `torch.compile` with
`fullgraph=True` (no graph break) of the op and of the layer, whose output and gradients
equal eager mode's bit for bit."""

from __future__ import annotations

import pytest
import torch

import attn_dilated as ad
from checks import assert_close

OP = torch.ops.attn_dilated.attention.default
BACKWARD = torch.ops.attn_dilated.attention_backward.default


def problem(seed: int, *, b=1, n=48, m=None, h=4, kvh=2, d=8, pad=False):
    gen = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, n, h, d, generator=gen, requires_grad=True)
    k = torch.randn(b, m, kvh, d, generator=gen, requires_grad=True)
    v = torch.randn(b, m, kvh, d, generator=gen, requires_grad=True)
    mask = (torch.rand(b, m, generator=gen) < 0.3) if pad else None
    return q, k, v, mask


# (name, problem kwargs, op arguments after q, k, v: segments, rates, causal, scale,
# mixing, window, then cu_seqlens)
CASES = [
    ("head_groups", {}, ([16, 48], [1, 2], False, None, "head_groups", None), None),
    ("causal_longnet_padded", {"b": 2, "pad": True}, ([16, 48], [1, 3], True, 0.3, "longnet", None), None),
    ("window_packed", {"kvh": 1}, ([], [], True, None, "window", [5, 0]), [0, 20, 48]),
    ("cross", {"m": 30, "kvh": 4}, ([16], [2], False, None, "head_groups", None), None),
]


@pytest.mark.parametrize("name,kw,spec,cu", CASES, ids=[c[0] for c in CASES])
def test_opcheck_passes(name, kw, spec, cu):
    q, k, v, mask = problem(3, **kw)
    torch.library.opcheck(OP, (q, k, v, *spec, mask, cu))
    out, lse = OP(q, k, v, *spec, mask, cu)
    grad = torch.randn_like(out)
    args = (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *spec, mask, cu)
    torch.library.opcheck(BACKWARD, args)
    torch.library.opcheck(BACKWARD, (*args, torch.randn_like(lse)))


def run(fn, q, k, v):
    """Output and the gradients of `sum(out * g)` for a fixed `g`."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    g = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_op_equals_eager(backend):
    q, k, v, mask = problem(5, b=2, pad=True)

    def f(q, k, v):
        return ad.dilated_attention(q, k, v, [16, 48], [1, 2], True, key_padding_mask=mask) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    for got, want, name in zip(run(compiled, q, k, v), run(f, q, k, v), ("out", "dq", "dk", "dv")):
        assert torch.equal(got, want), f"{name} differs under torch.compile({backend!r})"


def layer_run(layer, x):
    """The layer's causal output and each parameter's gradient of `sum(out ** 2)`."""
    layer.zero_grad()
    out, _ = layer(x, is_causal=True)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_compiled_layer_equals_eager():
    torch.manual_seed(11)
    layer = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=2)
    x = torch.randn(2, 32, 32)
    want, want_grads = layer_run(layer, x)
    torch._dynamo.reset()
    got, grads = layer_run(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    assert torch.equal(got, want)
    for n, g in grads.items():
        assert torch.equal(g, want_grads[n.removeprefix("_orig_mod.")]), f"{n}.grad differs under torch.compile"


def test_a_bad_config_fails_at_trace_time():
    """The fake implementation validates the config, so a compiled call with a bad one
    raises the op's ValueError message (wrapped by dynamo) before anything runs."""
    q, k, v, _ = problem(1)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ad.dilated_attention(q, k, v, [16, 0], [1, 2]), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="segment"):
        f(q, k, v)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_lse_gradients_under_compile(backend):
    """Compiled with `fullgraph=True`: an LSE merge compiles and its gradients equal eager
    mode's; a function returning `(out, lse)` gives eager mode's gradients bit for bit,
    whether only `out` or also the LSE is differentiated."""
    from test_op import split_keys_merged

    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 32, 2, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 64, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    torch._dynamo.reset()
    compiled_merge = torch.compile(split_keys_merged, fullgraph=True, backend=backend)
    # Inductor fuses the merge's pointwise ops (other roundings).
    got, want = run(compiled_merge, q, k, v), run(split_keys_merged, q, k, v)
    for a, b, name in zip(got, want, ("merged", "dq", "dk", "dv")):
        assert_close(name, a, b, 1e-6)

    def with_lse(q, k, v):
        return ad.dilated_attention_with_lse(q, k, v, [16, 64], [1, 2], True)

    compiled = torch.compile(with_lse, fullgraph=True, backend=backend)
    got = run(lambda q, k, v: compiled(q, k, v)[0], q, k, v)
    want = run(lambda q, k, v: with_lse(q, k, v)[0], q, k, v)
    for a, b, name in zip(got, want, ("out", "dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name} differs under torch.compile({backend!r})"
    got = torch.autograd.grad(compiled(q, k, v)[1].sum(), (q, k, v))
    want = torch.autograd.grad(with_lse(q, k, v)[1].sum(), (q, k, v))
    for a, b, name in zip(got, want, ("dq", "dk", "dv")):
        assert torch.equal(a, b), f"LSE {name} differs under torch.compile({backend!r})"
