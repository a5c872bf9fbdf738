"""The multihead layer judged stage by stage: forward and backward hooks record what each
stage (the projections, the attention op, LayerNorm, `out_proj`) was handed and returned,
and every row of each stage's result (forward, and its gradients) must lie within the row
judge's bound (`checks.row_ratios`) against the float64 stage on those same inputs, with
the stage's magnitude (the sums of absolute terms its roundings scale, partial sums of a
sum over rows included). The layer's output is `out_proj`'s, its gradients the stages'.

Judged end to end instead, a first-order bound carried through the stages (the worst case
of every rounding) exceeds a row's own size in bf16: the attention averages values whose
rounding errors it may not assume to cancel, so a 5% error would pass."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import composition
from checks import magnitudes, row_ratios

STAGES = ("q_proj", "k_proj", "v_proj", "attention", "norm", "out_proj")


def record(layer):
    """Hooks on `layer`'s stages: returns `(records, remove)`, `records[name]` becoming
    `(inputs, output)` of the stage's last call and, after a backward,
    `records["d " + name]` its `(grad_inputs, grad_outputs)`."""
    records, handles = {}, []
    for name in STAGES:
        module = getattr(layer, name)
        if module is None:
            continue
        hook = lambda m, args, out, name=name: records.__setitem__(name, (args, out))
        back = lambda m, gin, gout, name=name: records.__setitem__("d " + name, (gin, gout))
        handles += [module.register_forward_hook(hook), module.register_full_backward_hook(back)]
    return records, lambda: [h.remove() for h in handles]


def linear(p: dict, name: str, x):
    """`x W^T + b` in float64 and its magnitude `|x| |W|^T + |b|`."""
    w, b = p[f"{name}.weight"], p.get(f"{name}.bias")
    want, mag = x @ w.T, x.abs() @ w.abs().T
    if b is not None:
        want, mag = want + b, mag + b.abs()
    return want, mag


def layer_norm(p: dict, x, eps: float):
    """LayerNorm in float64 and its magnitude: the normalised value rounded, then scaled
    (`|gamma hat|` each), the shift `|beta|` and the centring's cancellation."""
    g, beta = p["norm.weight"], p["norm.bias"]
    mean = x.mean(-1, keepdim=True)
    sigma = ((x - mean).square().mean(-1, keepdim=True) + eps).sqrt()
    hat = (x - mean) / sigma
    want = F.layer_norm(x, (x.shape[-1],), g, beta, eps)
    return want, g.abs() * (2 * hat.abs() + mean.abs() / sigma) + beta.abs()


def attend(layer, q, k, v, causal, pad, cu):
    """The definition's attention output of `layer`'s op (float64 composition)."""
    att = layer.attention
    mixing = att.mixing if att.window is None else "window"
    scale = att.softmax_scale if att.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    segs, rates = att.segment_lengths, att.dilation_rates
    return composition.dilated(q, k, v, segs, rates, mixing, causal, scale, pad, cu, att.window)[0]


def stage_ratios(layer, records, out, causal=False, pad=None, cu=None) -> dict:
    """Each stage's row ratios (`checks.row_ratios`) against its float64 reference on the
    recorded inputs; `out` stands for `out_proj`'s result (the layer's output)."""
    p = {n: x.detach().double() for n, x in layer.named_parameters()}
    dtype = out.dtype
    ratios = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        (x,), y = records[name]
        want, mag = linear(p, name, x.double())
        ratios[name] = row_ratios(name, y, want, mag, dtype)
    (q, k, v, *_), a = records["attention"]
    q, k, v = q.double(), k.double(), v.double()
    ratios["attention"] = row_ratios(
        "attention", a, attend(layer, q, k, v, causal, pad, cu), attend(layer, q, k, v.abs(), causal, pad, cu), dtype
    )
    if layer.norm is not None:
        (x,), y = records["norm"]
        want, mag = layer_norm(p, x.double(), layer.norm.eps)
        ratios["norm"] = row_ratios("norm", y, want, mag, dtype)
    (x,), _ = records["out_proj"]
    want, mag = linear(p, "out_proj", x.double())
    ratios["out"] = row_ratios("out", out, want, mag, dtype)
    return ratios


def partial_sums(dy):
    """Column sums of `dy` over its rows (every dim but the last) and their magnitude if
    accumulated in the dtype row after row: the partial sums' absolute values summed."""
    rows = dy.reshape(-1, dy.shape[-1])
    return rows.sum(0), rows.cumsum(0).abs().sum(0)


def linear_backward(p: dict, name: str, x, dy) -> dict:
    """`(want, magnitude)` of `dx`, `d.<name>.weight` and `d.<name>.bias` given `dy`."""
    w = p[f"{name}.weight"]
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    out = {
        "dx": (dy @ w, dy.abs() @ w.abs()),
        f"d.{name}.weight": (dy2.T @ x2, dy2.abs().T @ x2.abs()),
    }
    if f"{name}.bias" in p:
        out[f"d.{name}.bias"] = partial_sums(dy)
    return out


def layer_norm_backward(p: dict, x, dy, eps: float) -> dict:
    """`(want, magnitude)` of LayerNorm's `dx`, `d.norm.weight` and `d.norm.bias`:
    `dx = (g - mean(g) - hat mean(g hat)) / sigma` for `g = dy gamma` (its rounding carried
    through, and the centring's cancellation), `d.norm.weight` the row sums of the
    products `dy hat` (each rounded, `hat` too)."""
    g = dy * p["norm.weight"]
    mean = x.mean(-1, keepdim=True)
    sigma = ((x - mean).square().mean(-1, keepdim=True) + eps).sqrt()
    hat = (x - mean) / sigma
    m = lambda y: y.mean(-1, keepdim=True)
    dx = (g - m(g) - hat * m(g * hat)) / sigma
    dx_mag = (g.abs() + m(g.abs()) + hat.abs() * m((g * hat).abs()) + g.abs() * mean.abs() / sigma) / sigma
    dw, dw_partials = partial_sums(dy * hat)
    dw_mag = dw_partials + 2 * (dy * hat).abs().reshape(-1, x.shape[-1]).sum(0)
    return {"dx": (dx, dx_mag), "d.norm.weight": (dw, dw_mag), "d.norm.bias": partial_sums(dy)}


