#!/usr/bin/env bash
# The prepared check for a GPU machine that has no Rust toolchain: one command, at most 9
# minutes, that reports every step truthfully.
#
#   scripts/device-check.sh pack       # here: build the binaries into device-pack/ (git-ignored,
#                                      # self-contained: binaries, conformance/, the PyTorch peer)
#   scripts/device-check.sh rehearse   # here: pack, copy the pack into a clean directory and run
#                                      # it there; GPU steps report `not run (no GPU)`, and `run`
#                                      # exits 3 (no GPU), which the rehearsal expects
#   device run: command "bash device-pack/device-check.sh run", carry ["device-pack"], timeout_s 580
#               (each step has a budget, 540 s in all, and the run stops starting commands at
#               540 s; `run --only STEP[,STEP...]` reruns those steps). $OUT holds five files, rewritten
#               after every step so a run cut short still reports: device-report.md and .json,
#               bench-summary.md, speed.json and logs.tgz (every step's log).
#
# Steps, by value: env (GPU, driver, compute capability, the libraries loaded), golden (every
# conformance directory on the CUDA backend, f32/bf16/f16, forward and gradients; the
# multihead layer's in f32; on sm_90 the bf16/f16 files again under ATTN_CUDA_FWD_MMA=wgmma
# and ATTN_CUDA_BWD_MMA=wgmma, the sm_90a forward and backward, not yet the default), tests (the CUDA test binaries, proptests at a
# bounded case count), speed (at most 150 s: the Rust bench with the sm_90 defaults on the
# mma.sync kernels, the sm_90a forward (TMA, wgmma) alone and with the backward, the previous ones and
# the variants not yet timed (the persistent forward, the 64-row backward),
# queued and synchronised between calls, dq by atomics and deterministic; in one Python
# process the package, the SDPA composition under the FlashAttention and cuDNN backends and
# SDPA on pre-gathered segments; the PyTorch peer; the GPU's matmul rate; ncu where allowed;
# bench-summary.md and speed.json), ring (the chunk ring's golden files with CUDA block
# compute, per-rank memory and time for P = 1, 2, 4, 8 on one GPU), python (the `attn_dilated`
# package's CUDA tests: torch CUDA tensors through the kernels on torch's stream, and across
# torch.distributed ranks through NCCL, world size 1 in-process and under torchrun), candle (attn-candle's op on candle CUDA tensors: the
# golden files in every dtype and layout, random cases against the host), sanitizer
# (compute-sanitizer memcheck and racecheck on a small bf16 forward+backward), nccl (a
# one-rank round trip and a peer that never joins). Each step writes
# `STEP: passed|FAILED|not run (why)` to $OUT/device-report.md (JSON twin device-report.json)
# and its output to STEP.log in $OUT/logs.tgz. ATTN_REQUIRE_GPU=<the GPUs listed>: no GPU test
# may skip, and a test filter that matches nothing fails its step. `run` on a machine with no
# visible GPU writes the report (GPU steps `not run (no GPU)`) and exits 3: a run that checked
# no GPU does not pass. The pack carries the kernel cache of sm_90 (H100, H200) compiled here
# with NVRTC 13.0, so no step waits for NVRTC there.
set -uo pipefail
STEPS="env golden tests speed ring python candle sanitizer nccl"

# ---- run (there) ----------------------------------------------------------------------------

# The test binaries the steps run with a name filter, and their filters (libtest takes
# any of them); `rehearse` checks that each filter names at least one test.
test_filters() {
    case $1 in
    attn_kernels) echo cuda ;;
    cuda_nvrtc) echo nvrtc_opens_from_its_directory newer_than_nvrtc ;;
    attn_ring) echo nccl ;;
    esac
}

