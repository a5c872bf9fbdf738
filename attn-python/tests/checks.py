"""Error measures and bounds shared by the tests: relative L2 error (docs/definition.md's
acceptance rule) and the per-dtype bounds of attn-testkit's `Tolerance::for_dtype`; and
the row-wise judge of attn-testkit's `judge` (every `[head_dim]` row of an output or
gradient, and every LSE, within a bound from its own magnitude)."""

from __future__ import annotations

import math

import torch

# Relative L2 bound of a result computed in each dtype against the float64 reference on
# the same (rounded) inputs.
BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
# The LSE is float32 in every dtype.
LSE_BOUND = 1e-5


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """`||got - want|| / ||want||` in float64 on the CPU (the absolute norm when `want`
    is zero); either tensor may be on any device."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if not torch.isfinite(got).all():
        return float("inf")
    den = want.norm().item()
    err = (got - want).norm().item()
    return err / den if den > 0 else err


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_l2(got, want)
    assert err <= bound, f"{name}: relative L2 error {err:.3e} > {bound:.0e}"


# Unit roundoff of float32.
U_F32 = 2.0**-24


def score_gradient_floor(scale: float, grad_out, a, b) -> float:
    """Where the exact dq (or dk) is identically zero (every query sees one key, so each
    softmax is constant), a computed one is the rounding of `P (dP - delta)`, terms of
    size `scale * |grad_out_p| * |v_t| * |k_t|` (`|q_p|` for dk): this is 64 f32 unit
    roundoffs of their L2 norm, with `a`, `b` the two inputs besides grad_out."""
    row_max = lambda x: x.double().norm(dim=-1).max().item()
    return 64 * U_F32 * scale * grad_out.double().norm().item() * row_max(a) * row_max(b)


def assert_lse(got: torch.Tensor, want: torch.Tensor, bound: float = LSE_BOUND) -> None:
    """Infinities must match exactly (a row that attends nothing is -inf on both sides);
    the finite values within `bound`."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, f"lse: shape {tuple(got.shape)} != {tuple(want.shape)}"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), "lse: finite positions differ"
    assert torch.equal(got[~fin].double(), want[~fin].double()), "lse: infinities differ"
    if fin.any():
        assert_close("lse", got[fin], want[fin], bound)


# ---- Row-wise judging (the model: attn-testkit's `judge`) ----------------------------------
# One wrong row in thousands moves a whole-tensor error by little; judged row by row it
# fails. A row is one `[head_dim]` vector of out, dq, dk or dv, or one LSE value.

