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
