#!/usr/bin/env bash
# The prepared GPU check for a GPU machine that has no Rust toolchain (15 minutes of device
# time; the working tree travels, conformance/ and the PyTorch script included). Two steps:
#
#   scripts/device-check.sh pack    # here: build the CUDA and NCCL test binaries and the
#                                   # CUDA bench and strip them into device-pack/
#                                   # (git-ignored)
#   device run: command "bash scripts/device-check.sh run", carry ["device-pack"],
#               timeout_s 540
#
# `run` (on the GPU machine) runs the CUDA tests (attn-kernels: lib, cuda_*), the NCCL
# tests (attn-ring lib: a one-rank round trip and a rank that never joins; two NCCL ranks
# need two GPUs), then the CUDA bench and the PyTorch peer on the GPU. Everything goes to
# $OUT/tests.log and $OUT/bench.log; a summary line per step goes to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=device-pack

# Executables of the test targets named in $TARGETS that `cargo test --no-run ARGS` builds.
test_binaries() {
    cargo test --no-run --message-format=json "$@" 2>/dev/null | TARGETS="$TARGETS" python3 -c '
import json, os, sys
want = os.environ["TARGETS"].split()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(m["executable"])'
}

pack() {
    set -e
    rm -rf "$PACK"
    mkdir -p "$PACK/bin"
    local exe
    for exe in $(TARGETS="attn_kernels cuda_golden cuda_nvrtc cuda_proptest cuda_unavailable" \
        test_binaries -p attn-kernels --features cuda) \
        $(TARGETS="attn_ring" test_binaries -p attn-ring --features nccl); do
        cp "$exe" "$PACK/bin/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"
    done
    cargo build --release -p attn-kernels --features cuda --bin attn-cuda-bench
    cp target/release/attn-cuda-bench "$PACK/"
    strip "$PACK"/bin/* "$PACK/attn-cuda-bench"
    ls "$PACK/bin"
    du -sh "$PACK"
}

# Link the first library matching $2 found under / as $1 in the private library dir, and
# put its own directory on the library path too (libnvrtc opens libnvrtc-builtins there).
link_lib() {
    local found
    found=$(find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$2" -print 2>/dev/null | head -1)
    if [ -n "$found" ]; then
        ln -sf "$found" "/tmp/attn-libs/$1"
        LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$found")"
        echo "$1 -> $found"
    else
        echo "$1: none found"
    fi
}

run() {
    : "${OUT:=/tmp/device-out}"
    mkdir -p "$OUT" /tmp/attn-libs
    nvidia-smi -L
    # cudarc opens libnccl.so and libnvrtc.so; wheels and toolkits ship numbered names.
    export LD_LIBRARY_PATH="/tmp/attn-libs:${LD_LIBRARY_PATH:-}"
    link_lib libnccl.so 'libnccl.so.2*'
    link_lib libnvrtc.so 'libnvrtc.so.1[0-9]*'
    export ATTN_GOLDEN_DIR="$PWD/conformance"
    # On the GPU machine nothing may skip: a missing library fails the test, naming it.
    export ATTN_REQUIRE_GPU=1
    local t rc failed=0
    for t in "$PACK"/bin/*; do
        echo "=== $(basename "$t")" >>"$OUT/tests.log"
        timeout 240 "$t" --test-threads=1 >>"$OUT/tests.log" 2>&1
        rc=$?
        [ "$rc" -eq 0 ] || failed=1
        echo "$(basename "$t"): rc $rc; $(grep -a 'test result' "$OUT/tests.log" | tail -1)"
    done
    grep -a -E "panicked|FAILED|^test .*(cuda|gpu|nccl).* ok$" "$OUT/tests.log" | tail -40
    timeout 120 "$PACK/attn-cuda-bench" --seq 65536,262144 --dtype bf16 >"$OUT/bench.log" 2>&1
    echo "attn-cuda-bench: rc $?"
    # The same problem in PyTorch (the baseline), one line per sequence length.
    local seq
    for seq in 65536 262144; do
        timeout 120 python3 attn-bench/torch/torch_dilated.py --device cuda --dtype bf16 --seq-len "$seq" --heads 16 \
            --head-dim 128 --segments 2048,4096,8192,16384,32768 --dilations 1,2,4,8,16 >>"$OUT/bench.log" 2>&1
        echo "torch peer seq $seq: rc $?"
    done
    tail -20 "$OUT/bench.log"
    return "$failed"
}

case "${1:-}" in
pack) pack ;;
run) run ;;
*) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
