"""The layer conformance files (`multihead/`, `multihead_features/`, and `multihead_grad/`
with every gradient) through `MultiheadDilatedAttention` in bf16 and f16, stage by stage
(`layer_stages`): every row of each projection, the attention op, LayerNorm and
`out_proj`, forward and backward, within the row judge's bound against the float64 stage
on the inputs that stage was handed (the file's tensors rounded to the dtype at the
start). The float64 stages composed on the file's own tensors give its output and
gradients first; a row 5% off fails."""

from __future__ import annotations

import pytest
import torch

import layer_stages
from checks import assert_close
from test_golden import assert_grad_close, files, layer_of, read

DIRS = ("multihead", "multihead_features", "multihead_grad")
DTYPES = (torch.bfloat16, torch.float16)


def inputs_of(meta: dict, t: dict, dtype) -> dict:
    names = ("query", "key", "value") if meta["cross_attention"] == "true" else ("query",)
    return {n: t[n].to(dtype).requires_grad_() for n in names}


def pad_of(t: dict):
    mask = t.get("key_padding_mask")
    return None if mask is None else mask.bool()


def run(path, dtype):
    """The file's layer in `dtype` on its tensors rounded to it, its stages recorded:
    `(layer, records, out, grads)`, `grads` by the file's names (empty without grad_out)."""
    meta, t, _ = read(path)
    layer = layer_of(meta, t).to(dtype)
    x = inputs_of(meta, t, dtype)
    records, remove = layer_stages.record(layer)
    causal = meta["causal"] == "true"
    out, _ = layer(x["query"], x.get("key"), x.get("value"), causal, key_padding_mask=pad_of(t))
    grads = {}
    if "grad_out" in t:
        params = dict(layer.named_parameters())
        got = torch.autograd.grad(out, [*x.values(), *params.values()], t["grad_out"].to(dtype))
        grads = dict(zip([f"d_{n}" for n in x] + [f"d.{n}" for n in params], got))
    remove()
    return layer, records, out.detach(), grads


def judge(path, layer, records, out, grads) -> dict:
    meta, t, _ = read(path)
    causal, pad = meta["causal"] == "true", pad_of(t)
    ratios = layer_stages.stage_ratios(layer, records, out, causal, pad)
    if grads:
        ratios.update(layer_stages.gradient_ratios(layer, records, grads, causal, pad))
    return ratios


def test_the_files_are_all_there():
    found = files(*DIRS)
    assert len(found) == 6 and sum("grad_out" in read(p)[1] for p in found) == 3


@pytest.mark.parametrize("path", files(*DIRS), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_float64_stages_give_the_files_output_and_gradients(path):
    meta, t, rel_tol = read(path)
    layer = layer_of(meta, t)
    x = {n: v.double() for n, v in inputs_of(meta, t, torch.float64).items()}
    out, grads = layer_stages.composed_with_gradients(
        layer, x, t.get("grad_out"), meta["causal"] == "true", pad_of(t)
    )
    assert_close("out", out, t["out"], rel_tol)
    want = {n for n in t if n.startswith("d_") or n.startswith("d.")}
    assert set(grads) == want, f"gradients {sorted(grads)} != the file's {sorted(want)}"
    for name, g in grads.items():
        assert_grad_close(name, g, t, rel_tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", files(*DIRS), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_layer_files_in_low_precision_stage_by_stage(path, dtype):
    layer, records, out, grads = run(path, dtype)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads.values())
    ratios = judge(path, layer, records, out, grads)
    assert len(ratios) >= 5 and all(r.numel() > 0 for r in ratios.values())
    if grads:
        judged = {n.split(" ")[-1] for n in ratios}
        assert set(grads) <= judged, f"gradients not judged: {sorted(set(grads) - judged)}"
    print(dtype, len(ratios), "tensors; worst:", max((r.max().item(), n) for n, r in ratios.items()))
    for name, r in ratios.items():
        assert r.max() <= 1, f"{dtype} {name}: row {int(r.argmax())} at {r.max():.2f} of its bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_five_percent_off_fails(dtype):
    """One row of the output or of `d_query` scaled by 1.05 fails its check, and only it."""
    path = files("multihead_grad")[1]
    assert path.stem == "mhg_self_ln_hg"
    layer, records, out, grads = run(path, dtype)
    assert all(r.max() <= 1 for r in judge(path, layer, records, out, grads).values())
    for tensor in ("out", "d_query"):
        wrong_out, wrong_grads = out.clone(), dict(grads)
        if tensor == "out":
            wrong_out[1, 37] *= 1.05
        else:
            wrong_grads["d_query"] = grads["d_query"].clone()
            wrong_grads["d_query"][1, 37] *= 1.05
        ratios = judge(path, layer, records, wrong_out, wrong_grads)
        failed = {n: r for n, r in ratios.items() if r.max() > 1}
        assert list(failed) == [tensor] and failed[tensor][1, 37] > 1, f"{dtype}: {tensor} planted: {list(failed)}"
        print(f"{dtype}: planted {tensor} row at {failed[tensor][1, 37]:.2f} of its bound")
