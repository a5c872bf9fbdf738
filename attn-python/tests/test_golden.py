"""Every conformance vector of the repository through the Python API: the attention
files (`dilated/`, `features/`, `wide/`: cross-attention with keys of their own length)
through the op, forward and gradients, and the layer files (`multihead/`,
`multihead_features/`, and `multihead_grad/` with every input and parameter gradient)
through `MultiheadDilatedAttention` with the file's parameters loaded by name; each
tensor within the file's `rel_tol`, each LSE within its own row's bound, at fixed file
counts; and the attention files in bf16 and f16, every row within its bound against the
float64 reference on the inputs rounded to that dtype (attn-testkit's rule for a
low-precision backend)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import attn_dilated as ad
import composition
from checks import BOUND, assert_close, assert_lse, assert_lse_rows, assert_rows, magnitudes, row_max
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


# The files each directory holds: one removed fails here, not by running fewer cases.
COUNTS = {
    "dilated": 9,
    "features": 9,
    "wide": 5,
    "multihead": 2,
    "multihead_features": 1,
    "multihead_grad": 3,
    "multihead_qkln": 2,
    "blocks": 8,
}


def test_conformance_counts():
    for d, n in COUNTS.items():
        assert len(list((CONFORMANCE / d).glob("*.safetensors"))) == n, d


@pytest.mark.parametrize("path", files("dilated", "features", "wide"), ids=lambda p: f"{p.parent.name}/{p.stem}")
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


def composition_args(meta: dict, t: dict) -> dict:
    """The float64 composition's arguments for a file: its config and masks."""
    window = meta["mixing"] == "window"
    cu = t.get("cu_seqlens")
    mask = t.get("key_padding_mask")
    return {
        "segs": [] if window else ints(meta["segment_lengths"]),
        "rates": [] if window else ints(meta["dilation_rates"]),
        "mixing": meta["mixing"],
        "causal": meta["causal"] in ("true", "True", "1"),
        "scale": float(meta["scale"]) if "scale" in meta else None,
        "pad": None if mask is None else mask.bool(),
        "cu_seqlens": None if cu is None else [int(x) for x in cu],
        "win": (int(meta["window_left"]), int(meta["window_right"])) if window else None,
        "blocks": (t["block_mask"], int(meta["block_size"])) if "block_mask" in t else None,
    }


def block_args(meta: dict, t: dict) -> dict:
    """The op's block mask arguments of a file (none without a block mask)."""
    if "block_mask" not in t:
        return {}
    return {"block_mask": t["block_mask"], "block_size": int(meta["block_size"])}