# record STEP RESULT SECONDS: a tab-separated row of $LOGS/steps.tsv, which the report is
# made from (a later row of a step, from `run --only`, replaces an earlier one).
record() {
    local r=${2//$'\t'/ }
    printf '%s\t%s\t%s\n' "$1" "${r//$'\r'/ }" "$3" >>"$LOGS/steps.tsv"
    echo "$1: $2 (${3} s)"
}

# The report's line of each step run so far, in step order.
report_lines() {
    local s
    for s in $STEPS; do
        awk -F '\t' -v s="$s" '$1 == s { line = "- " $1 ": " $2 " (" $3 " s)" } END { if (line) print line }' \
            "$LOGS/steps.tsv"
    done
}

# The first file matching $1 (a glob) in the library directories, in search order.
find_lib() {
    local d f
    for d in "${LIB_DIRS[@]}"; do
        for f in "$d"/$1; do
            [ -e "$f" ] && { echo "$f"; return 0; }
        done
    done
    return 1
}

# Library directories: the loader's cache and path, the CUDA toolkits, and the `nvidia`
# packages of the python3 found here (two levels: nvidia/X/lib and nvidia/cuNN/lib).
library_dirs() {
    LIB_DIRS=()
    local d p
    IFS=: read -ra p <<<"${LD_LIBRARY_PATH:-}"
    for d in "${p[@]}"; do [ -d "$d" ] && LIB_DIRS+=("$d"); done
    while read -r d; do LIB_DIRS+=("$d"); done < <(ldconfig -p 2>/dev/null | awk -F'=> ' '/=>/ {print $2}' |
        xargs -r -n1 dirname 2>/dev/null | sort -u)
    for d in /usr/local/cuda*/lib64 /usr/local/cuda*/targets/x86_64-linux/lib; do
        [ -d "$d" ] && LIB_DIRS+=("$d")
    done
    while read -r d; do
        for p in "$d"/*/lib "$d"/*/*/lib; do [ -d "$p" ] && LIB_DIRS+=("$p"); done
    done < <(python3 -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null)
}

# Link the library matching $2 as $1 (the name cudarc opens) and put its directory on the path.
use_lib() {
    local f
    if f=$(find_lib "$2"); then
        ln -sf "$f" "$LIBS/$1"
        LD_LIBRARY_PATH="$LIBS:$(dirname "$f"):$LD_LIBRARY_PATH"
        echo "$1 -> $(readlink -f "$f")"
    else
        echo "$1: not found (searched ${#LIB_DIRS[@]} directories)"
        return 1
    fi
}

# Pipes end in `grep -c` (which reads everything), not `grep -q`: under pipefail, a writer
# cut off by grep's early exit (SIGPIPE) would fail the pipe.
have_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU ' >/dev/null; }

# Seconds each step may take (540 in all, so a whole run fits 9 minutes).
budget() {
    case $1 in
    env) echo 20 ;; golden) echo 30 ;; tests) echo 30 ;; speed) echo 150 ;; ring) echo 35 ;; python) echo 60 ;;
    candle) echo 30 ;; sanitizer) echo 170 ;; nccl) echo 15 ;;
    esac
}

# No command starts later than this many seconds into the run (the tool's limit is 580).
RUN_SECONDS=540

# Run "$@" for at most $1 seconds, what is left of the step's budget and what is left of
# the run, appending its output to the step log and how it ended; 124 = timed out.
logged() {
    local t=$1 left=$((STEP_END - $(date +%s))) run_left=$((RUN_END - $(date +%s))) rc
    shift
    [ "$left" -lt "$t" ] && t=$left
    [ "$run_left" -lt "$t" ] && t=$run_left
    echo "\$ $* (timeout ${t} s)" >>"$LOG"
    if [ "$t" -le 0 ]; then
        echo "the step's budget is spent" >>"$LOG"
        return 124
    fi
    timeout -k 5 "$t" "$@" >>"$LOG" 2>&1
    rc=$?
    case $rc in
    0) ;;
    124 | 137) echo "TIMED OUT after ${t} s" >>"$LOG" ;;
    *) echo "exit $rc" >>"$LOG" ;;
    esac
    return "$rc"
}

