# Sourced by scripts/three-hosts.sh with RDZV=etcd, once the hosts, the reference run and the
# secret exist (variables: bin, out, flags, hosts, hub, pids, etcd_pid, fault, cut_at). The
# launchers meet in etcd on the hub; hosts 0-2 start the job and host 3 waits as a spare. Ends
# the script with its verdict.

ip -n "$hub" addr add 10.232.0.254/24 dev br0
ip -n "$hub" link set lo up
ip netns exec "$hub" etcd --name hub --data-dir "$out/etcd" \
    --listen-client-urls http://10.232.0.254:2379 --advertise-client-urls http://10.232.0.254:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster hub=http://127.0.0.1:2380 >"$out/etcd.log" 2>&1 &
etcd_pid=$!
# Healthy once its /health says so (over bash's /dev/tcp: no etcdctl needed, which Debian's
# etcd-server only suggests).
healthy() {
    ip netns exec "$hub" timeout 5 bash -c 'exec 3<>/dev/tcp/10.232.0.254/2379 &&
        printf "GET /health HTTP/1.0\r\n\r\n" >&3 && grep -q "\"health\":\"true\"" <&3' \
        2>/dev/null
}
deadline=$((SECONDS + 30))
until healthy; do
    [ $SECONDS -lt $deadline ] || { echo "etcd did not start within 30 s"; tail "$out/etcd.log"; exit 1; }
    sleep 0.2
done
job="three-hosts-$$"
start_host() {
    ip netns exec "${hosts[$1]}" unshare --pid --fork --kill-child --mount-proc \
        "$bin/rpcrun" --nnodes 3 --nproc 1 --rdzv "etcd://10.232.0.254:2379/$job" \
        --secret-file "$out/secret" --max-restarts 3 --trace "$out/job.json" -- \
        "$bin/hybrid-rnn" "${flags[@]}" --quiet --out-dir "$out/run" \
        >"$out/host$1.out" 2>"$out/host$1.err" &
    pids[$1]=$!
}
for i in 0 1 2; do start_host "$i"; done
# Node 0 of the first round (where rank 0, the master and the group's rendezvous run): the
# launchers are ranked in the order they joined.
node0() { grep -l "this node is node 0 of" "$out"/host*.err 2>/dev/null | tail -1 | sed 's/.*host\([0-9]\).err/\1/'; }
deadline=$((SECONDS + 60))
until [ -n "$(node0)" ]; do
    [ $SECONDS -lt $deadline ] || { echo "no round formed within 60 s"; tail "$out"/host*.err "$out/etcd.log"; exit 1; }
    sleep 0.1
done
victim=$(node0)
start_host 3
echo "round 0 formed: node 0 on host $victim; host 3 waits as a spare"

done_steps() { awk '{print $1}' "$out/run/progress" 2>/dev/null || echo 0; }
deadline=$((SECONDS + 600))
while [ "$(done_steps)" -lt "$cut_at" ]; do
    [ $SECONDS -lt $deadline ] || { echo "no step $cut_at within 600 s"; tail "$out"/host*.err; exit 1; }
    sleep 0.01
done
child_of() { tr ' ' '\n' <"/proc/$1/task/$1/children" | grep -m1 . ; }
fault_start=$SECONDS
bound=${RDV_BOUND:-120}
# Waits for host $1's launcher until the bound; sets `code` to its exit status (124: still
# running).
wait_host() {
    local left=$((fault_start + bound - SECONDS))
    code=0
    if [ "$left" -le 0 ] || ! timeout "$left" tail --pid="${pids[$1]}" -f /dev/null; then
        code=124; return
    fi
    wait "${pids[$1]}" || code=$?
}
status=0
if [ "$fault" = etcdkill ]; then
    kill -9 "$etcd_pid"
    echo "step $(done_steps): killed etcd"
    for i in 0 1 2 3; do
        wait_host "$i"
        echo "host $i: rpcrun exited $code after $((SECONDS - fault_start)) s"
        case "$code" in
            124) echo "host $i: its launcher still runs $bound s after etcd's death"; status=1 ;;
            0) echo "host $i: a launcher that lost etcd reported success"; status=1 ;;
        esac
        grep -h "etcd" "$out/host$i.err" | grep -v "^\[rank" | tail -1 | sed 's/^/  /'
        grep -q "etcd" "$out/host$i.err" || { echo "host $i: no word of etcd"; status=1; }
    done
    python3 -c 'import json,sys; print(json.dumps({"three_hosts": True, "rdzv": "etcd",
        "fault": "etcdkill", "launchers_ended_s": int(sys.argv[1]), "ok": sys.argv[2] == "0"}))' \
        "$((SECONDS - fault_start))" "$status"
    exit "$status"
fi
launcher=$(child_of "${pids[$victim]}")
master=$(child_of "$launcher")
if [ "$fault" = rdvkill ]; then
    kill -9 "${pids[$victim]}"
    echo "step $(done_steps): killed host $victim (node 0: its launcher and the master)"
else
    frozen="$launcher $master"
    kill -STOP $frozen
    echo "step $(done_steps): froze host $victim (node 0: launcher pid $launcher, master pid $master)"
fi
for i in 0 1 2 3; do
    [ "$i" = "$victim" ] && continue
    wait_host "$i"
    echo "host $i: rpcrun exited $code after $((SECONDS - fault_start)) s"
    [ "$code" = 0 ] || status=1
done
if [ "$fault" = rdvfreeze ]; then
    # Thawed after the end, its launcher finds its lease gone and the job over.
    kill -CONT $frozen
    frozen=
    bound=$((SECONDS - fault_start + 60))
    wait_host "$victim"
    echo "host $victim, thawed: rpcrun exited $code"
    [ "$code" = 0 ] || status=1
fi
pids=()
grep -h -E "node 0 of|restarting|stopped|left round|exited" "$out"/host*.err | grep -v "^\[rank" |
    sed 's/^/  /' || true
# The master's last line: on whichever host was node 0 of the last round.
result=$(grep -h "params_sha256" "$out"/host*.out | tail -1 | sed 's/^\[rank0\]: //')
grep -h "rpcrun: trace" "$out"/host*.err | sed 's/^/  /' || true
python3 - "$out/ref.out" "$result" "$status" "$out/job.json" <<'PY'
import json, sys
a = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
b = json.loads(sys.argv[2] or "{}")
same = a["params_sha256"] == b.get("params_sha256")
# The job's trace, merged by node 0 of the last round: one job's parts (TR-7), every rank of
# the last start present; the only rank missing (TR-6) is the first start's rank 0, on the
# host killed or frozen (a frozen master's part is written once it is thawed, after the merge).
try:
    meta = json.load(open(sys.argv[4]))["otherData"]["rpc_trace"]
except (OSError, ValueError, KeyError) as e:
    meta = {"parts": [], "error": str(e)}
parts = meta["parts"]
last = max((p["restart"] for p in parts), default=-1)
missing = [[m["restart"], m["ranks"]] for m in meta.get("missing_by_start", [])]
traced = (len({p["job"] for p in parts}) == 1 and missing in ([], [[0, [0]]])
          and {p["rank"] for p in parts if p["restart"] == last} == {0, 1, 2})
print(json.dumps({"three_hosts": True, "rdzv": "etcd", "bit_identical": same,
                  "recoveries": b.get("recoveries", 0), "time_lost_s": b.get("time_lost_s"),
                  "trace": {"parts": len(parts), "last_start": last, "missing": missing,
                            "ok": traced, "error": meta.get("error")}}))
sys.exit(0 if same and traced and sys.argv[3] == "0" and b.get("recoveries", 0) >= 1 else 1)
PY
