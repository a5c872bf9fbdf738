"""The op, its gradients and the layer on CUDA tensors: every conformance file (the
block-mask files too, and a removed block failing the judge), random
configurations against the float64 composition in float32, bfloat16 and float16 (grouped
K/V, key padding, packed sequences, windows, cross-attention, strided layouts; each
result judged whole and row by row, LSEs included: `checks`), the layer against the
float64 definition of the layer, the kernels queued on the caller's current stream, the
registered op (`opcheck`, `torch.compile` without a graph break), and mixed devices
refused.

Where the CUDA kernels cannot run (no GPU, no driver or NVRTC, a wheel built without
CUDA) these tests skip with the reason; `ATTN_REQUIRE_GPU=1` (the device check) makes
that a failure (`gpu_policy`; a test of two GPUs fails where it is 2 or more). Without
a GPU, `cuda_unavailable_reason` must name what is missing."""

from __future__ import annotations

import random

import pytest
import torch

import attn_dilated as ad
from gpu_policy import required_gpus, skip_gpu_test
from checks import assert_close, assert_lse
from conftest import CONFORMANCE
from test_compile import BACKWARD, OP, layer_run, problem, run
from test_golden import assert_lse_vector, block_args, config_args, files, masks, read
from test_modules import judge_layer, reference_layer
from test_op import make_case, run_case

REQUIRED = required_gpus() >= 1


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ad.cuda_unavailable_reason(0)


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    reason = unavailable()
    if reason is not None:
        skip_gpu_test("the CUDA tests", reason)
    return torch.device("cuda", 0)


# Words one of which every reason names: the library not found, no device, a GPU older
# than sm_80, the feature.
REASON_WORDS = ("libcuda", "libnvrtc", "device 0 requested", "sm_80 or newer", "`cuda` feature", "CUDA_ERROR", "cuInit")


def test_the_reason_names_what_is_missing():
    reason = ad.cuda_unavailable_reason(0)
    if torch.cuda.is_available() and REQUIRED:
        assert reason is None, f"a GPU is present but the kernels cannot run: {reason}"
    elif torch.cuda.is_available():
        assert reason is None or any(w in reason for w in REASON_WORDS), reason
    else:
        assert isinstance(reason, str) and reason, "no GPU, yet no reason was given"
        assert any(w in reason for w in REASON_WORDS), reason


def test_host_memory_in_a_cuda_call_is_a_typed_error():
    """The native CUDA entry given CPU tensors raises, never faults or panics: where the
    kernels can run, a ValueError saying the memory is not the device's; elsewhere the
    reason they cannot (RuntimeError, or NotImplementedError for a wheel built without
    CUDA)."""
    reason = ad.cuda_unavailable_reason(0)
    q, k, v = (torch.randn(1, 32, 2, 8) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 32, 2)
    d = lambda t: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), "float32")
    cfg = ad.make_config([16], [1])
    stream = torch.cuda.current_stream().cuda_stream if reason is None else 0
    expected = ValueError if reason is None else (RuntimeError, NotImplementedError)
    with pytest.raises(expected) as e:
        ad._native.forward(cfg, d(q), d(k), d(v), d(out), d(lse), None, None, 1, (0, stream))
    if reason is None:
        assert "are not memory of CUDA device 0" in str(e.value), str(e.value)
    else:
        assert str(e.value) == reason


