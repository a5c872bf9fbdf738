"""Error measures and bounds shared by the tests: relative L2 error (docs/definition.md's
acceptance rule) and the per-dtype bounds of attn-testkit's `Tolerance::for_dtype`."""

from __future__ import annotations

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