# f32 computation noise in f32 unit roundoffs (attn-testkit's F32_NOISE_ULPS), and the LSE's
# accuracy in f32 unit roundoffs of (magnitude + 1) (its LSE_ULPS).
ROW_NOISE = 256 * U_F32
LSE_ROW = 64 * U_F32
# The unit roundoff of each result dtype and its smallest subnormal (results that underflow).
UNIT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SUBNORMAL = {torch.float32: 0.0, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def _host(name: str, got: torch.Tensor, want: torch.Tensor):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert want.numel() > 0, f"{name}: an empty tensor proves nothing"
    return got, want


def row_ratios(name: str, got, want, magnitude, dtype) -> torch.Tensor:
    """Each `[head_dim]` row's error over its bound, `rel * |want| + rel * |magnitude| +
    subnormal * sqrt(head_dim)` with `rel` the dtype's unit roundoff plus the f32 noise;
    `magnitude` is the row's size before cancellation (the reference's sums of absolute
    terms, or a bound on them) in `want`'s shape. A non-finite value is an infinite ratio."""
    got, want = _host(name, got, want)
    magnitude = magnitude.detach().cpu().double()
    assert magnitude.shape == want.shape, f"{name}: magnitude shape {tuple(magnitude.shape)} != {tuple(want.shape)}"
    rel = UNIT[dtype] + ROW_NOISE
    err = (got - want).norm(dim=-1)
    bound = rel * (want.norm(dim=-1) + magnitude.norm(dim=-1)) + SUBNORMAL[dtype] * want.shape[-1] ** 0.5
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    finite = torch.isfinite(got).all(dim=-1)
    return torch.where(finite & ~torch.isnan(ratio), ratio, torch.full_like(ratio, float("inf")))


def assert_rows(name: str, got, want, magnitude, dtype) -> None:
    """Every row of `got` within its bound ([`row_ratios`]); the message names the worst."""
    ratio = row_ratios(name, got, want, magnitude, dtype).flatten()
    worst = int(ratio.argmax())
    assert ratio[worst] <= 1, f"{name}: row {worst} at {ratio[worst]:.2f} of its bound ({dtype})"


def lse_ratios(got, want, magnitude) -> torch.Tensor:
    """Each LSE's error over `LSE_ROW * (magnitude + 1)`, `magnitude` bounding the row's
    largest |score| plus the log of its key count; equal infinities are agreement (ratio 0),
    any other non-finite value an infinite ratio."""
    got, want = _host("lse", got, want)
    magnitude = magnitude.detach().cpu().double()
    assert magnitude.shape == want.shape, f"lse: magnitude shape {tuple(magnitude.shape)} != {tuple(want.shape)}"
    same_inf = (got == want) & torch.isinf(want)
    ratio = (got - want).abs() / (LSE_ROW * (magnitude + 1))
    ratio = torch.where(torch.isfinite(got) & torch.isfinite(want), ratio, torch.full_like(ratio, float("inf")))
    return torch.where(same_inf, torch.zeros_like(ratio), ratio)


def assert_lse_rows(got, want, magnitude) -> None:
    ratio = lse_ratios(got, want, magnitude).flatten()
    worst = int(ratio.argmax())
    assert ratio[worst] <= 1, f"lse: row {worst} at {ratio[worst]:.2f} of its bound"


def row_max(x: torch.Tensor) -> float:
    return x.detach().cpu().double().norm(dim=-1).max().item()


def magnitudes(attend, q, k, v, grad_out, grad_lse, scale: float) -> dict:
    """Row magnitudes of the reference `attend(q, k, v) -> (out, lse)` (float64, `[b, s,
    h, d]` inputs): `out` and `dv` exactly (the sums `P |v|` and `P^T |grad_out|`, by the
    reference itself: the weights are non-negative); `dq`, `dk` and `lse` bounded from
    above by the inputs' largest rows (the score gradients `P (dP - delta + grad_lse)`
    are at most `2 |grad_out_p| max|v| + |grad_lse_p|` in size)."""
    q, k, v = (x.detach().cpu().double() for x in (q, k, v))
    go = grad_out.detach().cpu().double()
    gl = torch.zeros(go.shape[:-1], dtype=torch.float64) if grad_lse is None else grad_lse.detach().cpu().double()
    gl = torch.nan_to_num(gl, nan=0.0)
    out_mag = attend(q, k, v.abs())[0]
    vr = v.clone().requires_grad_()
    dv_mag = torch.autograd.grad(attend(q, k, vr)[0], vr, go.abs())[0]
    # Column sums of the weights: each key row's total weight (the gradient of v under ones).
    vr = v.clone().requires_grad_()
    col = torch.autograd.grad(attend(q, k, vr)[0], vr, torch.ones_like(go))[0][..., :1]
    ds = 2 * go.norm(dim=-1, keepdim=True) * row_max(v) + gl.abs()[..., None]  # [b, n, h, 1]
    dq_mag = (scale * ds * row_max(k)).expand_as(q)
    dk_mag = (scale * col * ds.max().item() * row_max(q)).expand_as(k)
    lse_mag = scale * q.norm(dim=-1) * row_max(k) + math.log(max(k.shape[1], 1))
    return {"out": out_mag, "dq": dq_mag, "dk": dk_mag, "dv": dv_mag, "lse": lse_mag}
