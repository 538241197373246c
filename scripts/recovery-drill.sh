#!/usr/bin/env bash
# Recovery drill for the hybrid example: one run without failures, then the same run with
# failures injected at given steps (SIGKILL or SIGSTOP of a given rank), and a comparison of
# the two runs' final parameters (params_sha256) and of the time each recovery cost.
#
#   scripts/recovery-drill.sh [FAILURE...] [-- HYBRID_RNN_FLAGS...]
#
# A FAILURE is STEP:RANK:SIGNAL, e.g. 150:1:KILL 450:0:KILL 750:2:STOP (rank 0 is the master).
# Defaults: those three, and `--epochs 1 --checkpoint-every 200`. Output goes to
# target/recovery-drill/. Exits 0 when the parameters are bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
failures=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do failures+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
flags=("$@")
[ ${#failures[@]} -gt 0 ] || failures=(150:1:KILL 450:0:KILL 750:2:STOP)
[ ${#flags[@]} -gt 0 ] || flags=(--epochs 1 --checkpoint-every 200)
cargo build --release -q -p examples --bin hybrid-rnn
bin=target/release/hybrid-rnn
out=target/recovery-drill
rm -rf "$out" && mkdir -p "$out"

echo "uninterrupted run: ${flags[*]}"
"$bin" "${flags[@]}" --quiet --out-dir "$out/a" >"$out/a.out" 2>"$out/a.err"
tail -1 "$out/a.out"

echo "run with failures: ${failures[*]}"
"$bin" "${flags[@]}" --quiet --max-restarts ${#failures[@]} --out-dir "$out/b" \
    >"$out/b.out" 2>"$out/b.err" &
top=$!
trap 'kill -9 $top 2>/dev/null || true' EXIT
rank_pid() { # the pid of rank $1 among the launcher's children
    for c in $(cat "/proc/$top/task/$top/children" 2>/dev/null); do
        if tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "RANK=$1"; then echo "$c"; fi
    done
}
done_steps() { awk '{print $1}' "$out/b/progress" 2>/dev/null || echo 0; }
for f in "${failures[@]}"; do
    IFS=: read -r step rank sig <<<"$f"
    while [ "$(done_steps)" -lt "$step" ]; do
        kill -0 "$top" 2>/dev/null || { echo "the run ended early"; cat "$out/b.err"; exit 1; }
        sleep 0.005
    done
    pid=$(rank_pid "$rank")
    echo "  step $(done_steps): SIG$sig to rank $rank (pid $pid)"
    kill "-$sig" "$pid"
    # The next failure waits for this one's restart: the progress record only moves on once
    # the restarted run has replayed past this step.
    sleep 1
done
wait "$top" && rc=0 || rc=$?
trap - EXIT
tail -1 "$out/b.out"
echo "exit status $rc"
python3 - "$out/a.out" "$out/b.out" <<'PY'
import json, sys
a, b = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:3])
same = a["params_sha256"] == b["params_sha256"]
print(json.dumps({"bit_identical": same, "recoveries": b["recoveries"],
                  "time_lost_s": b["time_lost_s"], "replayed_steps": b["replayed_steps"],
                  "accuracy": [a["test_accuracy"], b["test_accuracy"]]}))
sys.exit(0 if same else 1)
PY
