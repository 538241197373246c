#!/usr/bin/env bash
# Our data-parallel step beside PyTorch's DDP on the same machine, alternated: the comparison
# that docs/data-parallelism.md reports (issue targets: `overlap` against `after` and `local`,
# and against PyTorch's `ddp`).
#
#   scripts/ddp-compare.sh [ROUNDS] [WORLD_SIZES] [STEPS]      defaults: 2 2,4 20
#
# Each round runs `rpc-bench ddp` and then the anchor `ddp_torch.py`; every JSON line is
# printed with its round (`"round":R`), then one summary line per round and world size:
# what `overlap` hid of what `after` pays over `local` and over `no_comm`, and our
# `overlap` over PyTorch's `ddp`.
#
# Environment: RPC_BENCH (default target/release/rpc-bench, built first if absent),
# RPC_BENCH_ARGS (more flags for `rpc-bench ddp`, as `--ring-threads 1`, or `--interleave 5`:
# the variants alternated in blocks of 5 steps within each group, `local` among them), PYTHON
# (default: the anchors' venv beside ANCHOR, else python3), ANCHOR (default
# ../shared/anchors/ddp/ddp_torch.py). Without PyTorch the PyTorch half is skipped, and says so.
# Bounded: each half runs under `timeout` (15 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
sizes=${2:-2,4}
steps=${3:-20}
bench=${RPC_BENCH:-target/release/rpc-bench}
anchor=${ANCHOR:-../shared/anchors/ddp/ddp_torch.py}
venv_python="$(dirname "$anchor")/../venv/bin/python"
python=${PYTHON:-$([ -x "$venv_python" ] && echo "$venv_python" || echo python3)}

if [ ! -x "$bench" ]; then
    cargo build --release -p rpc-bench >&2 || exit 1
fi
torch=1
if [ ! -f "$anchor" ] || ! "$python" -c 'import torch' 2>/dev/null; then
    echo "{\"skipped\":\"pytorch\",\"why\":\"no $anchor or no torch for $python\"}"
    torch=0
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
    # shellcheck disable=SC2086 # RPC_BENCH_ARGS is a list of flags
    timeout 900 "$bench" ddp --world-sizes "$sizes" --steps "$steps" ${RPC_BENCH_ARGS:-} \
        >"$out/ours.$r" ||
        echo "{\"round\":$r,\"failed\":\"rpc-bench ddp\",\"rc\":$?}"
    if [ "$torch" = 1 ]; then
        timeout 900 "$python" "$anchor" --world-sizes "$sizes" --steps "$steps" \
            >"$out/torch.$r" 2>/dev/null ||
            echo "{\"round\":$r,\"failed\":\"ddp_torch.py\",\"rc\":$?}"
    fi
done
python3 - "$out" "$rounds" <<'EOF'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for r in range(1, rounds + 1):
    lines = []
    for side in ("ours", "torch"):
        p = os.path.join(out, f"{side}.{r}")
        if os.path.exists(p):
            lines += [json.loads(l) for l in open(p) if l.startswith("{")]
    for o in lines:
        print(json.dumps({"round": r, **o}))
    step = {(o["impl"], o.get("variant"), o["world_size"]): o["median"]
            for o in lines if o.get("metric") == "ddp_step_ms"}
    # With --interleave, each group steps `local` among its variants (rank 0 alone): that
    # local step, not the one before the groups, is its baseline.
    beside = {o["group"]: o["median"] for o in lines
              if o.get("variant") == "local" and "group" in o}
    sizes = sorted({w for (i, v, w) in step if i == "ours" and w > 1})
    for w in sizes:
        local = beside.get(w, step.get(("ours", "local", 1)))
        after, ovl = step.get(("ours", "after", w)), step.get(("ours", "overlap", w))
        apart, ddp = step.get(("ours", "no_comm", w)), step.get(("torch", "ddp", w))
        s = {"round": r, "summary": "ddp", "world_size": w}
        if None not in (after, ovl, local) and after > local:
            s["hidden_of_after_over_local"] = round((after - ovl) / (after - local), 3)
        if None not in (after, ovl, apart) and after > apart:
            s["hidden_of_after_over_no_comm"] = round((after - ovl) / (after - apart), 3)
        if ddp and ovl:
            s["overlap_over_torch_ddp"] = round(ovl / ddp, 3)
        print(json.dumps(s))
EOF
