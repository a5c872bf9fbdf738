"""Bad input raises ValueError or TypeError carrying the AttnError's message, from the
Python checks and from the Rust checks alike; nothing crashes the interpreter."""

from __future__ import annotations

import pytest
import torch

import attn_dilated as ad
from attn_dilated import _kernels, _native


def qkv(b=1, n=32, h=4, d=8, dtype=torch.float32):
    return [torch.randn(b, n, h, d, dtype=dtype) for _ in range(3)]


def run(q, k, v, segs=(8, 16), rates=(1, 2), **kw):
    return ad.dilated_attention(q, k, v, list(segs), list(rates), **kw)


@pytest.mark.parametrize(
    "segs, rates, kw, message",
    [
        ((), (), {}, "at least one pattern"),
        ((8, 16), (1,), {}, "segment_lengths has 2 entries but dilation_rates has 1"),
        ((8, 0), (1, 1), {}, "segment length 1 is zero"),
        ((8,), (0,), {}, "dilation rate 0 is zero"),
        ((4,), (8,), {}, r"dilation rate 0 \(8\) is larger than its segment length \(4\)"),
        ((8, 16), (1, 2), {"softmax_scale": -1.0}, "not finite and positive"),
        ((8, 16), (1, 2), {"softmax_scale": float("nan")}, "not finite and positive"),
        ((8, 16), (1, 2), {"mixing": "dense"}, "mixing must be one of"),
        ((8, 16), (1, 2), {"window": (3, 1)}, "window and segment lengths"),
        ((), (), {"window": (3, 1), "mixing": "longnet"}, "does not match the window setting"),
        ((-8,), (1,), {}, "non-negative"),
    ],
)
def test_bad_configs_raise_value_error(segs, rates, kw, message):
    with pytest.raises(ValueError, match=message):
        run(*qkv(), segs, rates, **kw)


def test_too_few_heads_for_the_head_groups():
    with pytest.raises(ValueError, match="3 heads cannot be split into 4 head groups"):
        run(*qkv(h=3), (8, 8, 8, 8), (1, 1, 1, 1))


