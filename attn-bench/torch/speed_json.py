"""The device check's speed.json: at each sequence length, the CUDA kernels' times (the
Rust bench, `attn-cuda-bench`, CUDA events) with the device's defaults, the forward's
fraction of the GPU's measured matmul rate, and the times of the Python package and of
PyTorch's SDPA compositions measured in one Python process (`python -m attn_dilated.bench
--json`).

Reads the speed step's log (JSON lines of attn-cuda-bench and gpu_matmul.py) and the
bench's JSON; writes

  {"commit", "device", "matmul_tflops", "seq": {"65536": {"attn_fwd_ms", "attn_fwdbwd_ms",
   "attn_fwd_matmul_fraction", "python_fwd_ms", "python_fwdbwd_ms", "sdpa_flash_fwd_ms",
   "sdpa_flash_fwdbwd_ms", "sdpa_cudnn_fwd_ms", "sdpa_cudnn_fwdbwd_ms", ...}}}

with "hopper_fwd_ms", "hopper_fwdbwd_ms" and "hopper_fwd_matmul_fraction" for the sm_90a kernels
(TMA, wgmma; the rows `attn-cuda-bench --fwd-mma wgmma` prints, the backward's under
ATTN_CUDA_BWD_MMA=wgmma),
null for what did not run, and further keys for the other rows timed (the
previous defaults, the three-stage forward, the fused and the persistent launch of 64-row
blocks, a synchronisation between calls, the deterministic dq, gradients written directly
(dk and dv; with the deterministic dq, dq too), the backward's 64-row query tiles, SDPA's
default backend and SDPA on gathered segments).

Run:  python3 speed_json.py LOG PYTHON_JSON COMMIT DEVICE OUT     |     python3 speed_json.py --check
"""
import json, os, sys

from device_bench_summary import records

# The device's defaults on sm_90 (the rows the headline keys come from) and the previous ones.
# A row without "fwd_mma" (a bench before the sm_90a forward) ran the mma.sync kernels.
NEW = {"fwd_rows": "128w4", "launch": "per-pattern", "fwd_stages": "2", "fwd_mma": "mma-sync", "bwd_loads": "pipelined",
       "bwd_keys": "128", "bwd_dq": "atomic", "bwd_writes": "accumulated", "bwd_queries": "32"}
OLD = {"fwd_rows": "64", "launch": "per-pattern", "fwd_stages": "2", "fwd_mma": "mma-sync", "bwd_loads": "sync",
       "bwd_keys": "64", "bwd_dq": "atomic", "bwd_writes": "accumulated", "bwd_queries": "32"}
HOPPER = {**NEW, "fwd_mma": "wgmma"}
HEADLINE = ["attn_fwd_ms", "attn_fwdbwd_ms", "attn_fwd_matmul_fraction", "python_fwd_ms", "python_fwdbwd_ms",
            "sdpa_flash_fwd_ms", "sdpa_flash_fwdbwd_ms", "sdpa_cudnn_fwd_ms", "sdpa_cudnn_fwdbwd_ms",
            "hopper_fwd_ms", "hopper_fwdbwd_ms", "hopper_fwd_matmul_fraction"]


def matches(r, shape, backward):
    keys = ["fwd_rows", "launch", "fwd_stages", "fwd_mma"] + (
        ["bwd_loads", "bwd_keys", "bwd_dq", "bwd_writes", "bwd_queries"] if backward else [])
    return bool(r.get("backward")) == backward and all(str(r.get(k, OLD[k])) == shape[k] for k in keys)


def pick(rows, seq, shape, backward, between="queued", path="direct"):
    for r in rows:
        if r["seq"] == seq and r.get("path", "direct") == path and r.get("between", "queued") == between \
                and matches(r, shape, backward):
            return r
    return None


