"""docs/definition.md written as plain PyTorch, the tests' reference: per pattern and
segment, gather the selected rows, attend with an explicit masked softmax (keeping the
LSE), scatter back; then mix the patterns by head groups or LongNet. Differentiable,
so its autograd gradients are the reference gradients."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


def attend(q, k, v, allowed, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q `[b, n, h, d]` over k, v `[b, m, h, d]` where
    `allowed` `[b, n, m]` (or `[b, h or 1, n, m]`) says which keys a query sees. Returns
    `(o, lse)`; a query seeing no key gets `o = 0`, `lse = -inf` (with finite gradients
    everywhere)."""
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    mask = allowed[:, None, :, :] if allowed.dim() == 3 else allowed
    any_key = mask.any(dim=-1, keepdim=True)
    # Rows without keys get finite dummy scores, masked out below, so that no NaN
    # reaches the gradient.
    scores = torch.where(mask, scores, torch.where(any_key, float("-inf"), 0.0))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    p = torch.exp(scores - lse)
    o = torch.einsum("bhnm,bmhd->bnhd", p, v)
    row = any_key[..., 0].permute(0, 2, 1)  # [b, n, h]
    o = torch.where(row[..., None], o, 0.0)
    lse = torch.where(row, lse[..., 0].permute(0, 2, 1), float("-inf"))
    return o, lse


def pattern(q, k, v, w, r, off, causal, scale, pad, keep=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One dilated pattern `(w, r, off)` over every segment: `(o, lse)` of q's rows,
    zero / -inf where the pattern selects nothing; `keep` `[b or 1, h or 1, n, m]` the
    block mask expanded to positions, or None."""
    b, n, h, _ = q.shape
    m = k.shape[1]
    outs, lses = torch.zeros_like(q), torch.full((b, n, h), float("-inf"), dtype=q.dtype)
    for s in range(math.ceil(n / w)):
        start = s * w + off
        qi = torch.arange(start, max(start, min((s + 1) * w, n)), r)
        ki = torch.arange(start, max(start, min((s + 1) * w, m)), r)
        if len(qi) == 0:
            continue
        allowed = torch.ones(b, len(qi), len(ki), dtype=torch.bool)
        if causal:
            allowed &= ki[None, None, :] <= qi[None, :, None]
        if pad is not None:
            allowed &= ~pad[:, ki][:, None, :]
        if keep is not None:
            allowed = allowed[:, None] & keep[:, :, qi][:, :, :, ki]
        o, lse = attend(q[:, qi], k[:, ki], v[:, ki], allowed, scale)
        outs = outs.index_copy(1, qi, o)
        lses = lses.index_copy(1, qi, lse)
    return outs, lses


def window(q, k, v, left, right, causal, scale, pad, keep=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sliding window: query p sees keys p - left ..= p + right (and <= p if causal)."""
    n, m = q.shape[1], k.shape[1]
    p, t = torch.arange(n)[:, None], torch.arange(m)[None, :]
    allowed = (t >= p - left) & (t <= p + (0 if causal else right))
    allowed = allowed[None].expand(q.shape[0], n, m)
    if pad is not None:
        allowed = allowed & ~pad[:, None, :]
    if keep is not None:
        allowed = allowed[:, None] & keep
    return attend(q, k, v, allowed, scale)


def merge(parts: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """LongNet mixing: `lse = log sum exp(lse_i)`, `out = sum exp(lse_i - lse) o_i`."""
    lses = torch.stack([l for _, l in parts])
    any_finite = torch.isfinite(lses).any(dim=0)
    safe = torch.where(any_finite, lses, 0.0)
    lse = torch.logsumexp(safe, dim=0)
    weights = torch.exp(safe - lse)
    out = sum(wt[..., None] * o for wt, (o, _) in zip(weights, parts))
    return out, torch.where(any_finite, lse, float("-inf"))


def group_bounds(heads: int, groups: int) -> List[Tuple[int, int]]:
    """Head groups: the first `heads % groups` groups get one head more."""
    base, extra = divmod(heads, groups)
    bounds, start = [], 0
    for i in range(groups):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def one_sequence(q, k, v, segs, rates, mixing, causal, scale, pad, win, keep=None):
    h = q.shape[2]
    # The block mask of the heads `sl` (a mask of one head serves them all).
    heads = lambda sl: None if keep is None else keep if keep.shape[1] == 1 else keep[:, sl]
    if mixing == "window":
        return window(q, k, v, win[0], win[1], causal, scale, pad, keep)
    if mixing == "head_groups":
        outs, lses = [], []
        g = len(segs)
        for i, (lo, hi) in enumerate(group_bounds(h, g)):
            sl = slice(lo, hi)
            o, lse = pattern(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], segs[i], rates[i], i % rates[i], causal, scale, pad, heads(sl)
            )
            outs.append(o / g)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    per_head = []
    for j in range(h):
        sl = slice(j, j + 1)
        parts = [
            pattern(q[:, :, sl], k[:, :, sl], v[:, :, sl], w, r, j % r, causal, scale, pad, heads(sl))
            for w, r in zip(segs, rates)
        ]
        per_head.append(merge(parts))
    return torch.cat([o for o, _ in per_head], dim=2), torch.cat([l for _, l in per_head], dim=2)


def dilated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segs: Sequence[int] = (),
    rates: Sequence[int] = (),
    mixing: str = "head_groups",
    causal: bool = False,
    scale: Optional[float] = None,
    pad: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[Sequence[int]] = None,
    win: Optional[Tuple[int, int]] = None,
    blocks: Optional[Tuple[torch.Tensor, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The definition's `(out, lse)` for `[batch, seq, heads, head_dim]` inputs; k and v
    may have fewer heads (grouped: repeated in PyTorch's repeat_interleave order) and,
    without packing, their own length. Packed sequences run one at a time. `blocks` is
    `(block_mask, block_size)`: the mask `[b or 1, h or 1, nb_q, nb_k]` (1 = kept) of
    blocks of positions counted from each sequence's start."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def keep(n: int, m: int) -> Optional[torch.Tensor]:
        if blocks is None:
            return None
        mask, size = blocks
        return mask.bool().repeat_interleave(size, dim=2)[:, :, :n].repeat_interleave(size, dim=3)[..., :m]

    if cu_seqlens is None:
        return one_sequence(q, k, v, segs, rates, mixing, causal, scale, pad, win, keep(q.shape[1], k.shape[1]))
    outs, lses = [], []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        sp = None if pad is None else pad[:, a:b]
        args = (segs, rates, mixing, causal, scale, sp, win, keep(b - a, b - a))
        o, lse = one_sequence(q[:, a:b], k[:, a:b], v[:, a:b], *args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)
