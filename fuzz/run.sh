#!/usr/bin/env bash
# Runs the fuzz targets: `bash fuzz/run.sh [RUNS] [TARGET...]` (default: 10 million runs of
# every target). Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Each target starts from the seeds the `seeds` binary writes into fuzz/corpus/<target>
# (plus whatever earlier runs left there); findings land in fuzz/artifacts/<target>, the
# last lines of each run (libFuzzer's final stats) in fuzz/logs/<target>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10000000}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(request reply bulk handshake_server handshake_client sealed rendezvous tensor)
fi
cargo +nightly fuzz build
fuzz/target/x86_64-unknown-linux-gnu/release/seeds fuzz/corpus
mkdir -p fuzz/logs
for t in "${targets[@]}"; do
    echo "== $t: $runs runs"
    # -rss_limit_mb: a worker's promise is bounded memory; -timeout: no input may hang.
    cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- \
        -runs="$runs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"fuzz/logs/$t.log" 2>&1 || { tail -40 "fuzz/logs/$t.log"; exit 1; }
    grep -E "^stat::number_of_executed_units|^stat::average_exec_per_sec|^stat::peak_rss_mb|Done [0-9]+ runs" "fuzz/logs/$t.log" || true
done
