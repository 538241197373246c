#!/usr/bin/env bash
# The hybrid example on three emulated hosts: three network namespaces (each process also in a
# PID namespace of its own, so no shared-memory shortcut finds its peers), joined by veth
# pairs to a bridge in a fourth, with `tc netem` 2 ms delay and 0.1 % loss on every link
# where the kernel has netem. One `rpcrun --nnodes 3` per "host" starts one process there.
# Mid-run, a fault (FAULT): `cut`, host 2's link cut both ways for CUT_SECS seconds and then
# restored; `freeze`, host 1's only process stopped with SIGSTOP (its launcher must end it:
# SUP-1). The group must notice, recover (RESTART: `group`, every process restarted and the
# run resumed from its checkpoint; `worker`, only the failed one, the master replaying from
# the checkpoint in its own process) and finish with the same parameters as a run on
# loopback, every launcher exiting 0. `rdvkill` and `rdvfreeze`: host 0, where the rendezvous
# lives (in its launcher) beside the master, killed (SIGKILL, every process) or frozen
# (SIGSTOP, every process). The group cannot go on without them: the launchers of hosts 1 and
# 2 must each end with an error naming the rendezvous within RDV_BOUND seconds (default 120),
# leaving no process behind; they wait RDZV_TIMEOUT seconds (rpcrun's --rdzv-timeout, default
# 60) for it to answer again.
#
# Every host traces its processes to a directory of its own (`--trace`); the scenarios that
# finish must leave parts of one job only (TR-7), from every rank, and host 0's merged trace
# must hold every rank of the last start (TR-8: parts sent to rank 0 at shutdown), and every
# part the other hosts wrote must be in host 0's directory too (TR-9: their launchers send
# them however their workers ended).
#
# `pair`: the link between hosts 1 and 2 alone cut both ways for CUT_SECS (each still reaches
# host 0): each of the two healthy workers takes the other for failed, but neither report is
# confirmed (RDV-4), so neither is evicted; the run must end bit-identical, every launcher 0.
# `impostor`: a process on host 2 with the group's secret but no token claims rank 1, which
# is alive on host 1 (RDV-5): it must be refused, naming why, and the run go on untouched.
#
# RDZV=etcd: the launchers meet in etcd (`--rdzv etcd://...`, rpcrun built with its `etcd`
# feature), which runs on the hub, and a fourth host's launcher waits as a spare. Node 0 of
# the running round (rank 0, the master, the group's rendezvous) is wherever the launchers'
# order put it: `rdvkill` kills that host, `rdvfreeze` freezes every process on it; the job
# must go on without it (the spare takes its place) and end bit-identical, every other
# launcher exiting 0; the frozen host, thawed after the end, must exit 0 within 60 s. The job
# is traced (`--trace`): the trace node 0 of the last round merges must hold one job's parts,
# every rank of the last start among them, and none missing but the lost host's rank 0 in start 0.
# `etcdkill`: etcd killed mid-run; every launcher must end non-zero naming etcd within
# RDV_BOUND seconds (it can no longer know whether the others go on without it).
#
#   scripts/three-hosts.sh [HYBRID_RNN_FLAGS...]
#
# Environment: BIN_DIR (where hybrid-rnn and rpcrun are; default: builds target/release),
# FAULT (default cut), RESTART (default group), CUT_AT_STEP (the step the fault comes after,
# default 150), CUT_SECS (default 4), OUT (default target/three-hosts), REF_CACHE (a directory
# keeping the loopback reference run's output for later scenarios; default: none, run each
# time).
# Needs root, iproute2 and util-linux's unshare; otherwise it says why and exits 0 without
# running (exit 77 with SKIP_STATUS=77). The namespaces are deleted and every process killed
# on exit, however it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
skip() { echo "three-hosts: skipped: $*"; exit "${SKIP_STATUS:-0}"; }
[ "$(id -u)" = 0 ] || skip "not root"
for t in ip tc unshare python3; do command -v "$t" >/dev/null || skip "\`$t\` is not installed"; done

flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--epochs 1 --checkpoint-every 100)
fault=${FAULT:-cut}
restart=${RESTART:-group}
rdzv=${RDZV:-embedded}
case "$rdzv:$fault:$restart" in
    embedded:cut:group | embedded:cut:worker | embedded:freeze:group | embedded:freeze:worker) ;;
    embedded:rdv*:group | embedded:rdv*:worker) ;;
    embedded:pair:group | embedded:impostor:worker) ;;
    etcd:rdvkill:group | etcd:rdvfreeze:group | etcd:etcdkill:group) ;;
    *) echo "three-hosts: FAULT is cut, freeze, rdvkill or rdvfreeze, RESTART group or worker;"
        echo "  with RDZV=etcd, FAULT is rdvkill, rdvfreeze or etcdkill, RESTART group"
        exit 2 ;;
