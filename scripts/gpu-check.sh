#!/usr/bin/env bash
# The checks that need a GPU, one JSON line each, on whatever NVIDIA GPUs the machine has.
#
#   scripts/gpu-check.sh            build (CUDA on), then run the checks: a GPU machine with
#                                   Rust and the network
#   scripts/gpu-check.sh build      only build, into .gpu-check/ (release, stripped, xz: about
#                                   28 MB): on any machine with the network, no GPU needed
#   scripts/gpu-check.sh run        only run what .gpu-check/ holds: a GPU machine without
#                                   Rust or the network (carry .gpu-check/ there)
#
# The checks, in order, each a line {"check": ..., "ok": ...}:
#   gpu            the GPUs nvidia-smi lists (none: the script fails here, loudly)
#   gpu_tests      tests/tests/gpu.rs with RPC_EXPECT_GPU=1 (a missing GPU fails them): a
#                  tensor over the wire to the mapped device, remote modules on cuda:0 trained
#                  by distributed autograd and the distributed optimizer, equal to one process
#                  on the CPU (the grad-check on CUDA), NCCL's collectives against the ring
#   equivalence    hybrid-rnn --check-equivalence with NetShard2 on cuda:0,cuda:0 (one GPU)
#                  or cuda:0,cuda:1 (two or more)
#   training       a short hybrid-rnn run (the default model) with both shards on GPUs: ms
#                  per step, accuracy, hash
#   training_cpu   the same run on the machine's CPU, the baseline for the line above
#   nccl_bandwidth rpc-bench nccl: NCCL's all-reduce against the ring, bus GB/s (two GPUs
#                  or more; with one the line says it was skipped and why)
# Bounded: every check runs under `timeout`; the whole run is a few minutes.
#
# The run needs the CUDA libraries the build linked (libcublas.so.13, libcurand.so.10,
# libcudart.so.13, libnccl.so.2): from CUDA_ROOT, from the NVIDIA wheels of the machine's
# python3 (PyTorch's), or from scripts/cuda-toolkit.sh's install.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
dir=.gpu-check
bins=(hybrid-rnn rpc-bench gpu-tests)
fail=0

emit() { echo "$1"; }

