"""`python -m attn_dilated.bench` on CPU tensors: one process times the package, the
composition (plain and under a named SDPA backend) and SDPA on gathered segments, and
writes every figure to JSON with the package's error against the composition."""

import json

from attn_dilated import bench


def test_the_bench_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "speed.json"
    bench.main(
        ["--seqs", "64,128", "--heads", "3", "--head-dim", "8", "--segments", "16,32", "--dilations", "1,2",
         "--reps", "1", "--sdpa", "math", "--gathered", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    assert sorted(figures["seq"]) == ["128", "64"]
    for seq, row in figures["seq"].items():
        for key in ("python", "sdpa", "sdpa_math", "sdpa_gathered"):
            for run in ("fwd", "fwdbwd"):
                value = row[f"{key}_{run}_ms"]
                assert value is not None and value > 0, f"{seq}: {key}_{run}_ms = {value}"
        # The package computes the composition's function (float32 on both sides).
        assert row["rel_l2_vs_composition"] < 1e-5, row
    printed = capsys.readouterr().out
    assert printed.count("speed-up") == 2 and "gathered, math" in printed


def test_a_backend_that_refuses_is_recorded_as_missing():
    def refuses():
        raise RuntimeError("No available kernel. Aborting execution.\nmore")

    assert bench.timed("refusing", refuses, refuses, 1, bench.torch.device("cpu")) == (None, None)


def test_the_distributed_bench_reports_each_world(tmp_path):
    """Two gloo process counts: every figure present, the op's bytes and the rank's
    footprint fall by N where every segment fits in a rank's rows, and the extension's
    scratch is counted (non-zero)."""
    out = tmp_path / "dist.json"
    bench.main(
        ["--distributed", "--worlds", "1,2", "--dist-seq", "2048", "--heads", "4", "--head-dim", "16",
         "--segments", "256,512", "--dilations", "1,2", "--reps", "1", "--json", str(out)]
    )
    figures = json.loads(out.read_text())["distributed"]
    assert sorted(figures) == ["1", "2"]
    for row in figures.values():
        assert row["ms"] > 0 and row["bytes"] > row["scratch"] > 0 and row["rank_bytes"] > row["bytes"], row
    assert figures["1"]["op_fall_over_n"] == figures["1"]["rank_fall_over_n"] == 1.0
    assert figures["2"]["op_fall_over_n"] >= 0.9, figures["2"]
    assert figures["2"]["rank_fall_over_n"] >= 0.9, figures["2"]


def test_the_allocation_count_sees_the_extensions_allocations():
    """A Rust allocation of a known size (a 1024 x 1024 block mask built in the extension)
    shows in the window; nothing allocated shows as nothing."""
    from attn_dilated import _native, bench_distributed

    built = bench_distributed.op_bytes(lambda: _native.sparse_pattern_mask("local_window", 64, 0, 1, [1], 1024, 1024))
    assert built >= 1024 * 1024, built
    assert bench_distributed.op_bytes(lambda: None) == 0


def test_a_footprint_that_does_not_fall_fails_the_bound():
    """The fall is per rank and over N: a rank holding the whole sequence (what unsharding
    before the attention would do) reads 0.5·N at N = 2."""
    from attn_dilated.bench_distributed import fall

    base = {"world": 1, "rank_bytes": 1000}
    assert fall(base, {"world": 2, "rank_bytes": 500}, "rank_bytes") == 1.0
    assert fall(base, {"world": 2, "rank_bytes": 1000}, "rank_bytes") == 0.5
    assert fall(base, {"world": 2, "rank_bytes": 0}, "rank_bytes") is None