def low_precision_judge(path, dtype, plant=None):
    """The op in `dtype` on the file's inputs rounded to it, judged against the float64
    composition on those rounded inputs: whole tensors within the dtype's bound, every
    row and LSE within its own. The composition itself must reproduce the file on the
    unrounded inputs. `plant(name, tensor)` may alter a result before it is judged."""
    meta, t, rel_tol = read(path)
    args = composition_args(meta, t)
    attend = lambda q, k, v: composition.dilated(q, k, v, **args)
    file_out, _ = attend(*(t[x].double() for x in ("q", "k", "v")))
    assert_close("composition out", file_out, t["out"], rel_tol)
    q, k, v, go = (t[x].to(dtype) for x in ("q", "k", "v", "grad_out"))
    qi, ki, vi = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = ad.dilated_attention_with_lse(qi, ki, vi, **config_args(meta), **masks(t), **block_args(meta, t))
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qi, ki, vi), go)), out=out)
    assert out.dtype == dtype and lse.dtype == torch.float32
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = attend(qr, kr, vr)
    want = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(ro, (qr, kr, vr), go.double())), out=ro)
    scale = args["scale"] or q.shape[-1] ** -0.5
    mag = magnitudes(attend, q, k, v, go, None, scale)
    if plant is not None:
        got = {name: plant(name, x.detach().clone()) for name, x in got.items()}
    assert_lse(lse, rl)
    assert_lse_rows(lse, rl, mag["lse"])
    for name in ("out", "dq", "dk", "dv"):
        assert_close(name, got[name], want[name], BOUND[dtype])
        assert_rows(name, got[name], want[name], mag[name], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("path", files("dilated", "features", "wide"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_attention_vectors_in_low_precision(path, dtype):
    low_precision_judge(path, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_planted_low_precision_row_error_fails(dtype):
    """One output row of a feature file (grouped heads, key padding, a window) off by 5%
    of its norm fails the row judge, though the whole tensor (640 rows) stays within the
    dtype's bound."""
    path = CONFORMANCE / "features" / "win_bidir_gqa_pad.safetensors"

    def plant(name, x):
        if name == "out":
            assert x[1, 40, 2].abs().max() > 0
            x[1, 40, 2] *= 1.05
        return x

    with pytest.raises(AssertionError, match="out: row") as caught:
        low_precision_judge(path, dtype, plant)
    print(f"planted {dtype}: {caught.value}")


LAYER_PARAMS = ("q_proj", "k_proj", "v_proj", "norm", "q_ln", "k_ln", "out_proj")


def layer_of(meta: dict, t: dict, forward_convention: str = "published"):
    """The file's layer with its parameters loaded by name."""
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
        norm_layout="qk_ln" if meta.get("norm_layout") == "qk_ln" else "sub_ln",
        forward_convention=forward_convention,
    )
    params = {name: x for name, x in t.items() if name.split(".")[0] in LAYER_PARAMS}
    layer.load_state_dict(params, strict=True)
    return layer


@pytest.mark.parametrize(
    "path", files("multihead", "multihead_features", "multihead_qkln"), ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_layer_vectors(path):
    """Each layer file with its parameters loaded by name (`strict=True`; the
    development line's `q_ln`/`k_ln` files through `norm_layout="qk_ln"`)."""
    meta, t, rel_tol = read(path)
    assert meta["kind"] == "multihead"
    layer = layer_of(meta, t)
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


@pytest.mark.parametrize("path", files("multihead_qkln"), ids=lambda p: p.stem)
def test_development_line_files_through_its_call_convention(path):
    """The development line's files called as that line calls its layer: `(query, key,
    value, key_padding_mask, need_weights, attn_mask, is_causal, average_attn_weights)`
    by position, the output tensor returned."""
    meta, t, rel_tol = read(path)
    layer = layer_of(meta, t, forward_convention="development")
    layer.eval()
    cross = meta["cross_attention"] == "true"
    key, value = (t["key"], t["value"]) if cross else (None, None)
    mask = t.get("key_padding_mask")
    with torch.no_grad():
        out = layer(t["query"], key, value, None if mask is None else mask.bool(), False, None, meta["causal"] == "true", True)
    assert isinstance(out, torch.Tensor)
    assert_close("out", out, t["out"], rel_tol)


def test_the_forward_conventions_take_their_own_arguments():
    torch.manual_seed(0)
    published = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], norm_layout="qk_ln")
    development = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], norm_layout="qk_ln", forward_convention="development")
    development.load_state_dict(published.state_dict(), strict=True)
    x, pad = torch.randn(2, 16, 32), torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 12:] = True
    with torch.no_grad():
        want, weights = published(x, x, x, True, key_padding_mask=pad)
        assert weights is None
        torch.testing.assert_close(development(x, x, x, pad, False, None, True), want, rtol=0, atol=0)
        torch.testing.assert_close(development(x, is_causal=True, key_padding_mask=pad), want, rtol=0, atol=0)
        # Positions mean what each convention says: the development line's fourth is the mask.
        assert not torch.equal(development(x, x, x, pad), want)
    for layer, args in ((published, (x, x, x, True, pad)), (development, (x, x, x, pad, False, None, True, True, 0))):
        with pytest.raises(TypeError, match="positional"):
            layer(*args)
    with pytest.raises(TypeError, match="both"):
        development(x, x, x, pad, key_padding_mask=pad)
    with pytest.raises(TypeError, match="development"):
        published(x, average_attn_weights=True)
    with pytest.raises(ValueError, match="need_weights"):
        development(x, x, x, None, True)
    with pytest.raises(ValueError, match="forward_convention"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], forward_convention="dev")


