"""`torch.nn.Module`s with the constructor arguments and parameter names of
dilated-attention-pytorch: `DilatedAttention` (the op as a module) and
`MultiheadDilatedAttention` (projections, attention, sub-LayerNorm, output projection,
as docs/definition.md's multihead layer defines them)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._kernels import as_int, as_window, int_list
from ._op import CuSeqlens, Window, attention, make_config


# Where the layer's LayerNorms sit: `sub_ln`, one `norm` over the merged heads (the
# published dilated-attention-pytorch, MAGNETO's sub-LN); `qk_ln`, that library's
# development line: `q_ln` over q and over the merged heads, `k_ln` over k.
_NORM_LAYOUTS = ("sub_ln", "qk_ln")
# How `MultiheadDilatedAttention.forward` is called: `published`, dilated-attention-pytorch's
# release, `(query, key, value, is_causal)` positionally and `(output, None)` returned;
# `development`, its development line, `(query, key, value, key_padding_mask,
# need_weights, attn_mask, is_causal, average_attn_weights)` positionally and the output
# tensor returned.
_FORWARD_CONVENTIONS = ("published", "development")
_DEVELOPMENT_POSITIONAL = ("key_padding_mask", "need_weights", "attn_mask", "is_causal", "average_attn_weights")


class DilatedAttention(nn.Module):
    """Dilated attention of `[batch, seq, heads, head_dim]` tensors.

    `attention_dropout` is accepted for compatibility and, as in dilated-attention-pytorch
    (which stores it without applying it), not applied: the attention is exact.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        softmax_scale: Optional[float] = None,
        attention_dropout: float = 0.0,
        *,
        mixing: str = "head_groups",
        window: Optional[Window] = None,
    ):
        super().__init__()
        if not 0.0 <= float(attention_dropout) < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.segment_lengths = int_list("segment_lengths", segment_lengths)
        self.dilation_rates = int_list("dilation_rates", dilation_rates)
        self.softmax_scale = softmax_scale
        self.dropout_p = float(attention_dropout)
        self.mixing = mixing
        win = as_window(window)
        self.window = None if win is None else tuple(win)
        # Validated now so that a bad config raises here, not at the first forward. The
        # module keeps plain Python values only (the op builds and caches the native
        # config per call), so it deep-copies and pickles like any torch module.
        self._validate()

    def _validate(self, heads: Optional[int] = None) -> None:
        """ValueError unless the config is valid (and, given `heads`, splits into its
        head groups)."""
        cfg = make_config(self.segment_lengths, self.dilation_rates, False, self.softmax_scale, self.mixing, self.window)
        if heads is not None:
            cfg.validate_heads(heads)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        is_causal: bool = False,
        *,
        key_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[CuSeqlens] = None,
    ) -> Tensor:
        out, _ = attention(
            query, key, value, self.segment_lengths, self.dilation_rates, is_causal, self.softmax_scale,
            self.mixing, self.window, key_padding_mask, cu_seqlens,
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
            f"mixing={self.mixing!r}, window={self.window}, softmax_scale={self.softmax_scale}"
        )


def _positive(name: str, x: float) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and positive, got {x}")
    return x


