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
status=0
for t in "${TARGETS[@]}"; do
    echo "=== fuzz $t for ${SECS}s ==="
    # -rss_limit_mb: a reader that allocated a declared (huge) size would trip it.
    if ! cargo fuzz run -O -a "$t" "corpus/$t" -- \
        -max_total_time="$SECS" -max_len=8192 -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 \
        -print_final_stats=1 2>"corpus/$t.log"; then
        status=1
        tail -40 "corpus/$t.log"
    fi
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^Done [0-9]+ runs" "corpus/$t.log" | sed "s/^/$t: /" || true
done
exit "$status"