esac
cut_at=${CUT_AT_STEP:-150}
cut_secs=${CUT_SECS:-4}
out=${OUT:-target/three-hosts}
if [ -z "${BIN_DIR:-}" ]; then
    cargo build --release -q -p examples --bin hybrid-rnn -p rpcrun --bin rpcrun
    BIN_DIR=target/release
fi
bin=$(cd "$BIN_DIR" && pwd)
if [ "$rdzv" = etcd ]; then
    command -v etcd >/dev/null || skip "etcd is not installed (Debian: apt-get install etcd-server)"
    # (Its refusal exits 1: read its words, not its status, which pipefail would pass on.)
    said=$("$bin/rpcrun" --nnodes 2 --rdzv etcd://127.0.0.1:1/probe --secret-file /dev/null \
        -- true 2>&1 || true)
    if grep -q "built without etcd" <<<"$said"; then
        skip "rpcrun was built without etcd (cargo build -p rpcrun --features etcd)"
    fi
fi
rm -rf "$out" && mkdir -p "$out"
out=$(cd "$out" && pwd)

tag="rpc3h$$"
hub="${tag}hub"
hosts=("${tag}0" "${tag}1" "${tag}2")
[ "$rdzv" = etcd ] && hosts+=("${tag}3")
pids=()
etcd_pid=
frozen=
cleanup() {
    for f in $frozen; do kill -9 "$f" 2>/dev/null || true; done
    for p in "${pids[@]}" $etcd_pid; do kill -9 "$p" 2>/dev/null || true; done
    for n in "${hosts[@]}" "$hub"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 143' TERM INT

ip netns add "$hub" || skip "cannot make network namespaces"
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
netem=yes
for i in "${!hosts[@]}"; do
    ns=${hosts[$i]}
    ip netns add "$ns"
    ip link add "v$i" netns "$ns" type veth peer name "h$i" netns "$hub"
    ip -n "$hub" link set "h$i" master br0
    ip -n "$hub" link set "h$i" up
    ip -n "$ns" addr add "10.232.0.$((i + 1))/24" dev "v$i"
    ip -n "$ns" link set "v$i" up
    ip -n "$ns" link set lo up
    # 2 ms each way on the host's side of its link, 0.1 % loss.
    if ! ip netns exec "$ns" tc qdisc add dev "v$i" root netem delay 2ms loss 0.1% 2>/dev/null; then
        netem=no
    fi
done
[ "$netem" = yes ] || echo "three-hosts: this kernel has no sch_netem: links without the 2 ms delay and 0.1 % loss"

# The uninterrupted reference, on loopback; the faults that end the job compare with none. With
# REF_CACHE (a directory) it is kept there, named by a hash of the binary and the flags, and
# the next scenario with the same binary and flags reads it instead of running it again.
case "$rdzv:$fault" in
    embedded:rdv* | etcd:etcdkill) ;;
    *)
        key=
        if [ -n "${REF_CACHE:-}" ]; then
            mkdir -p "$REF_CACHE"
            key=$({ sha256sum <"$bin/hybrid-rnn"; printf '%s\n' "${flags[@]}"; } | sha256sum)
            key="$REF_CACHE/${key:0:32}.out"
        fi
        if [ -n "$key" ] && [ -s "$key" ]; then
            echo "reference run on loopback: ${flags[*]}: kept from an earlier run, $key"
            cp "$key" "$out/ref.out"
        else
            echo "reference run on loopback: ${flags[*]}"
            "$bin/hybrid-rnn" "${flags[@]}" --quiet --out-dir "$out/ref" >"$out/ref.out" 2>"$out/ref.err"
            # Written whole or not at all: a scenario killed mid-copy leaves no half file.
            [ -z "$key" ] || { cp "$out/ref.out" "$key.$$" && mv "$key.$$" "$key"; }
        fi
        tail -1 "$out/ref.out"
        ;;
esac

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$out/secret"
chmod 600 "$out/secret"
if [ "$rdzv" = etcd ]; then
    . scripts/three-hosts-etcd.sh
    exit $?
fi
for i in 0 1 2; do
    ip netns exec "${hosts[$i]}" unshare --pid --fork --kill-child --mount-proc \
        "$bin/rpcrun" --nnodes 3 --nproc 1 --node-rank "$i" --rdzv 10.232.0.1:29500 \
        --secret-file "$out/secret" --max-restarts 3 --restart "$restart" \
        --rdzv-timeout "${RDZV_TIMEOUT:-60}" --trace "$out/trace$i/job.json" -- \
        "$bin/hybrid-rnn" "${flags[@]}" --quiet --out-dir "$out/run" --restart "$restart" \
        >"$out/host$i.out" 2>"$out/host$i.err" &
    pids+=($!)