def test_the_cuda_entry_checks_before_touching_the_device():
    """The native CUDA entry checks shapes, masks and output layouts against each other
    before it opens a device, so these errors are the same with or without a GPU."""
    q, k, v = (torch.randn(1, 32, 4, 8) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 32, 4)
    d = lambda t: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype)[6:])
    cfg = ad.make_config([16], [1])

    def call(q=q, k=k, v=v, out=out, mask=None, cu=None, blocks=None, block_size=None):
        m, b = (None if x is None else d(x) for x in (mask, blocks))
        ad._native.forward(cfg, d(q), d(k), d(v), d(out), d(lse), m, cu, 1, (0, 0), b, block_size)

    with pytest.raises(ValueError, match=r"key_padding_mask has shape \[1, 31\] but \[1, 32\]"):
        call(mask=torch.zeros(1, 31, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens is invalid: ends at 30 but the packed batch has 32 tokens"):
        call(cu=[0, 10, 30])
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        call(k=k[:, :, :3].contiguous(), v=v[:, :, :3].contiguous())
    with pytest.raises(ValueError, match="not the contiguous"):
        call(out=torch.empty(1, 4, 32, 8).transpose(1, 2))
    # The block mask (a host tensor: the wrapper's copy) is read and checked here too.
    ones = lambda *shape: torch.ones(*shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block mask is invalid: 3 x 4 blocks where the call at block_size 8 needs 4 x 4"):
        call(blocks=ones(1, 1, 3, 4), block_size=8)
    with pytest.raises(ValueError, match="block mask is invalid: heads 2 where 1 or the 4 query heads"):
        call(blocks=ones(1, 2, 4, 4), block_size=8)
    with pytest.raises(ValueError, match="block mask is invalid: entry 5 is 2"):
        bad = ones(1, 1, 4, 4)
        bad.view(-1)[5] = 2
        call(blocks=bad, block_size=8)
    with pytest.raises(ValueError, match="block_mask needs block_size"):
        call(blocks=ones(1, 1, 4, 4))


def run_block_file_on(device, path, plant=None):
    """A block-mask file through the op on `device`, judged against the file (forward,
    LSE, gradients); `plant(mask)` may alter the block mask first."""
    meta, t, rel_tol = read(path)
    blocks = block_args(meta, t)
    if plant is not None:
        blocks["block_mask"] = plant(blocks["block_mask"].clone())
    blocks["block_mask"] = blocks["block_mask"].to(device)
    q, k, v = (t[x].to(device).requires_grad_() for x in ("q", "k", "v"))
    m = masks(t)
    if m["key_padding_mask"] is not None:
        m["key_padding_mask"] = m["key_padding_mask"].to(device)
    out, lse = ad.dilated_attention_with_lse(q, k, v, **config_args(meta), **m, **blocks)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["grad_out"].to(device))
    assert out.device == lse.device == dq.device == dk.device == dv.device == device
    assert_close("out", out, t["out"], rel_tol)
    if "lse" in t:
        assert_lse(lse, t["lse"], rel_tol)
        assert_lse_vector(lse, t, meta)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(name, got, t[name], rel_tol)


def test_block_file_count_on_cuda():
    assert len(files("blocks")) == 8


@pytest.mark.parametrize("path", files("blocks"), ids=lambda p: f"blocks/{p.stem}")
def test_block_mask_vectors_on_cuda(path, cuda):
    run_block_file_on(cuda, path)


def test_a_removed_block_fails_on_cuda(cuda):
    """The local-window file with one kept block removed fails its judge on the GPU:
    the kernels read the mask."""

    def plant(mask):
        assert mask[0, 0, 2, 3] == 1
        mask[0, 0, 2, 3] = 0
        return mask

    path = CONFORMANCE / "blocks" / "bs_local_window.safetensors"
    with pytest.raises(AssertionError, match="relative L2 error"):
        run_block_file_on(cuda, path, plant)


@pytest.mark.parametrize("path", files("dilated", "features"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_attention_vectors_on_cuda(path, cuda):
    meta, t, rel_tol = read(path)
    q, k, v = (t[x].to(cuda).requires_grad_() for x in ("q", "k", "v"))
    m = masks(t)
    if m["key_padding_mask"] is not None:
        m["key_padding_mask"] = m["key_padding_mask"].to(cuda)
    out, lse = ad.dilated_attention_with_lse(q, k, v, **config_args(meta), **m)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["grad_out"].to(cuda))
    assert out.device == lse.device == dq.device == dk.device == dv.device == cuda
    assert_close("out", out, t["out"], rel_tol)
    if "lse" in t:
        assert_lse(lse, t["lse"], rel_tol)
        assert_lse_vector(lse, t, meta)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(name, got, t[name], rel_tol)


@pytest.mark.parametrize("seed", range(200, 216))
def test_random_configs_on_cuda_in_f32(seed, cuda):
    run_case(make_case(random.Random(seed)), seed, torch.float32, cuda)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(300, 308))
def test_random_configs_on_cuda_in_low_precision(seed, dtype, cuda):
    run_case(make_case(random.Random(seed)), seed, dtype, cuda)


def test_the_layer_runs_on_cuda(cuda):
    """`MultiheadDilatedAttention` moved to the GPU against the float64 definition of the
    layer on the same parameters and input (`test_modules.reference_layer`): the output
    and every parameter's gradient within the f32 bound (`test_modules.judge_layer`)."""
    torch.manual_seed(5)
    layer = ad.MultiheadDilatedAttention(64, 4, [1, 2], [16, 32], num_kv_heads=2)
    x = torch.randn(2, 64, 64)
    # The definition first: `.to(cuda)` below moves the layer's own parameters.
    want, params, k = reference_layer(layer, x, x, x, None, None, True)
    names = [n for n, _ in layer.named_parameters()]
    *want_grads, dk = torch.autograd.grad(want.square().sum(), [params[n] for n in names] + [k])
    out_gpu, grads_gpu = layer_run(layer.to(cuda), x.to(cuda))
    assert out_gpu.device == cuda and all(g.device == cuda for g in grads_gpu.values())
    judge_layer(out_gpu, grads_gpu, want, dict(zip(names, want_grads)), dk)


def test_the_kernels_run_on_the_current_stream(cuda):
    """On a side stream that is still busy (a sleep, then the inputs' copy), the op must
    wait for the copy: it gives the result computed after a full synchronisation. The
    same call queued on the legacy default stream instead reads the inputs before the
    copy and gives another result, so the check bites."""
    torch.manual_seed(9)
    src = [torch.randn(1, 2048, 4, 64, dtype=torch.bfloat16, device=cuda) for _ in range(3)]
    want = ad.dilated_attention(*src, [512, 1024], [1, 2])
    torch.cuda.synchronize()
    side = torch.cuda.Stream()

    def on_side(stream_of_call):
        with torch.cuda.stream(side):
            q, k, v = (torch.zeros_like(x) for x in src)
            torch.cuda._sleep(200_000_000)
            for dst, x in zip((q, k, v), src):
                dst.copy_(x)
            if stream_of_call is None:
                out = ad.dilated_attention(q, k, v, [512, 1024], [1, 2])
            else:
                cfg = ad.make_config([512, 1024], [1, 2])
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], dtype=torch.float32, device=cuda)
                d = lambda t: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype)[6:])
                ad._native.forward(cfg, d(q), d(k), d(v), d(out), d(lse), None, None, 1, (0, stream_of_call))
        torch.cuda.synchronize()
        return out

    assert torch.equal(on_side(None), want)
    assert not torch.equal(on_side(0), want), "the legacy default stream did not race the side stream's copy"