def speed(lines, python, commit, device):
    rows, matmul = [], None
    for r in records(lines):
        if r.get("impl") == "torch-matmul":
            matmul = r
        elif "kernels" in r:
            rows.append(r)
    rate = matmul["tflops"] if matmul else None
    seqs = sorted({r["seq"] for r in rows} | {int(s) for s in python.get("seq", {})})
    out = {"commit": commit, "device": device, "matmul_tflops": rate, "seq": {}}
    for seq in seqs:
        ms = lambda r: None if r is None else r["median_ms"]
        fwd, fwdbwd = pick(rows, seq, NEW, False), pick(rows, seq, NEW, True)
        entry = dict.fromkeys(HEADLINE)
        entry["attn_fwd_ms"], entry["attn_fwdbwd_ms"] = ms(fwd), ms(fwdbwd)
        # The bench's tflops already count 4 x head_dim per attended pair.
        if fwd is not None and rate:
            entry["attn_fwd_matmul_fraction"] = round(fwd["tflops"] / rate, 4)
        hopper = pick(rows, seq, HOPPER, False)
        entry["hopper_fwd_ms"], entry["hopper_fwdbwd_ms"] = ms(hopper), ms(pick(rows, seq, HOPPER, True))
        if hopper is not None and rate:
            entry["hopper_fwd_matmul_fraction"] = round(hopper["tflops"] / rate, 4)
        entry["attn_fwdbwd_sync_between_ms"] = ms(pick(rows, seq, NEW, True, between="synchronized"))
        entry["attn_fwdbwd_deterministic_ms"] = ms(pick(rows, seq, {**NEW, "bwd_dq": "deterministic"}, True))
        entry["attn_fwdbwd_direct_dkdv_ms"] = ms(pick(rows, seq, {**NEW, "bwd_writes": "direct"}, True))
        deterministic_direct = {**NEW, "bwd_dq": "deterministic", "bwd_writes": "direct"}
        entry["attn_fwdbwd_deterministic_direct_ms"] = ms(pick(rows, seq, deterministic_direct, True))
        three = pick(rows, seq, {**NEW, "fwd_stages": "3"}, False)
        entry["attn_fwd_three_stages_ms"] = ms(three)
        if three is not None and rate:
            entry["attn_fwd_three_stages_matmul_fraction"] = round(three["tflops"] / rate, 4)
        for launch in ["fused", "persistent"]:
            row = pick(rows, seq, {**NEW, "fwd_rows": "64", "launch": launch}, False)
            entry[f"attn_fwd_{launch}_ms"] = ms(row)
            if row is not None and rate:
                entry[f"attn_fwd_{launch}_matmul_fraction"] = round(row["tflops"] / rate, 4)
        entry["attn_fwdbwd_q64_ms"] = ms(pick(rows, seq, {**NEW, "bwd_queries": "64"}, True))
        entry["attn_fwdbwd_q64_deterministic_ms"] = ms(pick(rows, seq, {**NEW, "bwd_queries": "64",
                                                                        "bwd_dq": "deterministic"}, True))
        entry["old_defaults_fwd_ms"] = ms(pick(rows, seq, OLD, False))
        entry["old_defaults_fwdbwd_ms"] = ms(pick(rows, seq, OLD, True))
        for key, value in python.get("seq", {}).get(str(seq), {}).items():
            if key.endswith("_ms") or key == "rel_l2_vs_composition":
                entry[key] = value
        out["seq"][str(seq)] = entry
    return out


