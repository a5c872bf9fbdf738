"""`attn_dilated.distributed` on CUDA tensors: attn's chunk ring on the device, its rows
moving by attn's NCCL communicator. On a GPU: a world of one NCCL rank in this process,
every `dilated` and `features` file under both layouts (a sample of them under the
Ulysses and hybrid names, which on one rank have nothing to exchange and run
segment-local; the head exchange on a GPU is attn-ring's `cuda_chunk_ring_head_strategies`), output, LSE and gradients (of `out . grad_out` and of `out . grad_out + lse .
grad_lse`) equal to the single-process CUDA op and to the file within its `rel_tol`, all
on the device, the link joined once and reused, `unshard` through the group's all_gather;
and the same files under `torchrun --nproc_per_node 1` with the NCCL backend. These skip
without a GPU, and fail instead where `ATTN_REQUIRE_GPU` is set (`gpu_policy`).

Without a GPU: the NCCL link cache (rank 0's unique id broadcast over a gloo group of two
ranks, one link per group and device) with stand-ins for the native id maker and join,
and the error a CUDA tensor meets where the ring cannot run on it."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import attn_dilated.distributed as ddist
from attn_dilated import _nccl_link
import dist_worker
from gpu_policy import skip_gpu_test
from test_distributed import run_ranks
from test_golden import files

# dilated 9 + features 9 files, under both layouts.
FILE_CASES = (9 + 9) * 2


def unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ddist.cuda_unavailable_reason(torch.device("cuda", 0))


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    """A default process group of one rank on the NCCL backend, in this process."""
    reason = unavailable()
    if reason is not None:
        skip_gpu_test("the distributed CUDA tests", reason)
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    store = tmp_path_factory.mktemp("nccl") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def test_file_count():
    assert len(files("dilated", "features")) == FILE_CASES // 2


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("path", files("dilated", "features"), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_files_through_one_nccl_rank(path, layout, nccl_world):
    dist_worker.one_file(path, 0, 1, layout, "ring", device=nccl_world)


@pytest.mark.parametrize("strategy, ulysses", [("ulysses", None), ("hybrid", 1)])
@pytest.mark.parametrize("path", files("dilated", "features")[::4], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_sampled_files_through_the_head_strategies_on_one_nccl_rank(path, strategy, ulysses, nccl_world):
    dist_worker.one_file(path, 0, 1, "contiguous", strategy, ulysses, device=nccl_world)


def test_results_stay_on_the_device_and_the_link_is_reused(nccl_world):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=g).to(nccl_world).requires_grad_() for _ in range(3))
    out, lse = ddist.dilated_attention_with_lse(q, k, v, [16, 64], [1, 2], True, layout="zigzag")
    links = len(_nccl_link.LINKS)
    out2, lse2 = ddist.dilated_attention_with_lse(q, k, v, [16, 64], [1, 2], True, layout="zigzag")
    assert len(_nccl_link.LINKS) == links >= 1
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    dq, dk, dv = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    for t in (out, lse, dq, dk, dv):
        assert t.device == nccl_world
    whole = ddist.unshard(out.detach(), 0, 1, "zigzag")
    assert whole.device == nccl_world and torch.equal(whole, out.detach())


def test_one_rank_under_torchrun_with_nccl(tmp_path):
    reason = unavailable()
    if reason is not None:
        skip_gpu_test("torchrun --nproc_per_node 1 with NCCL", reason)
    (report,) = run_ranks("cuda", 1, tmp_path)
    assert report["failures"] == [], "\n".join(report["failures"][:10])
    assert report["cases"] == FILE_CASES
    assert report["links"] == 1


def test_rank_zeros_id_reaches_every_rank_once_per_group_and_device(tmp_path):
    """Two gloo ranks, stand-ins for the id maker and the join: only rank 0 makes ids, every
    rank joins with rank 0's id, a second call reuses the link, another device or another
    group gets a new id, and a failing id maker fails every rank with its reason."""
    reports = run_ranks("nccl_id", 2, tmp_path)
    assert reports[0]["made"] == [0, 0, 0] and reports[1]["made"] == [], [r["made"] for r in reports]
    joined = reports[0]["joined"]
    assert joined == reports[1]["joined"]
    assert [[(r, w, d) for r, w, d, _ in rank] for rank in joined] == [
        [(0, 2, 0), (0, 2, 1), (0, 2, 0)],
        [(1, 2, 0), (1, 2, 1), (1, 2, 0)],
    ]
    ids = [[uid for *_, uid in rank] for rank in joined]
    assert ids[0] == ids[1], "the ranks joined with different ids"
    assert len(set(ids[0])) == 3, "a group or device reused another's id"
    for report in reports:
        assert report["reused"] and report["other_device"] and report["other_group"], report
        assert report["cached"] == 3
        assert report["failed"] is not None and "planted: no NCCL here" in report["failed"], report
        assert report["failed"].startswith("RuntimeError: rank 0 of the group could not make"), report


def test_a_cuda_tensor_where_the_ring_cannot_run_is_told_why():
    """No ValueError about CPU tensors: a RuntimeError with the reason and its fix (where
    the ring can run, as on a GPU, the check lets the tensor through)."""
    stand_in = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="CPU and CUDA tensors"):
        ddist._ring_device(types.SimpleNamespace(device=torch.device("meta")))
    if unavailable() is None:
        assert ddist._ring_device(stand_in) is None
        return
    native = ddist.cuda_unavailable_reason(stand_in.device)
    assert native, "no reason, yet the ring cannot run"
    fixes = ("rebuild attn_dilated", "nvidia-nccl-cu", "libcuda", "libnvrtc", "no GPU")
    assert any(f in native for f in fixes), native
    with pytest.raises(RuntimeError, match="cannot run on cuda:0 tensors") as e:
        ddist._ring_device(stand_in)
    assert native in str(e.value)