step_env() {
    local ok=0
    if have_gpu; then
        nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv >>"$LOG" 2>&1 || ok=1
    else
        echo "no GPU (nvidia-smi absent or lists none)" >>"$LOG"
    fi
    cat "$LIBS/found" >>"$LOG"
    [ "$LIB_MISSING" -eq 1 ] && have_gpu && ok=1
    echo "python3: $(command -v python3) $(python3 -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)" >>"$LOG"
    # Whether the pack's Python package loads there and can reach the kernels (the python
    # step judges it; this line is for the log).
    echo "python3: attn_dilated $(PYTHONPATH="$PACK/python" python3 -c 'import attn_dilated as a; print("loads; cuda_unavailable_reason:", a.cuda_unavailable_reason())' 2>&1 | tail -1)" >>"$LOG"
    # The NVRTC the package finds by itself, without the links above on LD_LIBRARY_PATH.
    echo "python3: nvrtc without LD_LIBRARY_PATH: $(env -u LD_LIBRARY_PATH PYTHONPATH="$PACK/python" python3 -c 'import attn_dilated as a; print(a.nvrtc_library())' 2>&1 | tail -1)" >>"$LOG"
    # The pack's binaries run here (a broken pack fails this step, GPU or not).
    logged 30 "$PACK/bin/attn-golden" "$PACK/conformance/dilated" --backend cpu --expect 9 || ok=1
    logged 30 "$PACK/bin/cuda_unavailable" --test-threads=1 || ok=1
    have_gpu || { [ "$ok" -eq 0 ] && return 3; }
    return "$ok"
}

step_golden() {
    have_gpu || return 2
    local dir dt ok=0
    for dir in dilated:9 features:9 wide:5; do
        for dt in f32 bf16 f16; do
            logged 40 "$PACK/bin/attn-golden" "$PACK/conformance/${dir%:*}" --backend cuda --dtype "$dt" \
                --expect "${dir#*:}" || ok=1
        done
    done
    # The multihead layer (f32) on the CUDA backend, with its gradients in multihead_grad.
    logged 20 "$PACK/bin/attn-golden" "$PACK/conformance/multihead" --backend cuda --expect 2 || ok=1
    logged 20 "$PACK/bin/attn-golden" "$PACK/conformance/multihead_features" --backend cuda --expect 1 || ok=1
    logged 20 "$PACK/bin/attn-golden" "$PACK/conformance/multihead_grad" --backend cuda --expect 3 || ok=1
    # The sm_90a forward and backward (TMA, wgmma) where they take a launch: asked for, not yet the default.
    if nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.0'; then
        for dir in dilated:9 features:9 wide:5; do
            for dt in bf16 f16; do
                ATTN_CUDA_FWD_MMA=wgmma ATTN_CUDA_BWD_MMA=wgmma logged 40 "$PACK/bin/attn-golden" "$PACK/conformance/${dir%:*}" \
                    --backend cuda --dtype "$dt" --expect "${dir#*:}" || ok=1
            done
        done
    fi
    return "$ok"
}

step_tests() {
    have_gpu || return 2
    # cuda_golden repeats the golden step's files; it runs where the budget is left.
    # cuda_nvrtc runs its two tests that compile little: CI compiles every module with the
    # same NVRTC.
    local t ok=0 filter
    for t in cuda_foreign cuda_proptest attn_kernels cuda_nvrtc cuda_golden; do
        read -ra filter <<<"$(test_filters "$t")"
        PROPTEST_CASES=16 logged 60 "$PACK/bin/$t" --test-threads=1 "${filter[@]}" || ok=1
    done
    return "$ok"
}

