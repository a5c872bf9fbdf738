#!/usr/bin/env bash
# CI for the Python package: a virtual environment under ~/.cache (created once, then
# reused; a package already installed is not installed again), the wheel built by
# maturin and installed, the crate's fmt, clippy (with and without `cuda`) and Rust unit
# tests, then pytest (`tests/test_distributed.py` starts `torchrun --standalone` with gloo on
# 2 and 3 ranks: about 3 minutes on 2 cores).
#
#   bash attn-python/ci.sh
#
# ATTN_PY_VENV overrides the environment's path, PYTHON the interpreter that creates it
# (Python 3.9 or later), CARGO_TARGET_DIR the build directory (default under ~/.cache,
# so that later runs on the same machine rebuild incrementally).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${ATTN_PY_VENV:-$HOME/.cache/attn-py-venv}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/attn-python-target}"
start=$SECONDS

if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
export PATH="$venv/bin:$PATH"

# Distribution name and requirement of everything the build and the tests need.
missing=()
for pair in "torch|torch>=2.4" "maturin|maturin>=1.5,<2" "pytest|pytest" "numpy|numpy" "safetensors|safetensors"; do
    dist="${pair%%|*}"
    if ! "$py" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
        missing+=("${pair#*|}")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "ci.sh: installing ${missing[*]}"
    "$py" -m pip install --quiet "${missing[@]}"
fi
echo "ci.sh: environment ready after $((SECONDS - start)) s"

# The venv's maturin builds the wheel (no isolated build environment to download).
"$py" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall "$here"
echo "ci.sh: wheel built and installed after $((SECONDS - start)) s"

# The crate is its own workspace, so the root's fmt and clippy do not reach it.
cargo fmt --manifest-path "$here/Cargo.toml" --check
for features in "" cuda; do
    CARGO_TARGET_DIR="$CARGO_TARGET_DIR/unit" PYO3_PYTHON="$py" cargo clippy --quiet --manifest-path "$here/Cargo.toml" \
        --all-targets --features "$features" -- -D warnings
done
CARGO_TARGET_DIR="$CARGO_TARGET_DIR/unit" PYO3_PYTHON="$py" cargo test --quiet --manifest-path "$here/Cargo.toml" --lib

cd "$here"
"$py" -m pytest -q -p no:cacheprovider tests
echo "ci.sh: done after $((SECONDS - start)) s"
