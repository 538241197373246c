#!/usr/bin/env bash
# Runs the fuzz targets: `bash fuzz/run.sh [RUNS] [TARGET...]` (default: 10 million runs of
# every target). Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Each target starts from fuzz/corpus/<target> (seeded by the target itself when empty,
# then grown by every run); findings land in fuzz/artifacts/<target>, each run's output
# (libFuzzer's final stats last) in fuzz/logs/<target>.log. Built without AddressSanitizer
# and with debug assertions (`-s none -a`: integer overflow panics; the code under test is
# safe Rust but for the shared-memory mapping, which the bulk target reaches): three to ten
# times the runs per second. FUZZ_FLAGS replaces those flags (empty: cargo-fuzz's default,
# AddressSanitizer).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10000000}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(request reply bulk handshake_server handshake_client sealed rendezvous tensor)
fi
flags="${FUZZ_FLAGS--s none -a} --features tensor"
# shellcheck disable=SC2086
cargo +nightly fuzz build $flags
mkdir -p fuzz/logs
for t in "${targets[@]}"; do
    echo "== $t: $runs runs"
    # -rss_limit_mb: a worker's promise is bounded memory; -timeout: no input may hang.
    # shellcheck disable=SC2086
    cargo +nightly fuzz run $flags "$t" "fuzz/corpus/$t" -- \
        -runs="$runs" -max_len=2048 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"fuzz/logs/$t.log" 2>&1 || { tail -40 "fuzz/logs/$t.log"; exit 1; }
    grep -E "^stat::number_of_executed_units|^stat::average_exec_per_sec|^stat::peak_rss_mb|Done [0-9]+ runs" "fuzz/logs/$t.log" || true
done
