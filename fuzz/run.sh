#!/usr/bin/env bash
# Run every attn fuzz target for SECONDS each (default 60) with cargo-fuzz (libFuzzer +
# AddressSanitizer, optimised, with debug assertions and overflow checks: `-O -a`, so a
# size computation that wraps is a crash, not a silently wrong number) on the stable toolchain. Idempotent: the corpus is kept in
# fuzz/corpus/ between runs (git-ignored) and re-seeded from fuzz/seeds/ each time.
# Exits non-zero if any target finds a crash (the input is left in fuzz/artifacts/).
#   usage: fuzz/run.sh [SECONDS]
set -euo pipefail
SECS="${1:-60}"
cd "$(dirname "$0")"
# cargo-fuzz passes nightly-only -Z flags (sanitizer); stable accepts them with this.
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
TARGETS=(golden_reader weights_reader config_shape ring_plan)
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t"
    if [ -d "seeds/$t" ]; then cp -f seeds/"$t"/* "corpus/$t/"; fi
done
cargo fuzz build -O -a
# One target a core: each still fuzzes for SECS seconds on a core of its own, and the
# targets of a batch run side by side (their reports are printed in order after it).
JOBS=$(nproc)
# -rss_limit_mb: a reader that allocated a declared (huge) size would trip it.
fuzz_one() {
    cargo fuzz run -O -a "$1" "corpus/$1" -- \
        -max_total_time="$SECS" -max_len=8192 -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 \
        -print_final_stats=1 2>"corpus/$1.log"
}
status=0
for ((i = 0; i < ${#TARGETS[@]}; i += JOBS)); do
    batch=("${TARGETS[@]:i:JOBS}")
    pids=()
    for t in "${batch[@]}"; do
        fuzz_one "$t" &
        pids+=($!)
    done
    for j in "${!batch[@]}"; do
        t=${batch[j]}
        echo "=== fuzz $t for ${SECS}s ==="
        if ! wait "${pids[j]}"; then
            status=1
            tail -40 "corpus/$t.log"
        fi
        grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^Done [0-9]+ runs" "corpus/$t.log" | sed "s/^/$t: /" || true
    done
done
exit "$status"