def test_bad_shapes_raise_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        run(q[0], k, v)
    with pytest.raises(ValueError, match="k has shape"):
        run(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="v has shape"):
        run(q, k, v[:, :16])
    with pytest.raises(ValueError, match="dimension `seq` of q is zero"):
        run(q[:, :0], k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        run(q, k[:, :, :3], v[:, :, :3])


def test_bad_dtypes_and_devices():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        run(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="but query has torch.float32"):
        run(q, k.half(), v)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        run(q.numpy(), k, v)
    # Meta tensors together are shape probing (test_op); beside CPU ones, an error.
    meta = torch.empty(1, 32, 4, 8, device="meta")
    with pytest.raises(ValueError, match="key is on meta"):
        run(q, meta, v)
    with pytest.raises(ValueError, match="key_padding_mask is on meta but query is on cpu"):
        run(q, k, v, key_padding_mask=torch.zeros(1, 32, dtype=torch.bool, device="meta"))
    # The kernels' entry itself (what the registered op calls) refuses another device's
    # memory before it reads any: a CUDA tensor beside CPU ones would otherwise be read on
    # the host.
    cfg = ad.make_config([8, 16], [1, 2])
    with pytest.raises(ValueError, match="value is on meta but query is on cpu"):
        _kernels.forward(cfg, q, k, meta, None, None)
    with pytest.raises(ValueError, match="key_padding_mask is on meta"):
        _kernels.forward(cfg, q, k, v, torch.zeros(1, 32, dtype=torch.bool, device="meta"), None)
    out, lse = _kernels.forward(cfg, q, k, v, None, None)
    with pytest.raises(ValueError, match="grad_out is on meta but query is on cpu"):
        _kernels.backward(cfg, meta, q, k, v, out, lse, None, None)
    with pytest.raises(ValueError, match="lse is on meta"):
        _kernels.backward(cfg, out, q, k, v, out, lse.to("meta"), None, None)


def test_bad_masks():
    q, k, v = qkv(b=2)
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        run(q, k, v, key_padding_mask=torch.zeros(2, 31, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        run(q, k, v, key_padding_mask=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="packed sequences need batch 1"):
        run(q, k, v, cu_seqlens=[0, 10, 32])
    q1, k1, v1 = qkv()
    for cu, message in (([0, 10, 10, 32], "not greater"), ([0, 10, 31], "ends at 31"), ([1, 32], "starts at 1")):
        with pytest.raises(ValueError, match=message):
            run(q1, k1, v1, cu_seqlens=cu)
    with pytest.raises(ValueError, match="negative"):
        run(q1, k1, v1, cu_seqlens=[0, -1, 32])
    with pytest.raises(ValueError, match="packed sequences need self-attention"):
        run(q1, k1[:, :16], v1[:, :16], cu_seqlens=[0, 32])


def test_the_native_layer_refuses_outputs_sharing_memory_and_bad_descriptions():
    q, k, v = qkv()
    cfg = _kernels.make_config([8, 16], [1, 2])
    d = _kernels.describe
    lse = torch.empty(1, 32, 4)
    with pytest.raises(ValueError, match="out shares memory with q"):
        _native.forward(cfg, d(q), d(k), d(v), d(q), d(lse))
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="lse has shape"):
        _native.forward(cfg, d(q), d(k), d(v), d(out), d(torch.empty(1, 32, 3)))
    with pytest.raises(TypeError, match="lse: dtype float16"):
        _native.forward(cfg, d(q), d(k), d(v), d(out), d(lse.half()))
    bad = (q.data_ptr() + 1, (1, 32, 4, 8), (1024, 32, 8, 1), "float32")
    with pytest.raises(ValueError, match="not aligned"):
        _native.forward(cfg, bad, d(k), d(v), d(out), d(lse))
    with pytest.raises(ValueError, match="negative stride"):
        _native.forward(cfg, (q.data_ptr(), (1, 32, 4, 8), (1024, -32, 8, 1), "float32"), d(k), d(v), d(out), d(lse))
    with pytest.raises(ValueError, match="causality"):
        _native.Config([8], [1], None, "sometimes")


def test_a_bad_lse_gradient_raises():
    """A gradient into the LSE of the wrong size or dtype, or sharing memory with a
    gradient the backward writes, is a typed error naming grad_lse."""
    q, k, v = qkv()
    cfg = _kernels.make_config([8, 16], [1, 2])
    d = _kernels.describe
    out, lse = torch.empty_like(q), torch.empty(1, 32, 4)
    _native.forward(cfg, d(q), d(k), d(v), d(out), d(lse))
    g = torch.randn_like(q)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    args = (cfg, d(q), d(k), d(v), d(out), d(lse), d(g), d(dq), d(dk), d(dv))
    # Each described tensor is kept in a name while the call runs (the kernels read it).
    short, wide, zeros = torch.zeros(1, 32, 3), torch.zeros(1, 32, 4, dtype=torch.float64), torch.zeros(1, 32, 4)
    with pytest.raises(ValueError, match="grad_lse"):
        _native.backward(*args, grad_lse=d(short))
    with pytest.raises(TypeError, match="grad_lse: dtype float64"):
        _native.backward(*args, grad_lse=d(wide))
    with pytest.raises(ValueError, match="grad_lse.*shares memory|shares memory.*grad_lse"):
        _native.backward(*args, grad_lse=d(dq[..., 0]))
    _native.backward(*args, grad_lse=d(zeros))
    grads = torch.autograd.grad(ad.dilated_attention(*(x.requires_grad_() for x in (q, k, v)), [8, 16], [1, 2]), (q, k, v), g)
    assert torch.equal(dq, grads[0])


def test_layer_arguments():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ad.MultiheadDilatedAttention(30, 4, [1, 2], [8, 16])
    with pytest.raises(ValueError, match="num_kv_heads"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=3)
    with pytest.raises(ValueError, match="dropout"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], dropout=1.0)
    with pytest.raises(ValueError, match="gamma_init"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], gamma_init=0.0)
    with pytest.raises(ValueError, match="2 heads cannot be split into 3 head groups"):
        ad.MultiheadDilatedAttention(32, 2, [1, 2, 4], [8, 16, 32])
    layer = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16])
    x = torch.randn(1, 32, 32)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, attn_mask=torch.zeros(32, 32))
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, need_weights=True)
    with pytest.raises(ValueError, match=r"\[batch, seq, 32\]"):
        layer(torch.randn(1, 32, 16))


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"segs": (8.7, 16)}, TypeError, r"segment_lengths\[0\] must be an integer, got float 8.7"),
        ({"segs": ("8", 16)}, TypeError, r"segment_lengths\[0\] must be an integer, got str"),
        ({"segs": (True, 16)}, TypeError, r"segment_lengths\[0\] must be an integer, got bool"),
        ({"segs": (8, torch.tensor(True))}, TypeError, r"segment_lengths\[1\] must be an integer, got bool"),
        ({"rates": (1, 2.0)}, TypeError, r"dilation_rates\[1\] must be an integer, got float"),
        ({"segs": (2**70, 16)}, ValueError, r"segment_lengths\[0\] \(1180591620717411303424\) is out of range"),
        ({"rates": (1, 2**63)}, ValueError, r"dilation_rates\[1\] \(9223372036854775808\) is out of range"),
        ({"segs": (), "rates": (), "window": (4.5, 1)}, TypeError, r"window\[0\] must be an integer, got float"),
        ({"segs": (), "rates": (), "window": (2**64, 0)}, ValueError, r"window\[0\] \(18446744073709551616\) is out of range"),
        ({"segs": (), "rates": (), "window": (1, 2, 3)}, ValueError, r"window must be \(left, right\), got \(1, 2, 3\)"),
        ({"cu_seqlens": [0, 10.7, 32]}, TypeError, r"cu_seqlens\[1\] must be an integer, got float"),
        ({"cu_seqlens": [0, 2**64, 32]}, ValueError, r"cu_seqlens\[1\] \(18446744073709551616\) is out of range"),
        ({"cu_seqlens": torch.tensor([0.0, 32.0])}, TypeError, "cu_seqlens must be a 1-D integer tensor"),
        ({"is_causal": "False"}, TypeError, "is_causal must be a bool, got str"),
        ({"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
        ({"is_causal": torch.tensor(True)}, TypeError, "is_causal must be a bool, got Tensor"),
        ({"softmax_scale": "0.5"}, TypeError, "softmax_scale must be a real number, got str"),
        ({"mixing": 1}, TypeError, "mixing must be a str, got int"),
    ],
)
def test_arguments_are_not_coerced(kw, error, message):
    """Integer arguments must be integers (`operator.index`: no float truncated, no str
    parsed, no bool) within int64, `is_causal` a bool: a TypeError or ValueError naming
    the argument, not a silent conversion or torch's schema error."""
    kw = dict(kw)
    segs, rates = kw.pop("segs", (8, 16)), kw.pop("rates", (1, 2))
    with pytest.raises(error, match=message):
        run(*qkv(), segs, rates, **kw)