step_speed() {
    have_gpu || return 2
    # The bench shapes (bf16, heads 16, head_dim 128, segments 2048..32768, rates 1..16) at
    # seq 65536 and 262144, most telling first (each command is cut at the step's budget).
    local ok=0 bench="$PACK/bin/attn-cuda-bench" seqs=(--seq 65536,262144 --dtype bf16)
    local shape=(--heads 16 --head-dim 128 --segments 2048,4096,8192,16384,32768 --dilations 1,2,4,8,16)
    local new=(--rows 128w4 --bwd-loads pipelined --bwd-keys 128) old=(--rows 64 --bwd-loads sync --bwd-keys 64)
    # The mma.sync kernels unless a command asks for the sm_90a forward (--fwd-mma wgmma).
    local -x ATTN_CUDA_FWD_MMA=mma-sync
    # The Rust bench (CUDA events, the lean call path): the sm_90 defaults, the forward with
    # two and three K/V stages, forward+backward with dq by atomics and deterministically, the
    # persistent forward and the 64-row backward, with the gradients written directly (dk and dv; dq too under the deterministic dq);
    # then a synchronisation after each call, as a training step ends; then the previous
    # defaults.
    logged 20 "$bench" "${seqs[@]}" "${new[@]}" --fwd-stages 2,3 || ok=1
    logged 25 "$bench" "${seqs[@]}" --backward "${new[@]}" --bwd-dq atomic,deterministic || ok=1
    # The sm_90a forward (TMA, wgmma) on its own, then with the sm_90a backward.
    logged 15 "$bench" "${seqs[@]}" "${new[@]}" --fwd-mma wgmma || ok=1
    logged 20 env ATTN_CUDA_BWD_MMA=wgmma "$bench" "${seqs[@]}" --backward "${new[@]}" --fwd-mma wgmma || ok=1
    # The variants not yet timed: the fused and the persistent launch (64-row blocks), and
    # the backward's 64-row query tiles (dq by atomics and deterministically).
    logged 15 "$bench" "${seqs[@]}" --rows 64 --launch fused,persistent || ok=1
    logged 25 "$bench" "${seqs[@]}" --backward "${new[@]}" --bwd-queries 64 --bwd-dq atomic,deterministic || ok=1
    logged 20 "$bench" "${seqs[@]}" --backward "${new[@]}" --bwd-dq atomic,deterministic --bwd-writes direct || ok=1
    logged 15 "$bench" "${seqs[@]}" --backward "${new[@]}" --sync-between || ok=1
    logged 15 "$bench" "${seqs[@]}" "${old[@]}" || ok=1
    logged 15 "$bench" "${seqs[@]}" --backward "${old[@]}" || ok=1
    logged 15 python3 "$PACK/torch/gpu_matmul.py" --dtype bf16 || ok=1
    # One Python process, one timing method: the package, the SDPA composition with the
    # FlashAttention and the cuDNN backends, SDPA alone on pre-gathered segments.
    PYTHONPATH="$PACK/python" logged 45 python3 -m attn_dilated.bench --device cuda --dtype bfloat16 \
        --seqs 65536,262144 "${shape[@]}" --reps 5 --sdpa flash,cudnn --gathered --json "$LOGS/speed-python.json" ||
        ok=1
    # The PyTorch peer (dilated-attention-pytorch's code) at 65536.
    logged 20 python3 "$PACK/torch/torch_dilated.py" --device cuda --dtype bf16 --seq-len 65536 "${shape[@]}" || ok=1
    logged 20 python3 "$PACK/torch/torch_dilated.py" --device cuda --dtype bf16 --seq-len 65536 --backward "${shape[@]}" ||
        ok=1
    # Nsight Compute on one forward and one backward kernel where the sandbox grants the
    # counters (for the log; not judged).
    if command -v ncu >/dev/null; then
        logged 20 ncu --launch-count 1 --kernel-name regex:dilated_fwd_mma --section SpeedOfLight "$bench" \
            --seq 65536 --warmups 0 --iters 1 || true
        logged 20 ncu --launch-count 1 --kernel-name regex:dilated_bwd_mma --section SpeedOfLight "$bench" \
            --seq 65536 --warmups 0 --iters 1 --backward || true
    fi
    python3 "$PACK/torch/device_bench_summary.py" "$LOG" >"$LOGS/bench-summary.md" 2>>"$LOG" || ok=1
    python3 "$PACK/torch/speed_json.py" "$LOG" "$LOGS/speed-python.json" "$(cat "$PACK/COMMIT" 2>/dev/null)" \
        "$DEVICE" "$LOGS/speed.json" 2>>"$LOG" || ok=1
    return "$ok"
}

step_ring() {
    have_gpu || return 2
    # The chunk ring with CUDA block compute: ranks as threads sharing the GPU, every golden
    # file (under Auto, and under Ulysses and the hybrid with head windows) and gradients
    # into the LSE; then per-rank memory and time at seq 262144 for P = 1,
    # 2, 4, 8 (k/v in 8 rounds).
    local ok=0
    logged 35 "$PACK/bin/cuda_chunk_ring" --test-threads=1 || ok=1
    logged 25 "$PACK/bin/cuda_ring_bench" --seq 262144 --worlds 1,2,4,8 --iters 3 --rounds 8 || ok=1
    return "$ok"
}

# The python step's test files for CUDA tensors across ranks (`rehearse` checks the pack
# holds each with tests in it).
PYTHON_GPU_TESTS=(tests/test_distributed_cuda.py)