def test_norm_layouts_name_their_parameters():
    names = lambda layout: set(
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=2, norm_layout=layout).state_dict()
    )
    assert {"norm.weight", "norm.bias"} <= names("sub_ln") and not any("_ln." in n for n in names("sub_ln"))
    qk = names("qk_ln")
    assert {"q_ln.weight", "q_ln.bias", "k_ln.weight", "k_ln.bias"} <= qk and not any(n.startswith("norm.") for n in qk)
    layer = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=2, norm_layout="qk_ln")
    assert layer.k_ln.normalized_shape == (16,)  # k's width: num_kv_heads * head_dim
    with pytest.raises(ValueError, match="norm_layout"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], norm_layout="pre_ln")


def assert_grad_close(name: str, got: torch.Tensor, t: dict, rel_tol: float) -> None:
    """A layer gradient against the file. The key bias's gradient is zero by the
    definition (one shift of every key changes nothing) and the file holds float64
    roundoff there: a bias gradient below f32 resolution of its weight's gradient is
    judged relative to that weight gradient's norm (attn-testkit's rule)."""
    want = t[name]
    weight = t.get(name[: -len(".bias")] + ".weight") if name.endswith(".bias") else None
    scale = None if weight is None else weight.double().norm().item()
    if scale is not None and want.double().norm().item() < torch.finfo(torch.float32).eps * scale:
        err = (got.detach().double() - want.double()).norm().item() / scale
        assert err <= rel_tol, f"{name}: error {err:.3e} of the weight gradient's norm > {rel_tol:.0e}"
    else:
        assert_close(name, got, want, rel_tol)


@pytest.mark.parametrize("path", files("multihead_grad"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_layer_gradient_vectors(path):
    meta, t, rel_tol = read(path)
    assert meta["kind"] == "multihead"
    layer = layer_of(meta, t)
    cross = meta["cross_attention"] == "true"
    inputs = {n: t[n].clone().requires_grad_() for n in (("query", "key", "value") if cross else ("query",))}
    out, _ = layer(
        inputs["query"], inputs.get("key"), inputs.get("value"), is_causal=meta["causal"] == "true"
    )
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad(out, [*inputs.values(), *params.values()], t["grad_out"])
    got = dict(zip([f"d_{n}" for n in inputs] + [f"d.{n}" for n in params], grads))
    want = {n for n in t if n.startswith("d_") or n.startswith("d.")}
    assert set(got) == want, f"gradients {sorted(got)} != the file's {sorted(want)}"
    assert_close("out", out, t["out"], rel_tol)
    for name, g in got.items():
        assert_grad_close(name, g, t, rel_tol)


def test_a_planted_layer_gradient_error_fails():
    """The judge above rejects a gradient off by a relative 1e-4, and a nonzero key-bias
    gradient where the definition makes it zero."""
    meta, t, rel_tol = read(CONFORMANCE / "multihead_grad" / "mhg_self_ln_hg.safetensors")
    with pytest.raises(AssertionError, match="d.v_proj.weight"):
        assert_grad_close("d.v_proj.weight", t["d.v_proj.weight"] * (1 + 1e-4), t, rel_tol)
    bias = t["d.k_proj.bias"].clone()
    bias[0] = 1e-2
    with pytest.raises(AssertionError, match="d.k_proj.bias"):
        assert_grad_close("d.k_proj.bias", bias, t, rel_tol)
