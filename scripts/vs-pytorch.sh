#!/usr/bin/env bash
# The main job's training step beside PyTorch's, on the same thread budget (one thread per
# process), alternated ROUNDS times (default 3) in one run, on the reference model (one-direction
# LSTM 64 -> 128, batch 64, no dropout, Adam 1e-3):
#
#   ours     hybrid-rnn --unidirectional --dropout 0 --lr 1e-3 --epochs 1 --train-limit 16000
#            --local-steps 200: local_ms_per_step_median (one process) and ms_per_step_median
#            (master + 2 workers over TCP)
#   PyTorch  ../shared/anchors/hybrid_rnn/hybrid_rnn_torch.py --epochs 1 --mode local, then
#            --mode rpc --transport default (shared memory): the median step
#
# Prints one JSON line per measurement ({"round", "impl", "mode", "step_ms"}) and a summary
# line. Needs the anchors' venv (`bash ../shared/anchors/setup.sh`) and the Debian word lists
# PyTorch's script reads (`apt-get install wamerican wfrench wngerman wspanish witalian wdutch
# wpolish wswedish`); says so and exits 2 where they are missing.
#
# Usage: scripts/vs-pytorch.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
anchors=${ANCHORS:-../shared/anchors}
py="$anchors/venv/bin/python"
torch_script="$anchors/hybrid_rnn/hybrid_rnn_torch.py"
if [ ! -x "$py" ] || [ ! -f "$torch_script" ]; then
    echo "vs-pytorch: no PyTorch anchors at $anchors (run: bash $anchors/setup.sh)" >&2
    exit 2
fi
for lang in american-english french ngerman spanish italian dutch polish swedish; do
    if [ ! -f "/usr/share/dict/$lang" ]; then
        echo "vs-pytorch: /usr/share/dict/$lang is missing (apt-get install the w* word lists)" >&2
        exit 2
    fi
done
cargo build --release -q -p examples --bin hybrid-rnn
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for round in $(seq 1 "$rounds"); do
    target/release/hybrid-rnn --unidirectional --dropout 0 --lr 1e-3 --epochs 1 \
        --train-limit 16000 --local-steps 200 --out-dir "$out/ours-$round" >"$out/ours.txt" 2>"$out/ours.err"
    tail -1 "$out/ours.txt" | python3 -c '
import json, sys
v = json.loads(sys.stdin.read())
r = int(sys.argv[1])
print(json.dumps({"round": r, "impl": "ours", "mode": "local", "step_ms": v["local_ms_per_step_median"]}))
print(json.dumps({"round": r, "impl": "ours", "mode": "tcp", "step_ms": v["ms_per_step_median"]}))
' "$round"
    for mode in local rpc; do
        "$py" "$torch_script" --mode "$mode" --transport default --epochs 1 --no-wait \
            >"$out/torch.txt" 2>"$out/torch.err"
        python3 -c '
import json, sys
r, mode = int(sys.argv[1]), sys.argv[2]
for line in open(sys.argv[3]):
    try:
        v = json.loads(line)
    except ValueError:
        continue
    if v.get("metric") == "step_ms":
        print(json.dumps({"round": r, "impl": "pytorch", "mode": "local" if mode == "local" else "shm", "step_ms": v["median"]}))
' "$round" "$mode" "$out/torch.txt"
    done
done | tee "$out/all.jsonl"

python3 - "$out/all.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
get = lambda impl, mode: [r["step_ms"] for r in rows if r["impl"] == impl and r["mode"] == mode]
ours_local, ours_tcp = get("ours", "local"), get("ours", "tcp")
torch_local, torch_shm = get("pytorch", "local"), get("pytorch", "shm")
print(json.dumps({
    "summary": True,
    "ours_local_ms": ours_local, "pytorch_local_ms": torch_local,
    "ours_tcp_ms": ours_tcp, "pytorch_shm_ms": torch_shm,
    "local_ratio_max": round(max(o / t for o, t in zip(ours_local, torch_local)), 3),
    "tcp_vs_shm_ratio_max": round(max(o / t for o, t in zip(ours_tcp, torch_shm)), 3),
}))
EOF