step_python() {
    have_gpu || return 2
    # The package's CUDA tests with the python3 that holds PyTorch (ATTN_REQUIRE_GPU=1: none
    # may skip; the CPU tests run in CI); the speed step times the package.
    local ok=0
    cd "$PACK/python" || return 1
    # Unbuffered, so a killed run's log shows the test it was in; -rs lists what skipped.
    local per_test=()
    python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=30)
    PYTHONUNBUFFERED=1 PYTHONPATH="$PACK/python" logged 35 python3 -m pytest -q -rs -p no:cacheprovider \
        "${per_test[@]}" tests/test_cuda.py tests/test_nvrtc.py || ok=1
    # CUDA tensors across ranks: one NCCL rank in the test process, then under torchrun.
    python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=60)
    PYTHONUNBUFFERED=1 PYTHONPATH="$PACK/python" logged 25 python3 -m pytest -q -rs -p no:cacheprovider \
        "${per_test[@]}" "${PYTHON_GPU_TESTS[@]}" || ok=1
    cd - >/dev/null || return 1
    return "$ok"
}

step_candle() {
    have_gpu || return 2
    # attn-candle's tests on candle CUDA tensors (ATTN_REQUIRE_GPU=1: none may skip). The
    # binary links libcuda, libcublas 13, libcurand 10 and libcudart 13: PyTorch's wheels
    # hold the last three.
    local exe="$LIBS/candle_cuda" path="$LD_LIBRARY_PATH" lib f
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$PACK/candle/candle_cuda.xz" "$exe" >>"$LOG" 2>&1 || return 1
    chmod +x "$exe"
    for lib in libcublas.so.13 libcurand.so.10 libcudart.so.13; do
        f=$(find_lib "$lib") || { echo "$lib: not found (searched ${#LIB_DIRS[@]} directories)" >>"$LOG"; return 1; }
        echo "$lib -> $f" >>"$LOG"
        path="$(dirname "$f"):$path"
    done
    LD_LIBRARY_PATH="$path" logged 45 "$exe" cuda:: --test-threads=1
}

step_sanitizer() {
    have_gpu || return 2
    command -v compute-sanitizer >/dev/null || return 4
    # One head a pattern and no warm-up call keep the checked kernels (racecheck slows them
    # about a thousandfold) inside the budget; each racecheck run is one variant with its own
    # timeout, so a slow one cannot hide the others.
    local ok=0 bwd loads keys dq small=(--seq 4096 --heads 5 --dtype bf16 --warmups 0 --iters 1)
    logged 40 compute-sanitizer --tool memcheck --error-exitcode 9 "$PACK/bin/attn-cuda-bench" "${small[@]}" \
        --backward --rows 64,128w4 --launch per-pattern,fused --fwd-stages 2,3 --bwd-loads sync,pipelined --bwd-keys 64,128 \
        --bwd-dq atomic,deterministic || ok=1
    # Shared-memory races of every forward block shape (64 rows over 4 warps, 128 over 8, 128
    # over 4), then of the backward: sm_90's default (pipelined loads, 128 keys) with dq by
    # atomics and deterministically, and the other architectures' (sync, 64 keys). Under
    # racecheck one forward and backward takes about 20 s with 64 keys a block and 30 s with
    # 128 (H200).
    logged 40 compute-sanitizer --tool racecheck --error-exitcode 9 "$PACK/bin/attn-cuda-bench" "${small[@]}" \
        --rows 64,128,128w4 || ok=1
    logged 40 compute-sanitizer --tool racecheck --error-exitcode 9 "$PACK/bin/attn-cuda-bench" "${small[@]}" \
        --rows 64,128,128w4 --fwd-stages 3 || ok=1
    for bwd in "pipelined 128 atomic" "pipelined 128 deterministic" "sync 64 atomic"; do
        read -r loads keys dq <<<"$bwd"
        logged $((keys == 64 ? 30 : 45)) compute-sanitizer --tool racecheck --error-exitcode 9 "$PACK/bin/attn-cuda-bench" "${small[@]}" \
            --backward --bwd-loads "$loads" --bwd-keys "$keys" --bwd-dq "$dq" || ok=1
    done
    # Unsupported only where no tool ran at all (each run that ran prints its summary).
    grep -q 'ERROR SUMMARY' "$LOG" || { grep -qE 'Device not supported|not supported on this' "$LOG" && return 4; }
    return "$ok"
}