def attention_backward(layer, q, k, v, d_out, causal, pad, cu) -> dict:
    """`(want, magnitude)` of the attention op's `dq`, `dk`, `dv` given `d_out`: the
    composition's autograd gradients and `checks.magnitudes`' bounds."""
    scale = layer.attention.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(attend(layer, *leaves, causal, pad, cu), leaves, d_out)
    mags = magnitudes(lambda a, b, c: (attend(layer, a, b, c, causal, pad, cu), None), q, k, v, d_out, None, scale)
    return {name: (w, mags[name]) for name, w in zip(("dq", "dk", "dv"), want)}


def gradient_ratios(layer, records, grads: dict, causal=False, pad=None, cu=None) -> dict:
    """Each backward stage's row ratios against its float64 reference on the recorded
    inputs and incoming gradient; `grads` holds the layer's gradients by the files' names
    (`d_query`, and `d_key`, `d_value` in cross-attention; `d.<parameter>`)."""
    p = {n: x.detach().double() for n, x in layer.named_parameters()}
    dtype = next(iter(grads.values())).dtype
    ratios = {}

    def judge(name, got, want_mag):
        ratios[name] = row_ratios(name, got, want_mag[0], want_mag[1], dtype)

    def stage_in(name):
        return [x.detach().double() for x in records[name][0] if isinstance(x, torch.Tensor)]

    def grad_out(name):
        return records["d " + name][1][0].detach().double()

    def grad_in(name):
        return records["d " + name][0]

    for name, want in linear_backward(p, "out_proj", stage_in("out_proj")[0], grad_out("out_proj")).items():
        judge(f"out_proj {name}", grad_in("out_proj")[0] if name == "dx" else grads[name], want)
    if layer.norm is not None:
        back = layer_norm_backward(p, stage_in("norm")[0], grad_out("norm"), layer.norm.eps)
        for name, want in back.items():
            judge(f"norm {name}", grad_in("norm")[0] if name == "dx" else grads[name], want)
    q, k, v = stage_in("attention")[:3]
    back = attention_backward(layer, q, k, v, grad_out("attention"), causal, pad, cu)
    for i, (name, want) in enumerate(back.items()):
        judge(f"attention {name}", grad_in("attention")[i], want)
    dxs, dx_wants = {}, {}
    for name in ("q_proj", "k_proj", "v_proj"):
        back = linear_backward(p, name, stage_in(name)[0], grad_out(name))
        dxs[name], dx_wants[name] = grad_in(name)[0], back["dx"]
        for grad, want in back.items():
            judge(f"{name} {grad}", dxs[name] if grad == "dx" else grads[grad], want)
    if "d_key" in grads:
        for name, proj in (("d_query", "q_proj"), ("d_key", "k_proj"), ("d_value", "v_proj")):
            assert torch.equal(grads[name], dxs[proj]), f"{name} is {proj}'s input gradient"
            judge(name, grads[name], dx_wants[proj])
    else:
        parts = [x.detach().double() for x in dxs.values()]
        judge("d_query", grads["d_query"], (sum(parts), sum(x.abs() for x in parts)))
    return ratios


def composed_with_gradients(layer, x: dict, grad_out, causal=False, pad=None):
    """The stages' float64 references composed on `x` (`query`, and `key`, `value` in
    cross-attention), forward and, given `grad_out`, backward: `(out, grads)` by the files'
    names."""
    p = {n: w.detach().double() for n, w in layer.named_parameters()}
    query = x["query"]
    key, value = x.get("key", query), x.get("value", query)
    b, n, e = query.shape
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    m = key.shape[1]
    proj = {"q_proj": query, "k_proj": key, "v_proj": value}
    q = linear(p, "q_proj", query)[0].view(b, n, h, d)
    k = linear(p, "k_proj", key)[0].view(b, m, kvh, d)
    v = linear(p, "v_proj", value)[0].view(b, m, kvh, d)
    a = attend(layer, q, k, v, causal, pad, None).reshape(b, n, e)
    y = a if layer.norm is None else layer_norm(p, a, layer.norm.eps)[0]
    out = linear(p, "out_proj", y)[0]
    grads = {}
    if grad_out is None:
        return out, grads
    back = linear_backward(p, "out_proj", y, grad_out.double())
    da = back.pop("dx")[0]
    grads.update({k_: w for k_, (w, _) in back.items()})
    if layer.norm is not None:
        back = layer_norm_backward(p, a, da, layer.norm.eps)
        da = back.pop("dx")[0]
        grads.update({k_: w for k_, (w, _) in back.items()})
    att = attention_backward(layer, q, k, v, da.view(b, n, h, d), causal, pad, None)
    dxs = {}
    for (name, xin), (_, (dy, _)) in zip(proj.items(), att.items()):
        back = linear_backward(p, name, xin, dy.reshape(b, xin.shape[1], -1))
        dxs[name] = back.pop("dx")[0]
        grads.update({k_: w for k_, (w, _) in back.items()})
    if "key" in x:
        grads.update(d_query=dxs["q_proj"], d_key=dxs["k_proj"], d_value=dxs["v_proj"])
    else:
        grads["d_query"] = sum(dxs.values())
    return out, grads
