# shellcheck shell=bash
# The device check's two commands that run here, sourced by scripts/device-check.sh (whose
# `run` functions and step lists they use): `pack` builds device-pack/, everything a GPU
# machine without a Rust toolchain needs; `rehearse` packs, copies the pack into a clean
# directory and runs it there without a GPU.

# ---- pack (here) ----------------------------------------------------------------------------

# Executables of the test targets named in $TARGETS that `cargo test --no-run ARGS` builds.
test_binaries() {
    cargo test --no-run --message-format=json "$@" 2>/dev/null | python3 scripts/cargo_executables.py --paths --only $TARGETS
}

pack() {
    set -e
    cd "$(dirname "$0")/.."
    local pack=device-pack exe
    rm -rf "$pack"
    mkdir -p "$pack/bin" "$pack/torch"
    for exe in $(TARGETS="attn_kernels cuda_foreign cuda_golden cuda_nvrtc cuda_proptest cuda_unavailable" \
        test_binaries -p attn-kernels --features cuda) \
        $(TARGETS="attn_ring cuda_chunk_ring" test_binaries -p attn-ring --features nccl,cuda); do
        cp "$exe" "$pack/bin/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"
    done
    echo "pack: test binaries copied after ${SECONDS} s"
    cargo build -q --release -p attn-kernels --features cuda --bin attn-cuda-bench
    cargo build -q --release -p attn-golden --features cuda --bin attn-golden
    cargo build -q --release -p attn-ring --features cuda --example cuda_ring_bench
    local out="${CARGO_TARGET_DIR:-target}/release"
    cp "$out/attn-cuda-bench" "$out/attn-golden" "$out/examples/cuda_ring_bench" "$pack/bin/"
    strip "$pack"/bin/*
    echo "pack: release binaries built after ${SECONDS} s"
    # The Python package with its CUDA kernels (an abi3 extension), and its tests.
    local py_target="${CARGO_TARGET_DIR:-$PWD/target}/python"
    CARGO_TARGET_DIR="$py_target" cargo build -q --release --manifest-path attn-python/Cargo.toml --features cuda --lib
    mkdir -p "$pack/python/tests"
    cp -r attn-python/python/attn_dilated "$pack/python/"
    cp "$py_target/release/lib_native.so" "$pack/python/attn_dilated/_native.abi3.so"
    strip "$pack/python/attn_dilated/_native.abi3.so"
    cp attn-python/tests/*.py "$pack/python/tests/"
    cp -r conformance "$pack/"
    cp attn-bench/torch/torch_dilated.py attn-bench/torch/gpu_matmul.py attn-bench/torch/device_bench_summary.py \
        attn-bench/torch/speed_json.py "$pack/torch/"
    # The candle op on CUDA tensors (attn-candle's `cuda`): candle's kernels need nvcc and the
    # CUDA libraries to build (scripts/with-cuda-toolkit.sh). The binary holds candle's kernels
    # as PTX text, so it travels xz-compressed. It builds in the toolkit's target directory
    # (unless CARGO_TARGET_DIR is set), where candle's kernels are kept between runs.
    echo "pack: Python extension built after ${SECONDS} s"
    mkdir -p "$pack/candle"
    if ! exe=$(scripts/with-cuda-toolkit.sh cargo test --no-run --message-format=json -p attn-candle --features cuda \
        2>"$pack/candle/build.log" | python3 scripts/cargo_executables.py --paths --only integration) || [ -z "$exe" ]; then
        tail -20 "$pack/candle/build.log" >&2
        echo "pack: attn-candle's cuda tests did not build" >&2
        exit 1
    fi
    rm "$pack/candle/build.log"
    strip -o "$pack/candle/candle_cuda" "$exe"
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(open(sys.argv[1], "rb"), lzma.open(sys.argv[1] + ".xz", "wb"))' \
        "$pack/candle/candle_cuda"
    rm "$pack/candle/candle_cuda"
    echo "pack: candle's CUDA tests built after ${SECONDS} s"
    # The modules an sm_90 device loads (sm_90, and sm_90a under ATTN_CUDA_FWD_MMA=wgmma or
    # ATTN_CUDA_BWD_MMA=wgmma),
    # compiled by NVRTC 13.0 (the device's CUDA 13 and
    # PyTorch's cu130 wheels): a key that does not match there just compiles again.
    local nvrtc13="${ATTN_CUDA_HOME:-$HOME/.cache/attn-cuda}/cu13/nvidia/cu13/lib/libnvrtc.so.13"
    if [ -f "$nvrtc13" ]; then
        ATTN_NVRTC_PATH="$nvrtc13" cargo run -q --release -p attn-kernels --features cuda --bin attn-ptx -- \
            --arch 90,90a --fill-cache "$pack/kernel-cache"
    else
        echo "pack: no NVRTC 13 at $nvrtc13: the device will compile its kernels (about 30 s a dtype)" >&2
    fi
    echo "pack: kernel cache filled after ${SECONDS} s"
    # The binaries and kernel modules travel as xz tarballs (a third of the bytes; the
    # cubins a tenth), unpacked in place by `run`.
    python3 - "$pack" bin kernel-cache <<'PY'
import pathlib, shutil, sys, tarfile
root = pathlib.Path(sys.argv[1])
for name in sys.argv[2:]:
    if (root / name).is_dir():
        with tarfile.open(root / (name + ".tar.xz"), "w:xz") as tar:
            tar.add(root / name, arcname=name)
        shutil.rmtree(root / name)
PY
    cp scripts/device-check.sh "$pack/"
    git describe --always --dirty >"$pack/COMMIT" 2>/dev/null || echo unknown >"$pack/COMMIT"
    local n
    n=$(python3 -c 'import sys, tarfile; print(sum(m.isfile() for m in tarfile.open(sys.argv[1])))' "$pack/bin.tar.xz")
    [ "$n" -eq 11 ] || { echo "pack: expected 11 binaries, got $n" >&2; exit 1; }
    echo "pack: $(du -sh "$pack" | cut -f1) in $pack ($n binaries, commit $(cat "$pack/COMMIT"))"
}

# ---- rehearse (here) ------------------------------------------------------------------------

rehearse() {
    set -e
    pack
    local dir
    dir=$(mktemp -d /tmp/attn-rehearse.XXXX)
    cp -r "$(cd "$(dirname "$0")/.." && pwd)/device-pack" "$dir/"
    local size
    size=$(du -sm "$dir/device-pack" | cut -f1)
    set +e
    # A clean directory, no GPU: every GPU step must say `not run (no GPU)`, the env step passes.
    (cd "$dir" && OUT="$dir/out" bash device-pack/device-check.sh run)
    local rc=$? s
    # Without a GPU `run` reports every step, then fails with 3 (no GPU): expected here.
    if ! have_gpu; then
        if [ "$rc" -eq 3 ]; then
            rc=0
        else
            echo "rehearse: run without a GPU exited $rc, not 3 (no GPU)" >&2
            rc=1
        fi
    fi
    for s in $STEPS; do
        grep -q "^- $s: " "$dir/out/device-report.md" || { echo "rehearse: no line for $s" >&2; rc=1; }
    done
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$dir/out/device-report.json" || rc=1
    tar tzf "$dir/out/logs.tgz" | grep -c 'env.log$' >/dev/null || { echo "rehearse: logs.tgz holds no env.log" >&2; rc=1; }
    # The kernel cache the device's steps count on, and tests behind every filter.
    [ "$(ls "$dir/device-pack/kernel-cache"/*.kernels 2>/dev/null | wc -l)" -eq 6 ] ||
        { echo "rehearse: the pack lacks the sm_90 and sm_90a kernel cache (NVRTC 13 needed to pack)" >&2; rc=1; }
    local t f
    for t in cuda_foreign cuda_proptest attn_kernels cuda_nvrtc cuda_golden cuda_chunk_ring attn_ring; do
        for f in $(test_filters "$t") ""; do
            [ -z "$f" ] && [ -n "$(test_filters "$t")" ] && continue
            [ "$("$dir/device-pack/bin/$t" --list $f 2>/dev/null | grep -c ': test$')" -gt 0 ] ||
                { echo "rehearse: $t lists no test for filter '$f'" >&2; rc=1; }
        done
    done
    for f in "${PYTHON_GPU_TESTS[@]}"; do
        [ "$(grep -c '^def test_' "$dir/device-pack/python/$f" 2>/dev/null)" -gt 0 ] ||
            { echo "rehearse: the pack's $f holds no test" >&2; rc=1; }
    done
    # A rerun of one step adds to the report: every step keeps its line.
    (cd "$dir" && OUT="$dir/out" bash device-pack/device-check.sh run --only golden >/dev/null)
    [ "$(grep -c '^- ' "$dir/out/device-report.md")" -eq 9 ] ||
        { echo "rehearse: run --only dropped the other steps' lines" >&2; rc=1; }
    [ "$(ls "$dir/out" | wc -l)" -le 5 ] || { echo "rehearse: more than 5 files in \$OUT: $(ls "$dir/out")" >&2; rc=1; }
    python3 "$dir/device-pack/torch/device_bench_summary.py" --check || rc=1
    python3 "$dir/device-pack/torch/speed_json.py" --check || rc=1
    if ! have_gpu; then
        grep -q '^- env: passed' "$dir/out/device-report.md" || { echo "rehearse: env did not pass" >&2; rc=1; }
        [ "$(grep -c 'not run (no GPU)' "$dir/out/device-report.md")" -eq 8 ] || {
            echo "rehearse: expected 8 GPU steps not run" >&2
            rc=1
        }
    fi
    # The device tool carries at most 64 MiB: the pack as packed (before `run` unpacked
    # it) and the tracked tree (about 11 MB).
    [ "$size" -le 48 ] || { echo "rehearse: the pack is ${size} MB (over 48)" >&2; rc=1; }
    rm -rf "$dir"
    [ "$rc" -eq 0 ] && echo "rehearse: passed (pack ${size} MB)"
    return "$rc"
}