step_nccl() {
    have_gpu || return 2
    logged 60 "$PACK/bin/attn_ring" "$(test_filters attn_ring)" --test-threads=1
}

run_step() {
    local s=$1 t0 rc why
    LOG="$LOGS/$s.log"
    # A rerun (`run --only`) keeps the earlier run's log beside its own.
    [ -s "$LOG" ] && mv "$LOG" "$LOGS/$s.earlier.log"
    : >"$LOG"
    t0=$(date +%s)
    STEP_END=$((t0 + $(budget "$s")))
    "step_$s"
    rc=$?
    # A test filter that matched nothing proves nothing.
    [ "$rc" -eq 0 ] && grep -q '^running 0 tests' "$LOG" && {
        echo "a test filter matched no test" >>"$LOG"
        rc=1
    }
    local secs=$(($(date +%s) - t0))
    case $rc in
    0) record "$s" passed "$secs" ;;
    2) record "$s" "not run (no GPU)" "$secs" ;;
    3) record "$s" "passed (no GPU: the pack's binaries and library search only)" "$secs" ;;
    4) record "$s" "not run (unsupported runtime)" "$secs" ;;
    124) record "$s" "FAILED (timed out)" "$secs" ;;
    *)
        why=$(grep -aE 'panicked|FAILED|[Ee]rror|No such file|not found|budget is spent|TIMED OUT|matched no test|^exit [0-9]' "$LOG" |
            grep -avE ' 0 failed|^python3:|^\$ | ok$' | head -1 | cut -c1-160)
        record "$s" "FAILED (${why:-rc $rc})" "$secs"
        ;;
    esac
}

# The pack's tarballs (bin/, kernel-cache/) unpacked beside them, once.
unpack_payload() {
    python3 - "$PACK" <<'PY'
import pathlib, sys, tarfile
root = pathlib.Path(sys.argv[1])
for tarball in sorted(root.glob("*.tar.xz")):
    name = tarball.name[: -len(".tar.xz")]
    if not (root / name).is_dir():
        with tarfile.open(tarball) as tar:
            try:
                tar.extractall(root, filter="data")
            except TypeError:  # Python before 3.11.4 has no extraction filters
                tar.extractall(root)
PY
}

