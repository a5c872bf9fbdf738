"""The multihead layer judged stage by stage: forward hooks record what each stage (the
projections, the attention op, LayerNorm, `out_proj`) was handed and returned, and every
row of each stage's result must lie within the row judge's bound (`checks.row_ratios`)
against the float64 stage on those same inputs, with the stage's magnitude (the sums of
absolute terms its roundings scale). The layer's output is `out_proj`'s.

Judged end to end instead, a first-order bound carried through the stages (the worst case
of every rounding) exceeds a row's own size in bf16: the attention averages values whose
rounding errors it may not assume to cancel, so a 5% error would pass."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import composition
from checks import row_ratios

STAGES = ("q_proj", "k_proj", "v_proj", "attention", "norm", "out_proj")


def record(layer):
    """Hooks on `layer`'s stages: returns `(records, remove)`, `records[name]` becoming
    `(inputs, output)` of the stage's last call."""
    records, handles = {}, []
    for name in STAGES:
        module = getattr(layer, name)
        if module is None:
            continue
        hook = lambda m, args, out, name=name: records.__setitem__(name, (args, out))
        handles.append(module.register_forward_hook(hook))
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
    return composition.dilated(q, k, v, att.segment_lengths, att.dilation_rates, mixing, causal, scale, pad, cu, att.window)[0]


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


def composed(layer, query, key, value, causal=False, pad=None, cu=None):
    """The stages' float64 references composed on `query`, `key`, `value`: the layer's
    output as the stages define it (to compare with the definition)."""
    p = {n: x.detach().double() for n, x in layer.named_parameters()}
    b, n, e = query.shape
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = linear(p, "q_proj", query.double())[0].view(b, n, h, d)
    k = linear(p, "k_proj", key.double())[0].view(b, key.shape[1], kvh, d)
    v = linear(p, "v_proj", value.double())[0].view(b, value.shape[1], kvh, d)
    x = attend(layer, q, k, v, causal, pad, cu).reshape(b, n, e)
    if layer.norm is not None:
        x = layer_norm(p, x, layer.norm.eps)[0]
    return linear(p, "out_proj", x)[0]