def check():
    line = lambda **kw: json.dumps({"kernels": "cubin sm_90", "seq": 65536, "path": "direct", **kw})
    log = [
        line(backward=False, fwd_rows="128w4", fwd_stages="3", median_ms=1.8, tflops=337.5),
        line(backward=False, fwd_rows="128w4", median_ms=2.0, tflops=300.0),
        line(backward=False, fwd_rows="64", median_ms=2.5, tflops=240.0),
        line(backward=False, fwd_rows="64", launch="fused", median_ms=2.4, tflops=250.0),
        line(backward=False, fwd_rows="64", launch="persistent", median_ms=1.6, tflops=375.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="atomic",
             bwd_queries="64", median_ms=8.0, tflops=250.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="deterministic",
             bwd_queries="64", median_ms=12.0, tflops=166.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="atomic",
             bwd_writes="direct", median_ms=9.0, tflops=222.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="atomic",
             median_ms=10.0, tflops=200.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="deterministic",
             median_ms=14.0, tflops=150.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="deterministic",
             bwd_writes="direct", median_ms=13.0, tflops=160.0),
        line(backward=True, fwd_rows="128w4", bwd_loads="pipelined", bwd_keys="128", bwd_dq="atomic",
             between="synchronized", median_ms=11.0, tflops=180.0),
        line(backward=True, fwd_rows="64", bwd_loads="sync", bwd_keys="64", median_ms=16.0, tflops=120.0),
        line(backward=False, fwd_rows="128w4", fwd_mma="wgmma", median_ms=1.2, tflops=500.0),
        line(backward=True, fwd_rows="128w4", fwd_mma="wgmma", bwd_loads="pipelined", bwd_keys="128",
             bwd_dq="atomic", median_ms=9.5, tflops=210.0),
        json.dumps({"impl": "torch-matmul", "dtype": "bf16", "n": 8192, "median_ms": 1.0, "tflops": 750.0}),
        "not json {",
    ]
    python = {"seq": {"65536": {"python_fwd_ms": 2.2, "python_fwdbwd_ms": 11.5, "sdpa_flash_fwd_ms": 1.7,
                                "sdpa_flash_fwdbwd_ms": 12.0, "sdpa_cudnn_fwd_ms": None,
                                "sdpa_cudnn_fwdbwd_ms": None, "rel_l2_vs_composition": 0.004}}}
    got = speed(log, python, "abc123", "NVIDIA H200")
    want = {"attn_fwd_ms": 2.0, "attn_fwdbwd_ms": 10.0, "attn_fwd_matmul_fraction": 0.4, "python_fwd_ms": 2.2,
            "python_fwdbwd_ms": 11.5, "sdpa_flash_fwd_ms": 1.7, "sdpa_flash_fwdbwd_ms": 12.0,
            "sdpa_cudnn_fwd_ms": None, "sdpa_cudnn_fwdbwd_ms": None, "hopper_fwd_ms": 1.2, "hopper_fwdbwd_ms": 9.5,
            "hopper_fwd_matmul_fraction": 0.6667, "attn_fwdbwd_sync_between_ms": 11.0,
            "attn_fwdbwd_deterministic_ms": 14.0, "attn_fwdbwd_direct_dkdv_ms": 9.0,
            "attn_fwdbwd_deterministic_direct_ms": 13.0, "attn_fwd_three_stages_ms": 1.8,
            "attn_fwd_three_stages_matmul_fraction": 0.45, "attn_fwd_fused_ms": 2.4,
            "attn_fwd_fused_matmul_fraction": 0.3333, "attn_fwd_persistent_ms": 1.6,
            "attn_fwd_persistent_matmul_fraction": 0.5, "attn_fwdbwd_q64_ms": 8.0,
            "attn_fwdbwd_q64_deterministic_ms": 12.0, "old_defaults_fwd_ms": 2.5, "old_defaults_fwdbwd_ms": 16.0,
            "rel_l2_vs_composition": 0.004}
    ok = got["matmul_tflops"] == 750.0 and got["commit"] == "abc123" and got["seq"] == {"65536": want}
    # Nothing timed: every headline key is null, never missing.
    empty = speed([], {"seq": {"262144": {}}}, "c", "d")["seq"]["262144"]
    ok = ok and all(k in empty and empty[k] is None for k in HEADLINE)
    print("speed_json --check: " + ("passed" if ok else f"FAILED\n{json.dumps(got, indent=1)}\n{empty}"))
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    log, py, commit, device, out = sys.argv[1:]
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    try:
        with open(py) as f:
            python = json.load(f)
    except (OSError, ValueError):
        python = {}
    with open(out + ".part", "w") as f:
        json.dump(speed(lines, python, commit, device), f, indent=1)
    os.replace(out + ".part", out)