def test_the_registered_op_on_cuda(cuda):
    """`opcheck` of the op and its backward with CUDA tensors, and `torch.compile` with
    `fullgraph=True` matching eager mode (the backward's f32 atomics may add in another
    order, so gradients are compared within a bound)."""
    q, k, v, mask = (None if x is None else x.detach().to(cuda) for x in problem(3, b=2, pad=True))
    spec = ([16, 48], [1, 2], True, None, "head_groups", None)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(OP, (q, k, v, *spec, mask, None))
    out, lse = OP(q, k, v, *spec, mask, None)
    g = torch.randn_like(out)
    args = (g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *spec, mask, None)
    torch.library.opcheck(BACKWARD, args)
    torch.library.opcheck(BACKWARD, (*args, torch.randn_like(lse)))

    def f(q, k, v):
        return ad.dilated_attention(q, k, v, [16, 48], [1, 2], True, key_padding_mask=mask)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = run(compiled, q, k, v), run(f, q, k, v)
    assert torch.equal(got[0], want[0]), "the compiled forward differs from eager"
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert_close(name, a, b, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_views_off_a_16_byte_boundary(dtype, cuda):
    """Views that start anywhere in their buffer (head dims 64 cut from rows of 72 at
    offsets 4, 2 and 6: 8, 4 and 12 bytes off a 16-byte boundary in half precision) give
    the output bits of contiguous copies, and their gradients up to the order of the
    backward's f32 atomic adds (grad_out such a view too): the kernels' 16-byte loads are
    only for rows that start on that boundary."""
    torch.manual_seed(11)
    x = torch.randn(2, 96, 4, 3 * 72, dtype=dtype, device=cuda)
    q, k, v = x[..., 4:68], x[..., 72 + 2 : 72 + 66], x[..., 144 + 6 : 144 + 70]
    g = torch.randn(2, 96, 4, 72, dtype=dtype, device=cuda)[..., 4:68]
    if dtype != torch.float32:
        assert q.data_ptr() % 16 != 0 and k.data_ptr() % 16 != 0 and v.data_ptr() % 16 != 0 and g.data_ptr() % 16 != 0

    def call(q, k, v, g):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = ad.dilated_attention(q, k, v, [32, 96], [1, 2], is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    got, want = call(q, k, v, g), call(*(t.contiguous() for t in (q, k, v, g)))
    assert torch.equal(got[0], want[0]), "the output of views differs from that of contiguous copies"
    # Another order of f32 adds, then (in half precision) a rounding that may flip an ulp.
    bound = 1e-6 if dtype == torch.float32 else 1e-3
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert_close(name, a, b, bound)


def test_the_current_device_is_kept(cuda):
    """A call on another GPU than the current one leaves torch's current device as it
    was (the kernels' driver calls make the tensors' device current while they run)."""
    test = "test_the_current_device_is_kept"
    if torch.cuda.device_count() < 2:
        skip_gpu_test(test, "needs two CUDA devices: with one, the tensors' device is the current one", gpus=2)
    other = torch.device("cuda", 1)
    if ad.cuda_unavailable_reason(1) is not None:
        skip_gpu_test(test, f"the kernels cannot run on cuda:1: {ad.cuda_unavailable_reason(1)}", gpus=2)
    with torch.cuda.device(cuda):
        q = torch.randn(1, 32, 2, 8, device=other)
        ad.dilated_attention(q, q, q, [16], [1])
        ad.cuda_unavailable_reason(1)
        assert torch.cuda.current_device() == cuda.index


def test_mixed_devices_are_refused(cuda):
    q = torch.randn(1, 32, 2, 8, device=cuda)
    # The registered op itself (no wrapper's checks) raises too, never reads CUDA memory
    # on the host.
    spec = ([16], [1], False, None, "head_groups", None, None, None)
    with pytest.raises(ValueError, match="query is on cpu"):
        OP(q.cpu(), q, q.cpu(), *spec)
    with pytest.raises(ValueError, match="key is on cpu but query is on cuda:0"):
        OP(q, q.cpu(), q, *spec)
    with pytest.raises(ValueError, match="key is on cpu but query is on cuda:0"):
        ad.dilated_attention(q, q.cpu(), q, [16], [1])
    with pytest.raises(ValueError, match="key_padding_mask is on cpu but query is on cuda:0"):
        ad.dilated_attention(q, q, q, [16], [1], key_padding_mask=torch.zeros(1, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="head_dim|cuda"):
        wide = torch.randn(1, 32, 1, 512, device=cuda)
        ad.dilated_attention(wide, wide, wide, [16], [1])


def test_autocast_and_the_lse_on_cuda(cuda):
    """Under `torch.autocast("cuda")` (float16) mixed query, key and value dtypes are cast
    as for `scaled_dot_product_attention`; partial results merged by their LSEs get the
    whole attention's gradients on CUDA tensors as on CPU ones, and the LSE read for its
    value leaves the output's gradients alone."""
    from test_op import split_keys_merged

    torch.manual_seed(15)
    q, k, v = (torch.randn(2, 64, 4, 16, device=cuda, requires_grad=True) for _ in range(3))
    kh = k.detach().half().requires_grad_()
    with torch.autocast("cuda"):
        out = ad.dilated_attention(q, kh, v, [16, 32], [1, 2], is_causal=True)
    assert out.dtype == torch.float16
    assert torch.equal(out, ad.dilated_attention(q.half(), kh, v.half(), [16, 32], [1, 2], is_causal=True))
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and kh.grad.dtype == torch.float16
    g = torch.randn_like(q)
    merged = torch.autograd.grad(split_keys_merged(q, k, v), (q, k, v), g)
    whole = torch.autograd.grad(ad.dilated_attention(q, k, v, [64], [1]), (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), merged, whole):
        assert_close(name, a, b, 1e-5)
    want = torch.autograd.grad(ad.dilated_attention(q, k, v, [16, 32], [1, 2]), (q, k, v), g)
    out, lse = ad.dilated_attention_with_lse(q, k, v, [16, 32], [1, 2])
    assert lse.requires_grad and lse.device == cuda
    got = torch.autograd.grad(out, (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(name, a, b, 1e-6)
