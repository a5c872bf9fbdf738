#!/usr/bin/env bash
# Run the CPU kernel tests (attn-kernels, plus this crate's numerics attacks on the CPU
# backend) under valgrind memcheck at small sizes; any memcheck error or definite leak
# fails the script. About 3 minutes on 2 cores. The two large fixed-size kernel tests
# (multi-tile cases, thread-count bit-identity) are skipped: 5 minutes alone under valgrind.
#   usage: attn-reliability/valgrind.sh
# Valgrind does not emulate AVX-512: its CPUID hides it, so the kernels' run-time ISA
# detection picks the AVX2/portable paths (the AVX-512 path is covered by the normal tests).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not installed" >&2; exit 2; }
# Small property-test sizes under valgrind (it runs ~30x slower).
export PROPTEST_CASES="${PROPTEST_CASES:-4}" PROPTEST_MAX_SHRINK_ITERS=0 RUST_BACKTRACE=0
JSON=$(mktemp) EXES=$(mktemp) LOGS=$(mktemp -d)
trap 'rm -rf "$JSON" "$EXES" "$LOGS"' EXIT
# The test executables `cargo test ARGS --no-run` builds, as "package/target path" lines
# appended to $EXES; a failed build fails the script (it is not a run of fewer tests).
executables() {
    cargo test "$@" --no-run --message-format=json >"$JSON"
    python3 scripts/cargo_executables.py --except attn-ptx <"$JSON" >>"$EXES"
}
# The workspace's own test build (the one `cargo test --workspace` runs, so nothing is
# rebuilt after it); a package alone would resolve other features and build again.
executables --workspace
exe() {
    awk -v t="$1" '$1 == t { print $2 }' "$EXES"
}
# Six jobs (binary and test-module filter): the kernels' unit tests, three kernel test
# modules, two attack modules. A job that runs no test fails like a memcheck error.
JOBS="$(exe attn-kernels/attn_kernels) -
$(exe attn-kernels/integration) block_api::
$(exe attn-kernels/integration) backend_properties::
$(exe attn-kernels/integration) backend_reference::
$(exe attn-reliability/integration) numerics::
$(exe attn-reliability/integration) nan_locality::"
if [ "$(awk 'NF == 2' <<<"$JOBS" | wc -l)" -ne 6 ]; then
    echo "expected 6 jobs, built: $(cat "$EXES")" >&2
    exit 1
fi
SKIP="--skip multi_tile_cases_match_reference --skip results_are_bit_identical_for_any_thread_count"
# A job's log name: its binary and the module it runs ("all" for no filter).
job_name() {
    local module=${2%::}
    echo "$(basename "$1")-${module/#-/all}"
}
# Valgrind runs a process's threads one at a time, so the jobs run side by side, one a
# core; each one's report is printed in order afterwards.
memcheck() {
    local bin=$1 filter=$2 name
    name=$(job_name "$bin" "$filter")
    [ "$filter" = - ] && filter=""
    valgrind --tool=memcheck --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
        --show-leak-kinds=definite --quiet "$bin" --test-threads=2 $SKIP $filter >"$LOGS/$name.log" 2>&1
    echo "$?" >"$LOGS/$name.rc"
}
export -f memcheck job_name
export LOGS SKIP
xargs -P "$(nproc)" -L 1 bash -c 'memcheck "$1" "$2"' _ <<<"$JOBS"
status=0
while read -r bin filter; do
    name=$(job_name "$bin" "$filter")
    echo "=== valgrind $name ==="
    # A job that never reported (no .rc) or ran no test fails as a memcheck error does; a
    # failure prints its whole report (a leak's backtrace alone is longer than a tail).
    if [ "$(cat "$LOGS/$name.rc" 2>/dev/null)" = 0 ] && grep -qE 'test result: ok\. [1-9]' "$LOGS/$name.log"; then
        tail -n 3 "$LOGS/$name.log"
    else
        status=1
        cat "$LOGS/$name.log"
    fi
done <<<"$JOBS"
exit "$status"
