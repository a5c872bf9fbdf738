"""The row-wise judge bites (`checks.assert_rows`, `checks.assert_lse_rows`): on a bf16
result of thousands of rows that it passes, one row scaled by 1.05 fails it while the
whole-tensor bound still passes, and so does one LSE off by 0.01; a shape mismatch or an
empty tensor is refused."""

from __future__ import annotations

import pytest
import torch

import attn_dilated as ad
import composition
from checks import BOUND, assert_lse_rows, assert_rows, lse_ratios, magnitudes, rel_l2, row_ratios

SEGS, RATES = [256, 512], [1, 2]


@pytest.fixture(scope="module")
def bf16_result():
    """A bf16 forward of 4096 rows (batch 1, 1024 positions, 4 heads, head_dim 32), its
    float64 reference on the same rounded inputs and the rows' magnitudes. Heads 0-1 see
    every position (segment 256, rate 1), heads 2-3 the odd ones (512, rate 2)."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 1024, 4, 32, generator=gen) for _ in range(3))
    # Values off zero, so an output row does not cancel to far below its terms (where
    # rounding alone may change it by several percent, as its bound allows).
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v + 2))
    out, lse = ad.dilated_attention_with_lse(q, k, v, SEGS, RATES)
    attend = lambda q, k, v: composition.dilated(q, k, v, SEGS, RATES)
    want, want_lse = attend(*(x.double() for x in (q, k, v)))
    mag = magnitudes(attend, q, k, v, torch.zeros(1, 1024, 4, 32), None, 32**-0.5)
    return out, lse, want.detach(), want_lse.detach(), mag


def test_one_scaled_row_in_thousands_fails_the_rows_not_the_whole_tensor(bf16_result):
    out, _, want, _, mag = bf16_result
    assert_rows("out", out, want, mag["out"], torch.bfloat16)
    wrong = out.clone()
    wrong[0, 700, 1] *= 1.05
    assert rel_l2(wrong, want) <= BOUND[torch.bfloat16], "the whole-tensor bound rejects it too: no proof"
    ratio = row_ratios("out", wrong, want, mag["out"], torch.bfloat16)
    assert ratio[0, 700, 1] > 1 and (ratio > 1).sum() == 1, f"planted row at {ratio[0, 700, 1]:.2f} of its bound"
    print(f"planted out row at {ratio[0, 700, 1]:.2f} of its bound; whole tensor {rel_l2(wrong, want):.2e}")
    with pytest.raises(AssertionError, match="row 2801 "):
        assert_rows("out", wrong, want, mag["out"], torch.bfloat16)


def test_one_lse_off_by_a_hundredth_fails(bf16_result):
    _, lse, _, want_lse, mag = bf16_result
    assert_lse_rows(lse, want_lse, mag["lse"])
    wrong = lse.clone()
    wrong[0, 300, 1] += 0.01
    ratio = lse_ratios(wrong, want_lse, mag["lse"])
    assert ratio[0, 300, 1] > 1 and (ratio > 1).sum() == 1, f"planted LSE at {ratio[0, 300, 1]:.2f} of its bound"
    print(f"planted LSE at {ratio[0, 300, 1]:.2f} of its bound")
    with pytest.raises(AssertionError, match="lse: row 1201 "):
        assert_lse_rows(wrong, want_lse, mag["lse"])


def test_lse_infinities_must_match_exactly():
    want = torch.tensor([[float("-inf"), 1.5]])
    mag = torch.tensor([[0.0, 2.0]])
    assert_lse_rows(want.clone(), want, mag)
    for got in ([[0.0, 1.5]], [[float("-inf"), float("nan")]], [[float("-inf"), float("-inf")]]):
        with pytest.raises(AssertionError, match="lse: row"):
            assert_lse_rows(torch.tensor(got), want, mag)


def test_a_shape_mismatch_or_an_empty_tensor_is_refused():
    x = torch.ones(2, 3, 4)
    with pytest.raises(AssertionError, match=r"out: shape \(2, 3, 3\) != \(2, 3, 4\)"):
        assert_rows("out", x[..., :3], x, x, torch.float32)
    with pytest.raises(AssertionError, match="dq: an empty tensor"):
        assert_rows("dq", x[:0], x[:0], x[:0], torch.float32)
    with pytest.raises(AssertionError, match="magnitude shape"):
        assert_rows("dk", x, x, x[:1], torch.float32)
    with pytest.raises(AssertionError, match="lse: an empty tensor"):
        assert_lse_rows(x[:0, :, 0], x[:0, :, 0], x[:0, :, 0])
    with pytest.raises(AssertionError, match="dv: row 0 at inf"):
        assert_rows("dv", torch.full_like(x, float("nan")), x, x, torch.float32)
