#!/usr/bin/env bash
# Run a command with a CUDA 13 build toolkit made of NVIDIA's PyPI wheels, for what needs
# one at build time: candle's `cuda` feature (attn-candle's `cuda`) compiles candle's
# kernels with nvcc and links libcuda, libcublas, libcurand and libcudart.
#
#   scripts/with-cuda-toolkit.sh cargo clippy -p attn-candle --features cuda --all-targets
#
# The wheels go under $ATTN_CUDA_HOME (default ~/.cache/attn-cuda), installed once:
# cu13-toolkit/ (nvcc, its compiler, headers, libcudart, libcublas, libcurand) and
# cu13-link/lib (the names the linker asks for, and a stub libcuda.so.1 exporting the
# driver functions cudarc declares: the real driver is only needed where the binary runs).
# The command sees PATH (nvcc), CUDA_HOME (the toolkit), CUDA_PATH (the link directory),
# CUDA_COMPUTE_CAP (90 unless set: the H100/H200 the device check runs on) and, unless set,
# CARGO_TARGET_DIR=$ATTN_CUDA_HOME/candle-target: nvcc takes minutes over candle's own
# kernels (once per profile), so their build is kept there between runs on a machine. This
# repository's crates are always rebuilt there: their fingerprints go first, since cargo
# judges path sources by modification time and another checkout's older files would pass
# for built.
set -euo pipefail
cd "$(dirname "$0")/.."
home="${ATTN_CUDA_HOME:-$HOME/.cache/attn-cuda}"
toolkit="$home/cu13-toolkit"
cu13="$toolkit/nvidia/cu13"
link="$home/cu13-link"

if ! [ -x "$cu13/bin/nvcc" ] || ! [ -f "$cu13/lib/libcublas.so.13" ]; then
    python3 -m pip install -q --target "$toolkit" nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 >&2
fi

# cudarc's driver functions, from the cudarc this workspace resolves (every name its
# linking mode may reference), as a stub with the driver's soname.
cudarc_sys() {
    cargo metadata -q --format-version 1 --all-features | python3 -c '
import json, os, sys
pkgs = json.load(sys.stdin)["packages"]
dirs = [os.path.dirname(p["manifest_path"]) for p in pkgs if p["name"] == "cudarc"]
print(os.path.join(dirs[0], "src/driver/sys/mod.rs"))'
}

if ! [ -f "$link/lib/stubs/libcuda.so" ] || ! [ -f "$link/CUDARC" ] || [ "$(cat "$link/CUDARC")" != "$(cudarc_sys)" ]; then
    rm -rf "$link"
    mkdir -p "$link/lib/stubs"
    sys=$(cudarc_sys)
    grep -oE '^\s+fn cu[A-Za-z0-9_]+\(' "$sys" | sed 's/ *fn //; s/(//' | sort -u |
        awk '{print "void " $1 "(void) {}"}' >"$link/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/lib/stubs/libcuda.so" "$link/libcuda_stub.c"
    for lib in libnvrtc.so.13 libcurand.so.10 libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
        ln -sf "$cu13/lib/$lib" "$link/lib/${lib%.*}"
    done
    echo "$sys" >"$link/CUDARC"
fi

if [ -z "${CARGO_TARGET_DIR:-}" ]; then
    export CARGO_TARGET_DIR="$home/candle-target"
    rm -rf "$CARGO_TARGET_DIR"/*/.fingerprint/attn-*
fi
export PATH="$cu13/bin:$PATH" CUDA_HOME="$cu13" CUDA_PATH="$link" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
exec "$@"