done

done_steps() { awk '{print $1}' "$out/run/progress" 2>/dev/null || echo 0; }
deadline=$((SECONDS + 600))
while [ "$(done_steps)" -lt "$cut_at" ]; do
    [ $SECONDS -lt $deadline ] || { echo "no step $cut_at within 600 s"; tail "$out"/host*.err; exit 1; }
    kill -0 "${pids[0]}" 2>/dev/null || { echo "host 0 ended early"; tail "$out"/host*.err; exit 1; }
    sleep 0.01
done
# The one child of a process, seen from here (`ip netns exec` is `unshare`, whose child is
# rpcrun, whose child is the worker).
child_of() { tr ' ' '\n' <"/proc/$1/task/$1/children" | grep -m1 . ; }
fault_start=$SECONDS
if [ "$fault" = cut ]; then
    echo "step $(done_steps): cutting host 2's link for $cut_secs s"
    for side in "${hosts[2]} v2" "$hub h2"; do
        set -- $side
        ip netns exec "$1" tc qdisc replace dev "$2" root pfifo limit 0
    done
    sleep "$cut_secs"
    ip netns exec "$hub" tc qdisc del dev h2 root
    if [ "$netem" = yes ]; then
        ip netns exec "${hosts[2]}" tc qdisc replace dev v2 root netem delay 2ms loss 0.1%
    else
        ip netns exec "${hosts[2]}" tc qdisc del dev v2 root
    fi
    echo "link restored after $((SECONDS - fault_start)) s"
elif [ "$fault" = pair ]; then
    echo "step $(done_steps): cutting the link between hosts 1 and 2 alone for $cut_secs s"
    ip -n "${hosts[1]}" route add blackhole 10.232.0.3/32
    ip -n "${hosts[2]}" route add blackhole 10.232.0.2/32
    sleep "$cut_secs"
    ip -n "${hosts[1]}" route del blackhole 10.232.0.3/32
    ip -n "${hosts[2]}" route del blackhole 10.232.0.2/32
    echo "link restored after $((SECONDS - fault_start)) s"
elif [ "$fault" = impostor ]; then
    echo "step $(done_steps): an impostor on host 2 claims rank 1, alive on host 1"
    # It is refused at each try, and tries again within its init timeout in case the holder
    # fails (RDV-5); seen refused, it is ended here.
    ip netns exec "${hosts[2]}" unshare --pid --fork --kill-child --mount-proc \
        env RANK=1 WORLD_SIZE=3 MASTER_ADDR=10.232.0.1 MASTER_PORT=29500 \
        RPC_SECRET_FILE="$out/secret" RPC_RESTART_COUNT=1 RPC_SERVE_RENDEZVOUS=0 \
        RUST_LOG=rpc_core=info "$bin/hybrid-rnn" "${flags[@]}" --quiet \
        >"$out/impostor.out" 2>"$out/impostor.err" &
    impostor=$!
    pids+=("$impostor")
    until grep -q "has not failed" "$out/impostor.err"; do
        if [ $((SECONDS - fault_start)) -gt 30 ] || ! kill -0 "$impostor" 2>/dev/null; then
            echo "the impostor was not refused within 30 s"; tail -5 "$out/impostor.err"; exit 1
        fi
        sleep 0.05
    done
    kill -9 "$impostor"
    echo "the impostor was refused: $(grep -m1 -o 'rank 1 .* to replace it' "$out/impostor.err")"
elif [ "$fault" = freeze ]; then
    frozen=$(child_of "$(child_of "${pids[1]}")")
    kill -STOP "$frozen"
    echo "step $(done_steps): froze host 1's process (pid $frozen, SIGSTOP), restart $restart"