run() {
    local only="" s
    [ "${1:-}" = "--only" ] && only=${2:-}
    for s in ${only//,/ }; do
        [[ " $STEPS " == *" $s "* ]] || {
            echo "unknown step '$s' (one of: $STEPS)" >&2
            return 2
        }
    done
    PACK=$(cd "$(dirname "$0")" && pwd)
    unpack_payload || return 1
    : "${OUT:=/tmp/device-out}"
    LIBS=$(mktemp -d /tmp/attn-libs.XXXX)
    LOGS=$(mktemp -d /tmp/attn-logs.XXXX)
    # The links and logs live as long as the steps: removed when the run ends.
    trap 'rm -rf "$LIBS" "$LOGS"' EXIT
    mkdir -p "$OUT"
    # `run --only STEP` after a run adds to that run's report and logs.
    [ -n "$only" ] && [ -f "$OUT/logs.tgz" ] && tar xzf "$OUT/logs.tgz" -C "$LOGS"
    touch "$LOGS/steps.tsv"
    DEVICE=$( (have_gpu && nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader) || echo none)
    # The kernel cache the pack carries, in a private directory of this run.
    export ATTN_CUDA_CACHE_DIR="$LIBS/kernel-cache"
    mkdir -m 700 "$ATTN_CUDA_CACHE_DIR"
    [ -d "$PACK/kernel-cache" ] && cp "$PACK"/kernel-cache/* "$ATTN_CUDA_CACHE_DIR/" 2>/dev/null
    # Modules newer than this stamp were compiled during the run (a packed key did not match).
    touch "$LIBS/cache-stamp"
    # ATTN_REQUIRE_GPU: the GPUs nvidia-smi lists (1 or more: no GPU test may skip; 2 or more:
    # neither may a Python test of two GPUs), 0 without one.
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" ATTN_GOLDEN_DIR="$PACK/conformance" ATTN_REQUIRE_GPU=0
    have_gpu && ATTN_REQUIRE_GPU=$(nvidia-smi -L | grep -c '^GPU ')
    library_dirs
    # The libraries cudarc opens, found once per run (the env step reports them).
    LIB_MISSING=0
    {
        use_lib libnvrtc.so 'libnvrtc.so.1[0-9]*' || LIB_MISSING=1
        use_lib libnccl.so 'libnccl.so.2*' || LIB_MISSING=1
        use_lib libcudnn.so 'libcudnn.so.[0-9]*' || true
    } >"$LIBS/found" 2>&1
    export LD_LIBRARY_PATH
    STARTED=$(date +%s)
    RUN_END=$((STARTED + RUN_SECONDS))
    for s in $STEPS; do
        [ -z "$only" ] || [[ ",$only," == *",$s,"* ]] || continue
        run_step "$s"
        write_report
    done
    cat "$OUT/device-report.md"
    report_lines | grep -c ': FAILED' >/dev/null && return 1
    if ! have_gpu; then
        echo "device-check: FAILED: no GPU visible (nvidia-smi absent or lists none): the GPU steps did not run" >&2
        return 3
    fi
    return 0
}

# The report as far as the run has got, and every log so far in $OUT/logs.tgz.
write_report() {
    local total=$(($(date +%s) - STARTED))
    [ -f "$LOGS/bench-summary.md" ] && cp "$LOGS/bench-summary.md" "$OUT/bench-summary.md"
    [ -f "$LOGS/speed.json" ] && cp "$LOGS/speed.json" "$OUT/speed.json"
    {
        echo "# Device check, $(date -u +%Y-%m-%d) (commit $(cat "$PACK/COMMIT" 2>/dev/null))"
        echo
        echo "Device: $DEVICE"
        echo
        report_lines
        echo
        echo "Total: ${total} s."
        # More modules than packed: a step compiled one (the packed key did not match).
        echo "Kernel cache: $(ls "$PACK/kernel-cache" 2>/dev/null | wc -l) modules packed;" \
            "$(find "$ATTN_CUDA_CACHE_DIR" -name '*.kernels' -newer "$LIBS/cache-stamp" | wc -l) compiled here (0 expected)."
        if [ -s "$LOGS/bench-summary.md" ]; then
            echo
            cat "$LOGS/bench-summary.md"
        fi
        # The python step's bench table (the package against the torch composition).
        if grep -q '^attn_dilated bench:' "$LOGS/python.log" 2>/dev/null; then
            printf '\n## Python package\n\n```\n'
            sed -n '/^attn_dilated bench:/,/speed-up/p' "$LOGS/python.log"
            printf '```\n'
        fi
    } >"$OUT/device-report.md.part" && mv "$OUT/device-report.md.part" "$OUT/device-report.md"
    python3 - "$LOGS/steps.tsv" "$(cat "$PACK/COMMIT" 2>/dev/null)" "$total" >"$OUT/device-report.json.part" <<'PY' &&
import json, sys
steps = {}
for line in open(sys.argv[1], encoding="utf-8", errors="replace", newline=""):
    name, result, seconds = line.rstrip("\n").split("\t")
    steps[name] = {"result": result, "seconds": int(seconds), "log": name + ".log"}
print(json.dumps({"commit": sys.argv[2], "seconds": int(sys.argv[3]), "steps": steps}))
PY
        mv "$OUT/device-report.json.part" "$OUT/device-report.json"
    # The logs with the rows and bench summary a later `run --only` adds to.
    tar czf "$OUT/logs.tgz.part" -C "$LOGS" . && mv "$OUT/logs.tgz.part" "$OUT/logs.tgz"
}

# `pack` and `rehearse` run here, beside the repository (device-pack.sh); the pack carries
# this file alone.
case "${1:-}" in
pack)
    source "$(dirname "$0")/device-pack.sh"
    pack
    ;;
run)
    shift
    run "$@"
    ;;
rehearse)
    source "$(dirname "$0")/device-pack.sh"
    rehearse
    ;;
*)
    echo "usage: $0 pack|rehearse|run [--only STEP[,STEP...]]   (steps: $STEPS)" >&2
    exit 2
    ;;
esac