class MultiheadDilatedAttention(nn.Module):
    """The MAGNETO/LongNet multihead layer: `q_proj`, `k_proj`, `v_proj` (nn.Linear),
    dilated attention, dropout (training only), `norm` (LayerNorm, with `layer_norm`),
    `out_proj`. A state_dict of dilated-attention-pytorch's module loads unchanged.

    `norm_layout="qk_ln"` builds that library's development line instead: with
    `layer_norm`, `q_ln` over q (and again, the same weights, over the merged heads) and
    `k_ln` over k in place of `norm`, so its state_dicts load with `strict=True`; and
    `forward_convention="development"` takes that line's call convention (see `forward`).

    Keyword-only extras: `mixing` (`head_groups` or `longnet`), `num_kv_heads` (grouped
    K/V: `k_proj` and `v_proj` then have `num_kv_heads * head_dim` outputs), `window`
    (`(left, right)`; segment_lengths and dilation_rates empty) and `softmax_scale`.
    """

    # Inputs are `[batch, seq, embed_dim]` (read by `nn.TransformerEncoder` of a layer
    # whose `self_attn` this is).
    batch_first = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dilation_rates: Sequence[int],
        segment_lengths: Sequence[int],
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        mixing: str = "head_groups",
        num_kv_heads: Optional[int] = None,
        window: Optional[Window] = None,
        softmax_scale: Optional[float] = None,
        norm_layout: str = "sub_ln",
        forward_convention: str = "published",
    ):
        super().__init__()
        if norm_layout not in _NORM_LAYOUTS:
            raise ValueError(f"norm_layout must be one of {_NORM_LAYOUTS}, got {norm_layout!r}")
        if forward_convention not in _FORWARD_CONVENTIONS:
            raise ValueError(f"forward_convention must be one of {_FORWARD_CONVENTIONS}, got {forward_convention!r}")
        self.norm_layout = norm_layout
        self.forward_convention = forward_convention
        embed_dim, num_heads = as_int("embed_dim", embed_dim), as_int("num_heads", num_heads)
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        kv_heads = num_heads if num_kv_heads is None else as_int("num_kv_heads", num_kv_heads)
        if kv_heads <= 0 or num_heads % kv_heads != 0:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({num_heads})")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.layer_norm = bool(layer_norm)
        self.gamma_init = _positive("gamma_init", gamma_init)
        _positive("layer_norm_eps", layer_norm_eps)
        self.attention = DilatedAttention(segment_lengths, dilation_rates, softmax_scale, mixing=mixing, window=window)
        self.attention._validate(num_heads)
        kv_dim = kv_heads * self.head_dim
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **kw)
        self.norm: Optional[nn.LayerNorm] = None
        self.q_ln: Optional[nn.LayerNorm] = None
        self.k_ln: Optional[nn.LayerNorm] = None
        if self.layer_norm and norm_layout == "sub_ln":
            self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **kw)
        elif self.layer_norm:
            self.q_ln = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **kw)
            self.k_ln = nn.LayerNorm(kv_dim, eps=layer_norm_eps, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """MAGNETO initialisation: xavier-normal weights (gain 1 for q/k, `gamma_init` for
        v and out), zero biases, LayerNorm weight 1 and bias 0."""
        for proj, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, self.gamma_init), (self.out_proj, self.gamma_init)):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        for norm in (self.norm, self.q_ln, self.k_ln):
            if norm is not None:
                norm.reset_parameters()

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None, *args, **kwargs):
        """`query` (and `key`, `value` for cross-attention; `key` defaults to `query`,
        `value` to `key`) are `[batch, seq, embed_dim]`.

        `forward_convention="published"` (the default): dilated-attention-pytorch's
        release, `forward(query, key=None, value=None, is_causal=False, *,
        key_padding_mask=None, need_weights=False, attn_mask=None, cu_seqlens=None)`,
        returns `(output, None)`. `"development"`: its development line,
        `forward(query, key=None, value=None, key_padding_mask=None, need_weights=False,
        attn_mask=None, is_causal=False, average_attn_weights=True, *, cu_seqlens=None)`,
        returns the output tensor. Either way `need_weights=True` and `attn_mask` are
        refused (the weights are never formed) and every argument may be a keyword."""
        if self.forward_convention == "published":
            if len(args) > 1:
                raise TypeError(f"forward takes at most 4 positional arguments (query, key, value, is_causal), got {3 + len(args)}")
            if args:
                if "is_causal" in kwargs:
                    raise TypeError("forward got is_causal both by position and by keyword")
                kwargs["is_causal"] = args[0]
            average = kwargs.pop("average_attn_weights", None)
            if average is not None:
                raise TypeError("average_attn_weights is the development convention's (forward_convention='development')")
            return self._attend(query, key, value, **kwargs), None
        if len(args) > len(_DEVELOPMENT_POSITIONAL):
            raise TypeError(
                f"forward takes at most {3 + len(_DEVELOPMENT_POSITIONAL)} positional arguments "
                f"(query, key, value, {', '.join(_DEVELOPMENT_POSITIONAL)}), got {3 + len(args)}"
            )
        for name, x in zip(_DEVELOPMENT_POSITIONAL, args):
            if name in kwargs:
                raise TypeError(f"forward got {name} both by position and by keyword")
            kwargs[name] = x
        kwargs.pop("average_attn_weights", None)  # only shapes the weights, which are never formed
        return self._attend(query, key, value, **kwargs)

    def _attend(
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        is_causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[CuSeqlens] = None,
    ) -> Tensor:
        """The layer's output (either convention's arguments, by name)."""
        if need_weights:
            raise ValueError("need_weights=True is not supported: dilated attention never forms the weight matrix")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported: use is_causal, key_padding_mask, cu_seqlens or window")
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} must be [batch, seq, {self.embed_dim}], got shape {tuple(x.shape)}")
        b, n, _ = query.shape
        m = key.shape[1]
        q, k = self.q_proj(query), self.k_proj(key)
        if self.q_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, m, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(b, value.shape[1], self.num_kv_heads, self.head_dim)
        x = self.attention(q, k, v, is_causal, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        x = x.reshape(b, n, self.embed_dim)
        if self.training and self.dropout > 0:
            x = F.dropout(x, self.dropout, training=True)
        if self.norm is not None:
            x = self.norm(x)
        if self.q_ln is not None:
            x = self.q_ln(x)
        return self.out_proj(x)