def test_integer_like_and_numpy_values_are_accepted():
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    want = run(q, k, v, (8, 16), (1, 2), is_causal=True)
    got = ad.dilated_attention(
        q, k, v, [np.int64(8), torch.tensor(16)], np.array([1, 2]), np.bool_(True), cu_seqlens=np.array([0, 32])
    )
    assert torch.equal(got, want)
    assert torch.equal(run(q, k, v, (8, 16), (1, 2), is_causal=np.bool_(False)), run(q, k, v))


def test_module_and_config_arguments_are_not_coerced():
    with pytest.raises(TypeError, match=r"segment_lengths\[0\] must be an integer"):
        ad.DilatedAttention([8.5, 16], [1, 2])
    with pytest.raises(TypeError, match=r"dilation_rates\[1\] must be an integer"):
        ad.make_config([8, 16], [1, 2.5])
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        ad.make_config([8, 16], [1, 2], "yes")
    with pytest.raises(TypeError, match="embed_dim must be an integer, got float"):
        ad.MultiheadDilatedAttention(32.0, 4, [1, 2], [8, 16])
    with pytest.raises(TypeError, match="num_heads must be an integer, got str"):
        ad.MultiheadDilatedAttention(32, "4", [1, 2], [8, 16])
    with pytest.raises(TypeError, match="num_kv_heads must be an integer, got float"):
        ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=2.0)
    layer = ad.MultiheadDilatedAttention(32, 4, [1, 2], [8, 16])
    with pytest.raises(TypeError, match="is_causal must be a bool, got str"):
        layer(torch.randn(1, 32, 32), is_causal="False")


def test_double_backward_and_torch_func_raise():
    """What the README lists as unsupported raises RuntimeError, never a wrong result."""
    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    out = ad.dilated_attention(q, q, q, [8], [1])
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()
    with pytest.raises(RuntimeError):
        torch.func.grad(lambda x: ad.dilated_attention(x, x, x, [8], [1]).sum())(q.detach())