else
    # Host 0: its launcher (the rendezvous) and the master under it.
    launcher0=$(child_of "${pids[0]}")
    master=$(child_of "$launcher0")
    if [ "$fault" = rdvkill ]; then
        # unshare --kill-child: its child, the namespace's init, and with it every process
        # of the namespace, die with it.
        kill -9 "${pids[0]}"
        echo "step $(done_steps): killed host 0 (rendezvous and master), restart $restart"
    else
        frozen="$launcher0 $master"
        kill -STOP $frozen
        echo "step $(done_steps): froze host 0 (rendezvous pid $launcher0, master pid $master)"
    fi
    bound=${RDV_BOUND:-120}
    status=0
    for i in 1 2; do
        left=$((fault_start + bound - SECONDS))
        code=0
        if [ "$left" -le 0 ]; then code=124; else
            timeout "$left" tail --pid="${pids[$i]}" -f /dev/null || code=124
        fi
        if [ "$code" = 124 ]; then
            echo "host $i: its launcher still runs $bound s after the fault"; status=1; continue
        fi
        wait "${pids[$i]}" && code=0 || code=$?
        echo "host $i: rpcrun exited $code after $((SECONDS - fault_start)) s"
        [ "$code" != 0 ] || { echo "host $i: a failed job reported success"; status=1; }
        grep -h -i -E "rendezvous" "$out/host$i.err" | grep -v "^\[rank" | tail -2 | sed 's/^/  /'
        grep -q -i "rendezvous" "$out/host$i.err" || { echo "host $i: no word of the rendezvous"; status=1; }
    done
    python3 -c 'import json,sys; print(json.dumps({"three_hosts": True, "fault": sys.argv[1],
        "restart": sys.argv[2], "launchers_ended_s": int(sys.argv[3]), "ok": sys.argv[4] == "0"}))' \
        "$fault" "$restart" "$((SECONDS - fault_start))" "$status"
    exit "$status"
fi

status=0
for i in 0 1 2; do
    if wait "${pids[$i]}"; then echo "host $i: rpcrun exited 0"; else
        s=$?; echo "host $i: rpcrun exited $s"; status=1; fi
done
echo "every launcher done $((SECONDS - fault_start)) s after the fault"
pids=()
if [ -n "$frozen" ] && [ -e "/proc/$frozen" ] && ! grep -q '^State:.*Z' "/proc/$frozen/status" 2>/dev/null; then
    echo "host 1's frozen process outlived its launcher"; status=1
fi
grep -h -E "restarting|killing|killed|exited" "$out"/host*.err | grep -v "^\[rank" | sed 's/^/  /' || true
tail -1 "$out/host0.out"
python3 - "$out/ref.out" "$out/host0.out" "$status" "$fault" "$out" <<'PY'
import glob, json, os, sys
# The last line, without rpcrun's `[rank0]: ` prefix.
last = lambda p: json.loads(open(p).read().strip().splitlines()[-1].split("]: ", 1)[-1])
a, b = last(sys.argv[1]), last(sys.argv[2])
same = a["params_sha256"] == b["params_sha256"]
# Traced, each host to its own directory (as hosts without a shared filesystem): every part
# of every host names one job (TR-7: node 0's launcher names it, the others take it from the
# rendezvous), and every rank left at least one.
parts = [json.load(open(p))["otherData"]["rpc_trace"]
         for p in glob.glob(f"{sys.argv[5]}/trace*/job.json.parts/*.json")]
jobs = sorted({p["job"] for p in parts})
# TR-8: host 0's merge alone has every rank (the workers that shut down cleanly sent rank 0
# their parts), with no shared filesystem.
try:
    merged = json.load(open(f"{sys.argv[5]}/trace0/job.json"))["otherData"]["rpc_trace"]["parts"]
except (OSError, ValueError, KeyError):
    merged = []
node0 = sorted({p["rank"] for p in merged})
# TR-9: every part another host wrote reached host 0's directory too, however its worker
# ended (a start that failed included: the workers stopped then wrote theirs as they ended).
def names(host):
    d = f"{sys.argv[5]}/trace{host}/job.json.parts"
    return {n for n in (os.listdir(d) if os.path.isdir(d) else []) if n.endswith(".json")}
unsent = sorted(f"host {h}: {n}" for h in (1, 2) for n in names(h) - names(0))
traced = (len(jobs) == 1 and {p["rank"] for p in parts} == {0, 1, 2} and node0 == [0, 1, 2]
          and not unsent)
print(json.dumps({"three_hosts": True, "bit_identical": same, "recoveries": b["recoveries"],
                  "time_lost_s": b["time_lost_s"],
                  "accuracy": {"loopback": a["test_accuracy"], "three_hosts": b["test_accuracy"]},
                  "ms_per_step": {"loopback": a["ms_per_step_median"],
                                  "three_hosts": b["ms_per_step_median"]},
                  "trace": {"parts": len(parts), "jobs": jobs, "node0_merged": node0,
                            "unsent": unsent, "ok": traced}}))
# An impostor refused, or a cut that evicts no one, costs no recovery; the others need one.
need = 0 if sys.argv[4] in ("pair", "impostor") else 1
# A cut between two workers costs at most a restart, not their RPC timeout (DIAL-2: before, a
# send refused while the route was gone stalled the restarted group for 120 s).
quick = sys.argv[4] != "pair" or sum(b["time_lost_s"]) <= 30
if not quick:
    print(f"the cut cost {sum(b['time_lost_s'])} s")
sys.exit(0 if same and sys.argv[3] == "0" and b["recoveries"] >= need and quick and traced
         else 1)
PY
