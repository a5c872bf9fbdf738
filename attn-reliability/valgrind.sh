#!/usr/bin/env bash
# Run the CPU kernel tests (attn-kernels, plus this crate's numerics attacks on the CPU
# backend) under valgrind memcheck at small sizes; any memcheck error or definite leak
# fails the script. About 3 minutes on 2 cores. The two large fixed-size kernel tests
# (multi-tile cases, thread-count bit-identity) are skipped: 5 minutes alone under valgrind.
#   usage: attn-reliability/valgrind.sh [extra test-name filter]
# Valgrind does not emulate AVX-512: its CPUID hides it, so the kernels' run-time ISA
# detection picks the AVX2/portable paths (the AVX-512 path is covered by the normal tests).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not installed" >&2; exit 2; }
FILTER="${1:-}"
# Small property-test sizes under valgrind (it runs ~30x slower).
export PROPTEST_CASES="${PROPTEST_CASES:-4}" PROPTEST_MAX_SHRINK_ITERS=0 RUST_BACKTRACE=0
# The test executables `cargo test ARGS --no-run` builds, into the file $OUT_LIST; a
# failed build fails the script (it is not a run of fewer binaries).
executables() {
    cargo test "$@" --no-run --message-format=json >"$JSON"
    python3 -c 'import sys, json
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] != "attn-ptx":
        print(m["executable"])' "$JSON" >>"$OUT_LIST"
}
JSON=$(mktemp) OUT_LIST=$(mktemp) LOGS=$(mktemp -d)
trap 'rm -rf "$JSON" "$OUT_LIST" "$LOGS"' EXIT
executables -p attn-kernels --lib --test block_api --test backend_properties --test backend_reference
executables -p attn-reliability --test numerics --test nan_locality
BINS=$(cat "$OUT_LIST")
# Six binaries: the kernels' unit tests, three kernel test files, two attack files.
if [ "$(wc -l <"$OUT_LIST")" -ne 6 ]; then
    echo "expected 6 test binaries, built: $BINS" >&2
    exit 1
fi
SKIP="--skip multi_tile_cases_match_reference --skip results_are_bit_identical_for_any_thread_count"
# Valgrind runs a process's threads one at a time, so the binaries run side by side, one a
# core; each one's report is printed in order afterwards.
memcheck() {
    local name
    name=$(basename "$1")
    valgrind --tool=memcheck --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
        --show-leak-kinds=definite --quiet "$1" --test-threads=2 $SKIP $FILTER >"$LOGS/$name.log" 2>&1
    echo "$?" >"$LOGS/$name.rc"
}
export -f memcheck
export LOGS SKIP FILTER
xargs -P "$(nproc)" -I{} bash -c 'memcheck "$1"' _ {} <"$OUT_LIST"
status=0
for bin in $BINS; do
    name=$(basename "$bin")
    echo "=== valgrind $name ==="
    # A binary that never reported (no .rc) fails as a memcheck error does; a failure
    # prints its whole report (a leak's backtrace alone is longer than a tail).
    if [ "$(cat "$LOGS/$name.rc" 2>/dev/null)" = 0 ]; then
        tail -n 3 "$LOGS/$name.log"
    else
        status=1
        cat "$LOGS/$name.log"
    fi
done
exit "$status"