build() {
    set -e
    eval "$(scripts/cuda-toolkit.sh)"
    export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
    # One cargo invocation, so that the three share one build of every dependency; the test
    # binary's name carries a hash: cargo's JSON messages give it.
    local t
    t=$(cargo build --release -p examples -p rpc-bench -p integration-tests \
        --features examples/cuda,rpc-bench/cuda,integration-tests/cuda \
        --bin hybrid-rnn --bin rpc-bench --test gpu --message-format=json |
        grep '"name":"gpu"' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
    local out=${CARGO_TARGET_DIR:-target}/release
    rm -rf "$dir" && mkdir -p "$dir"
    cp "$out/hybrid-rnn" "$out/rpc-bench" "$dir/"
    cp "$t" "$dir/gpu-tests"
    # Each binary holds candle's kernels (about 60 MB stripped); xz makes the three fit the
    # 64 MiB a device call carries. `run` unpacks them (xz, or python3's lzma).
    strip "${bins[@]/#/$dir/}"
    xz -9 -T0 "${bins[@]/#/$dir/}"
    du -sh "$dir" >&2
    set +e
}

unpack() {
    local b
    for b in "${bins[@]}"; do
        [ -x "$dir/$b" ] && continue
        if command -v xz >/dev/null; then
            xz -dkf "$dir/$b.xz"
        else
            python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$dir/$b.xz" "$dir/$b"
        fi
        chmod +x "$dir/$b"
    done
}

libraries() {
    if [ -n "${CUDA_ROOT:-}" ]; then
        export LD_LIBRARY_PATH="$CUDA_ROOT/lib:$CUDA_ROOT/lib64:${LD_LIBRARY_PATH:-}"
    fi
    local d site
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64; do
        [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
    done
    site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
    for s in $site ${RPC_CUDA_TOOLKIT:-$HOME/.cache/rpc-cuda-13.0.2}; do
        for d in "$s"/nvidia/cu13/lib "$s"/nvidia/*/lib; do
            [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
        done
    done
    export LD_LIBRARY_PATH
    local missing
    missing=$(ldd "$dir/hybrid-rnn" | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
    if [ -n "$missing" ]; then
        emit "{\"check\":\"libraries\",\"ok\":false,\"missing\":\"$missing\"}"
        exit 1
    fi
}

check_gpus() {
    local names
    names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
    gpus=$(printf '%s' "$names" | grep -c . || true)
    if [ "$gpus" -lt 1 ]; then
        emit "{\"check\":\"gpu\",\"ok\":false,\"error\":\"no GPU: nvidia-smi lists none (is the \
driver installed?)\"}"
        echo "gpu-check: a GPU was expected and none was found" >&2
        exit 1
    fi
    card=$(printf '%s' "$names" | head -1)
    emit "{\"check\":\"gpu\",\"ok\":true,\"gpus\":$gpus,\"card\":\"$card\",\"driver\":\"$driver\"}"
}

# The last line of a command's stdout that is JSON, or {}.
last_json() { grep '^{' "$1" | tail -1 || echo '{}'; }

run_checks() {
    export RPC_EXPECT_GPU=1 WORDLANG_DIR="$PWD/data/wordlang"
    local out=$dir/out
    rm -rf "$out" && mkdir -p "$out"
    # GPU tests, one at a time (they share the GPUs).
    # --nocapture: a test that skips says so on stderr, and the line counts it apart.
    timeout 150 "$dir/gpu-tests" --test-threads 1 --nocapture >"$out/gpu-tests.log" 2>&1
    local code=$? passed skipped
    passed=$(sed -n 's/^test result: .* \([0-9]*\) passed;.*/\1/p' "$out/gpu-tests.log")
    skipped=$(grep -o 'GPU test [a-z_0-9]* skipped' "$out/gpu-tests.log" | cut -d' ' -f3 |
        paste -sd, -)
    if [ $code = 0 ]; then ok=true; else ok=false; fail=1; fi
    emit "{\"check\":\"gpu_tests\",\"ok\":$ok,\"passed\":${passed:-0},\"skipped\":\"$skipped\",\
\"exit\":$code}"
    [ $code = 0 ] || tail -30 "$out/gpu-tests.log" >&2
    local devices=cuda:0,cuda:0
    [ "$gpus" -ge 2 ] && devices=cuda:0,cuda:1
    # No restart: a check passes on its first run or fails.
    local small=(--embedding 16 --hidden 32 --head-hidden 32 --data-dir "$WORDLANG_DIR"
        --shard1-device cuda:0 --shard2-devices "$devices" --quiet --max-restarts 0)
    timeout 90 "$dir/hybrid-rnn" "${small[@]}" --check-equivalence --fresh \
        --out-dir "$out/equivalence" >"$out/equivalence.log" 2>&1
    code=$?
    if [ $code = 0 ]; then ok=true; else ok=false; fail=1; fi
    emit "{\"check\":\"equivalence\",\"ok\":$ok,\"devices\":\"$devices\",\"result\":\
$(last_json "$out/equivalence.log")}"
    # A short run at the example's default size, on the GPUs and then, as the baseline of
    # the same machine, on its CPU.
    local train=(--epochs 1 --train-limit 4096 --test-limit 512 --data-dir "$WORDLANG_DIR"
        --quiet --fresh --max-restarts 0)
    timeout 90 "$dir/hybrid-rnn" "${train[@]}" --shard1-device cuda:0 \
        --shard2-devices "$devices" --out-dir "$out/training" >"$out/training.log" 2>&1
    code=$?
    if [ $code = 0 ]; then ok=true; else ok=false; fail=1; fi
    emit "{\"check\":\"training\",\"ok\":$ok,\"devices\":\"$devices\",\"result\":\
$(last_json "$out/training.log")}"
    timeout 90 "$dir/hybrid-rnn" "${train[@]}" --shard1-device cpu --shard2-devices cpu,cpu \
        --out-dir "$out/training-cpu" >"$out/training-cpu.log" 2>&1
    code=$?
    if [ $code = 0 ]; then ok=true; else ok=false; fail=1; fi
    emit "{\"check\":\"training_cpu\",\"ok\":$ok,\"devices\":\"cpu,cpu\",\"result\":\
$(last_json "$out/training-cpu.log")}"
    if [ "$gpus" -ge 2 ]; then
        timeout 300 "$dir/rpc-bench" nccl >"$out/nccl.log" 2>&1
        code=$?
        if [ $code = 0 ]; then ok=true; else ok=false; fail=1; fi
        emit "{\"check\":\"nccl_bandwidth\",\"ok\":$ok,\"lines\":[$(grep '^{' "$out/nccl.log" |
            paste -sd, -)]}"
    else
        emit "{\"check\":\"nccl_bandwidth\",\"ok\":true,\"skipped\":\"NCCL needs one GPU per \
rank; this machine has 1\"}"
    fi
}

case "$mode" in
build) build ;;
run) check_gpus && unpack && libraries && run_checks ;;
all) check_gpus && build && unpack && libraries && run_checks ;;
*) echo "usage: scripts/gpu-check.sh [build|run]" >&2 && exit 2 ;;
esac
exit $fail
