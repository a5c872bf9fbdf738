"""Block masks through the Python API: every `conformance/blocks` file through the op
(forward, LSE and gradients within the file's bound, a fixed count; in bf16 and f16 row
by row against the float64 composition), a FlexAttention
`BlockMask` equal to its dense form, the pure block-sparse case against PyTorch's SDPA
with the expanded boolean mask, the Python library's `SparsePatternConfig` patterns and
`BlockSparseRingDilatedAttention` against the files that name them, and the argument
errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn_dilated as ad
from checks import BOUND, assert_close, assert_lse
from conftest import CONFORMANCE
from test_golden import assert_lse_vector, block_args, config_args, files, low_precision_judge, masks, read

BLOCK_FILES = 8


def run_file(path, plant=None):
    """The op on a blocks file against its expected values; `plant(mask)` may alter
    the block mask first."""
    meta, t, rel_tol = read(path)
    blocks = block_args(meta, t)
    if plant is not None:
        blocks["block_mask"] = plant(blocks["block_mask"].clone())
    q, k, v = (t[x].clone().requires_grad_() for x in ("q", "k", "v"))
    out, lse = ad.dilated_attention_with_lse(q, k, v, **config_args(meta), **masks(t), **blocks)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["grad_out"])
    assert_close("out", out, t["out"], rel_tol)
    if "lse" in t:
        assert_lse(lse, t["lse"], rel_tol)
        assert_lse_vector(lse, t, meta)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(name, got, t[name], rel_tol)


def test_block_file_count():
    assert len(files("blocks")) == BLOCK_FILES


@pytest.mark.parametrize("path", files("blocks"), ids=lambda p: p.stem)
def test_block_files(path):
    run_file(path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("path", files("blocks"), ids=lambda p: p.stem)
def test_block_files_in_low_precision(path, dtype):
    """Every row within its bound against the float64 composition (with the block mask)
    on the inputs rounded to `dtype`; the composition reproduces the file first."""
    low_precision_judge(path, dtype)


def test_a_removed_block_fails_the_file_judge():
    """The local-window file with one kept off-diagonal block removed (a block edge off
    by one) fails its judge."""

    def plant(mask):
        assert mask[0, 0, 2, 3] == 1
        mask[0, 0, 2, 3] = 0
        return mask

    with pytest.raises(AssertionError, match="relative L2 error"):
        run_file(CONFORMANCE / "blocks" / "bs_local_window.safetensors", plant)


def expanded(mask: torch.Tensor, size: int, n: int, m: int) -> torch.Tensor:
    """A `[b, h, nb_q, nb_k]` block mask as the boolean `[b, h, n, m]` mask it means."""
    return mask.bool().repeat_interleave(size, dim=2)[:, :, :n].repeat_interleave(size, dim=3)[..., :m]


def random_inputs(b=2, n=96, h=3, d=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g) for _ in range(3)]


def random_block_mask(b, h, nb, seed=9):
    """Random blocks, the diagonal kept (so every row sees a key)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, h, nb, nb, generator=g) < 0.4
    return mask | torch.eye(nb, dtype=torch.bool)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_pattern_over_the_sequence_equals_sdpa_with_the_expanded_mask(causal):
    q, k, v = random_inputs()
    size, n = 16, q.shape[1]
    mask = random_block_mask(2, 3, n // size)
    out = ad.dilated_attention(q, k, v, [n], [1], causal, block_mask=mask, block_size=size)
    allowed = expanded(mask, size, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(
        *(x.double().transpose(1, 2) for x in (q, k, v)), attn_mask=allowed
    ).transpose(1, 2)
    assert_close("out", out, want, BOUND[torch.float32])


def test_a_flex_attention_block_mask_is_its_dense_form():
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = random_inputs(b=1, n=128, h=2)
    size, n = 32, 128

    def mask_mod(b, h, qi, ki):  # constant on each 32 x 32 block, so no block is partial
        return ((qi // size) + (ki // size) + h) % 3 != 1

    flex = create_block_mask(mask_mod, 1, 2, n, n, device="cpu", BLOCK_SIZE=size)
    dense = flex.to_dense().bool()
    assert dense.shape == (1, 2, 4, 4) and not dense.all() and dense.any(dim=-1).all()
    a = ad.dilated_attention(q, k, v, [n], [1], block_mask=flex)
    b = ad.dilated_attention(q, k, v, [n], [1], block_mask=dense, block_size=size)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="disagrees"):
        ad.dilated_attention(q, k, v, [n], [1], block_mask=flex, block_size=16)


def formula(kind: str, i: int, j: int, nb: int, **p) -> bool:
    """The definition's named patterns over block indices."""
    if kind == "local_window":
        half = p["window_blocks"] // 2
        return max(0, i - half) <= j < min(nb, i + half + 1)
    if kind == "dilated_sparse":
        return j == i or any(j == i + r or j == i - r for r in p["rates"][:3])
    return j < min(p["global_blocks"], nb) or max(p["global_blocks"], i - p["radius"]) <= j < min(nb, i + p["radius"] + 1)


@pytest.mark.parametrize(
    "config, rates, want",
    [
        (ad.SparsePatternConfig("local_window", block_size=16, local_window_size=48), [1], dict(window_blocks=3)),
        (ad.SparsePatternConfig("local_window", block_size=8, local_window_size=32), [1], dict(window_blocks=4)),
        (ad.SparsePatternConfig("dilated_sparse", block_size=8), [1, 2, 4, 8], dict(rates=[1, 2, 4, 8])),
        (
            ad.SparsePatternConfig("global_local", block_size=16, local_window_size=64, global_tokens=16),
            [1],
            dict(global_blocks=1, radius=2),
        ),
    ],
    ids=["local3", "local4", "dilated", "global_local"],
)
def test_sparse_pattern_configs_build_the_definitions_patterns(config, rates, want):
    kind = config.pattern_type
    for n in (96, 100):
        mask = ad.sparse_pattern_mask(config, rates, n)
        nb = -(-n // config.block_size)
        expect = torch.tensor([[formula(kind, i, j, nb, **want) for j in range(nb)] for i in range(nb)])
        assert torch.equal(mask, expect), (kind, n)


@pytest.mark.parametrize(
    "name, config",
    [
        ("bs_local_window", ad.SparsePatternConfig("local_window", block_size=16, local_window_size=48)),
        (
            "bs_global_local_causal",
            ad.SparsePatternConfig("global_local", block_size=16, local_window_size=64, global_tokens=16),
        ),
    ],
)
def test_block_sparse_ring_dilated_attention_computes_the_files(name, config):
    """The Python library's module and config reproduce the files whose one pattern over
    the sequence is a named pattern."""
    meta, t, rel_tol = read(CONFORMANCE / "blocks" / f"{name}.safetensors")
    module = ad.BlockSparseRingDilatedAttention([int(meta["seq_len"])], [1], sparse_config=config)
    assert torch.equal(module.block_mask(int(meta["seq_len"])), t["block_mask"][0, 0].bool())
    causal = meta["causal"] == "true"
    q, k, v = (t[x].clone().requires_grad_() for x in ("q", "k", "v"))
    out = module(q, k, v, is_causal=causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["grad_out"])
    for name_, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(name_, got, t[name_], rel_tol)


def test_block_sparse_module_refuses_what_the_library_refuses_and_what_is_not_defined():
    q, k, v = random_inputs(b=1, n=100, h=2)
    module = ad.BlockSparseRingDilatedAttention([100], [1], sparse_config=ad.SparsePatternConfig(block_size=16))
    with pytest.raises(ValueError, match="divisible by block_size"):
        module(q, k, v)
    q, k, v = random_inputs(b=1, n=96, h=2)
    with pytest.raises(ValueError, match="return_attention_weights"):
        module(q, k, v, return_attention_weights=True)
    bad = [
        dict(sparse_config=ad.SparsePatternConfig(sparsity_ratio=1.0)),
        dict(sparse_config=ad.SparsePatternConfig(block_size=0)),
        dict(sparse_config=ad.SparsePatternConfig(local_window_size=0)),
        dict(sparse_config=ad.SparsePatternConfig(pattern_type="adaptive")),
        dict(use_adaptive_sparsity=True),
        dict(quality_threshold=1.5),
        dict(dropout=0.1),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            ad.BlockSparseRingDilatedAttention([96], [1], **kwargs)


def test_bad_block_masks_raise_errors_naming_them():
    q, k, v = random_inputs(b=1, n=64, h=2)
    call = lambda **kw: ad.dilated_attention(q, k, v, [64], [1], **kw)
    good = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs block_size"):
        call(block_mask=good)
    with pytest.raises(ValueError, match="without a block_mask"):
        call(block_size=16)
    with pytest.raises(TypeError, match="bool or uint8"):
        call(block_mask=good.float(), block_size=16)
    with pytest.raises(ValueError, match="block"):
        call(block_mask=torch.ones(1, 1, 3, 4, dtype=torch.bool), block_size=16)
    with pytest.raises(ValueError, match="entries are 1"):
        call(block_mask=torch.full((1, 1, 4, 4), 2, dtype=torch.uint8), block_size=16)
    with pytest.raises(ValueError, match="at least 1"):
        call(block_mask=good, block_size=0)
    with pytest.raises(ValueError, match="heads"):
        call(block_mask=torch.ones(1, 3, 4, 4, dtype=torch.bool), block_size=16)
    # A 2-D mask serves every batch and head.
    assert torch.equal(call(block_mask=good[0, 0], block_size=16), call(block_mask=good, block_size=16))
