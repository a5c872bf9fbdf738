"""Every conformance vector of the repository through the Python API: the attention
files (`dilated/`, `features/`) through the op, forward and gradients, and the layer
files (`multihead/`, `multihead_features/`) through `MultiheadDilatedAttention` with
the file's parameters loaded by name; each tensor within the file's `rel_tol`, and each
LSE within its own row's bound."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import attn_dilated as ad
from checks import assert_close, assert_lse, assert_lse_rows, row_max
from conftest import CONFORMANCE

# A file cannot make its own check lax (attn-testkit's MAX_REL_TOL).
MAX_REL_TOL = 1e-3


def files(*dirs: str) -> list:
    found = sorted(p for d in dirs for p in (CONFORMANCE / d).glob("*.safetensors"))
    assert found, f"no conformance files under {CONFORMANCE} in {dirs}"
    return found


def read(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    rel_tol = float(meta["rel_tol"])
    assert 0 < rel_tol <= MAX_REL_TOL
    return meta, tensors, rel_tol


def ints(s: str) -> list:
    return [int(x) for x in s.split(",")] if s else []


def config_args(meta: dict) -> dict:
    """The op's config arguments from a file's metadata."""
    args = {
        "is_causal": meta["causal"] in ("true", "True", "1"),
        "softmax_scale": float(meta["scale"]) if "scale" in meta else None,
    }
    if meta["mixing"] == "window":
        args.update(segment_lengths=[], dilation_rates=[], window=(int(meta["window_left"]), int(meta["window_right"])))
    else:
        args.update(
            segment_lengths=ints(meta["segment_lengths"]),
            dilation_rates=ints(meta["dilation_rates"]),
            mixing=meta["mixing"],
        )
    return args


def masks(tensors: dict) -> dict:
    mask = tensors.get("key_padding_mask")
    cu = tensors.get("cu_seqlens")
    return {"key_padding_mask": None if mask is None else mask.bool(), "cu_seqlens": cu}


def assert_lse_vector(lse, t: dict, meta: dict) -> None:
    """A file's LSEs row by row (`checks.assert_lse_rows`), each row's magnitude bounded
    from the file's q and k: `scale * |q_p| * max |k_t| + ln(key count)`."""
    q, k = t["q"].double(), t["k"].double()
    scale = float(meta["scale"]) if "scale" in meta else q.shape[-1] ** -0.5
    assert_lse_rows(lse, t["lse"], scale * q.norm(dim=-1) * row_max(k) + math.log(k.shape[1]))


@pytest.mark.parametrize("path", files("dilated", "features"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_attention_vectors(path):
    meta, t, rel_tol = read(path)
    assert meta["kind"] == "dilated"
    q, k, v = (t[x].clone().requires_grad_() for x in ("q", "k", "v"))
    out, lse = ad.dilated_attention_with_lse(q, k, v, **config_args(meta), **masks(t))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["grad_out"])
    assert_close("out", out, t["out"], rel_tol)
    if "lse" in t:
        assert_lse(lse, t["lse"], rel_tol)
        assert_lse_vector(lse, t, meta)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(name, got, t[name], rel_tol)


LAYER_PARAMS = ("q_proj", "k_proj", "v_proj", "norm", "out_proj")


@pytest.mark.parametrize("path", files("multihead", "multihead_features"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_layer_vectors(path):
    meta, t, rel_tol = read(path)
    assert meta["kind"] == "multihead"
    embed, heads = int(meta["embed_dim"]), int(meta["num_heads"])
    layer = ad.MultiheadDilatedAttention(
        embed,
        heads,
        ints(meta["dilation_rates"]),
        ints(meta["segment_lengths"]),
        layer_norm=meta["layer_norm"] == "true",
        layer_norm_eps=float(meta["layer_norm_eps"]),
        mixing=meta["mixing"],
        num_kv_heads=int(meta.get("num_kv_heads", heads)),
    )
    params = {name: x for name, x in t.items() if name.split(".")[0] in LAYER_PARAMS}
    layer.load_state_dict(params, strict=True)
    layer.eval()
    cross = meta["cross_attention"] == "true"
    key, value = (t["key"], t["value"]) if cross else (None, None)
    mask = t.get("key_padding_mask")
    with torch.no_grad():
        out, weights = layer(
            t["query"],
            key,
            value,
            key_padding_mask=None if mask is None else mask.bool(),
            is_causal=meta["causal"] == "true",
        )
    assert weights is None
    assert_close("out", out, t["out"], rel_tol)
