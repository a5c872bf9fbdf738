"""`attn_dilated.distributed` across processes: `torchrun --standalone` with gloo runs
`dist_worker.py` on 2 and 3 ranks, and each rank's report is judged here: every
conformance file (dilated, features, blocks) under two (layout, strategy) pairs a world size
(together both layouts with both of auto and ring) equals the file and the single-process
op (a fixed case count), and so does every
dilated and features file through allgather, ulysses and hybrid on 3 ranks; a rank that exits or
raises mid-call makes every other rank raise within the timeout, and the group is refused
afterwards; ranks with different configs, masks or row counts raise on every rank. The
sharding helpers are checked in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import attn_dilated.distributed as ddist
from test_golden import files

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
# dilated 9 + features 9 + blocks 8 files, 2 (layout, strategy) pairs a world size.
CONFORMANCE_CASES = (9 + 9 + 8) * 2


def run_ranks(mode: str, world: int, tmp_path) -> list:
    """Every rank's report of `dist_worker.py MODE` on `world` ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", WORKER, mode,
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    reports = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        if mode in ("exit",) and r == 1:
            continue
        assert path.exists(), f"rank {r} wrote no report (rc {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        report = json.loads(path.read_text())
        assert "crashed" not in report, report["crashed"]
        reports.append(report)
    return reports


@pytest.mark.parametrize("world", [2, 3])
def test_conformance_files_on_ranks(world, tmp_path):
    assert len(files("dilated", "features", "blocks")) == 26
    for report in run_ranks("conformance", world, tmp_path):
        assert report["failures"] == [], "\n".join(report["failures"][:10])
        assert report["cases"] == CONFORMANCE_CASES


def test_the_head_and_gather_strategies_on_three_ranks(tmp_path):
    """allgather, ulysses and hybrid (ulysses=1) on every dilated and features file; the
    two files with 2 heads are refused by Ulysses over 3 ranks (fewer heads than ranks)."""
    for report in run_ranks("strategies", 3, tmp_path):
        assert report["failures"] == [], "\n".join(report["failures"][:10])
        assert report["refused"] == ["dilated/hg_dense ulysses", "features/varlen_win_pad ulysses"]
        assert report["cases"] == 3 * 18 - 2


def test_ring_modules_equal_the_single_process_modules(tmp_path):
    for report in run_ranks("modules", 3, tmp_path):
        assert report["failures"] == [], "\n".join(report["failures"])
        assert report["cases"] == 2 * 2 + 2


@pytest.mark.parametrize("kind", ["exit", "raise"])
def test_a_failed_rank_fails_every_rank_within_the_timeout(kind, tmp_path):
    reports = run_ranks(kind, 3, tmp_path)
    assert len(reports) == (2 if kind == "exit" else 3)
    for report in reports:
        assert report["raised"] is not None, f"rank {report['rank']} returned"
        assert report["raised"].startswith("RuntimeError"), report["raised"]
        assert report["elapsed"] < report["timeout"] + 5.0, report
        assert report["again"] is not None and "earlier ring round" in report["again"], report
        assert report["again_elapsed"] < 1.0, report
    if kind == "raise":
        assert "planted transport failure" in reports[1]["raised"]


def test_mismatched_ranks_raise_on_every_rank(tmp_path):
    for report in run_ranks("mismatch", 3, tmp_path):
        assert report["config"] is not None and "disagree" in report["config"], report
        assert report["mask"] is not None and "disagree" in report["mask"], report
        assert report["blocks"] is not None and "disagree" in report["blocks"], report
        assert report["after"] is None, report


def test_mis_sized_rows_raise_on_every_rank(tmp_path):
    for report in run_ranks("rows", 2, tmp_path):
        assert report["raised"] is not None and "rows" in report["raised"], report


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shards_cover_the_sequence_once(layout):
    x = torch.arange(2 * 23 * 3).view(2, 23, 3)
    for world in (1, 2, 3, 5):
        parts = [ddist.shard(x, r, world, layout) for r in range(world)]
        got = torch.cat([p[0, :, 0] for p in parts]).sort().values
        assert torch.equal(got, x[0, :, 0]), (layout, world)
        ranges = [ddist.layout_ranges(23, r, world, layout) for r in range(world)]
        for part, rs in zip(parts, ranges):
            want = torch.cat([x[:, a:b] for a, b in rs], dim=1)
            assert torch.equal(part, want)
    assert ddist.layout_ranges(16, 1, 2, "zigzag") == [(4, 12)]
    assert ddist.layout_ranges(16, 0, 2, "zigzag") == [(0, 4), (12, 16)]


def test_sharding_arguments_are_checked():
    x = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="layout"):
        ddist.shard(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank"):
        ddist.shard(x, 2, 2)
    with pytest.raises(ValueError, match="empty"):
        ddist.shard(x, 0, 5)
    with pytest.raises(ValueError, match="seq_dim"):
        ddist.shard(x, 0, 2, seq_dim=3)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ddist.dilated_attention(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), [4], [1])
