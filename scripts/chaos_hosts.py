"""The chaos harness across hosts (`scripts/chaos.py --hosts`): each rank on an emulated host of
its own (a network and PID namespace, veth to a bridge), one `rpcrun --nnodes W --nproc 1` per
host. With `--rdzv etcd` (the default where etcd and an rpcrun built with it exist) the
launchers meet in etcd on the bridge's host and one more host waits as a spare; with
`--rdzv embedded` they meet at node 0.

Faults, one per trial at a random step: SIGKILL or SIGSTOP of a random rank's process, a random
member host's link cut both ways for 2-4 s, the newest checkpoint damaged and the master
killed, or node 0's host (rank 0, the master and the group's rendezvous) killed whole. With
etcd every trial must end with the uninterrupted run's parameters; with the embedded
rendezvous the last one must end with a clear error instead. Either way no process and no
launcher may be left when the trial ends.

`elastic-ddp` (four replicas, no checkpoints) and `param-server` (six processes: rank 0
coordinates, two servers each back the other's shard up, three trainers) run with `--restart
worker`: a lost replica is started again alone and rejoins the others, who rolled back to their
last commit; a lost server's shards go on at their backups, a lost trainer's replacement joins
at the others' step, a lost coordinator's replacement watches the same clocks. Their launchers
always meet at node 0 (etcd restarts whole groups only), so node 0's host killed must end them
with a clear error; they have no checkpoint to damage. A parameter server's run passes on its
own line (`updates_lost: 0`, every trainer index at its last step), not on bits: the steps a
lost trainer's index missed while vacant are not made up.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

NET = "10.233.0"
ETCD = f"{NET}.254:2379"


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Hosts:
    """`n` emulated hosts joined by a bridge in a hub namespace; removed by `close`."""

    def __init__(self, n, tag):
        self.hub = f"{tag}hub"
        self.names = [f"{tag}{i}" for i in range(n)]
        self.etcd = None
        self.launchers = []
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        sh("ip", "-n", self.hub, "addr", "add", f"{NET}.254/24", "dev", "br0")
        for i, ns in enumerate(self.names):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"v{i}", "netns", ns, "type", "veth", "peer", "name",
               f"h{i}", "netns", self.hub)
            sh("ip", "-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"h{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{NET}.{i + 1}/24", "dev", f"v{i}")
            sh("ip", "-n", ns, "link", "set", f"v{i}", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def start_etcd(self, data_dir):
        self.etcd = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, "etcd", "--name", "hub", "--data-dir", data_dir,
             "--listen-client-urls", f"http://{ETCD}", "--advertise-client-urls",
             f"http://{ETCD}", "--listen-peer-urls", "http://127.0.0.1:2380",
             "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "hub=http://127.0.0.1:2380"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        # Healthy once its /health says so (no etcdctl: Debian's etcd-server only suggests it).
        probe = ("import sys, urllib.request as u; "
                 "o = u.build_opener(u.ProxyHandler({})); "
                 f"body = o.open('http://{ETCD}/health', timeout=3).read(); "
                 "sys.exit(0 if b'\"health\":\"true\"' in body else 1)")
        while sh("ip", "netns", "exec", self.hub, sys.executable, "-c", probe,
                 check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not start within 30 s")
            time.sleep(0.2)

    def cut(self, i, seconds):
        for ns, dev in ((self.names[i], f"v{i}"), (self.hub, f"h{i}")):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "pfifo",
               "limit", "0")
        time.sleep(seconds)
        for ns, dev in ((self.names[i], f"v{i}"), (self.hub, f"h{i}")):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def close(self):
        # `unshare --kill-child`: each launcher's namespace ends with it.
        for p in self.launchers:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.etcd:
            self.etcd.kill()
            self.etcd.wait()
        for ns in self.names + [self.hub]:
            sh("ip", "netns", "del", ns, check=False)


def usable(bin_dir):
    """Why the harness cannot run across hosts here, or None."""
    if os.geteuid() != 0:
        return "not root"
    for t in ("ip", "tc", "unshare"):
        if not shutil.which(t):
            return f"`{t}` is not installed"
    return None


def etcd_usable(bin_dir):
    if not shutil.which("etcd"):
        return "etcd is not installed"
    r = subprocess.run([os.path.join(bin_dir, "rpcrun"), "--nnodes", "2", "--rdzv",
                        "etcd://127.0.0.1:1/probe", "--secret-file", "/dev/null", "--", "true"],
                       capture_output=True, text=True)
    if "built without etcd" in r.stderr:
        return "rpcrun was built without etcd"
    return None


def trial(h, cfg, rng, example, n, limit, reference, tmp):
    """One trial on hosts `h`; `cfg` holds bin_dir, flags, world, rdzv, helpers."""
    world = cfg["world"][example]
    # Replaced one process at a time, meeting at node 0; no checkpoints to damage.
    alone = example in ("elastic-ddp", "param-server")
    elastic = example == "elastic-ddp"
    fault = rng.choice(["kill", "stop", "cut", "rendezvous"] + ([] if alone else ["damage"]))
    at = rng.randrange(22, 85)
    out_dir = os.path.join(tmp, f"chaos-{os.getpid()}-{n}")
    os.makedirs(out_dir)
    secret = os.path.join(out_dir, "secret")
    with open(secret, "w") as f:
        f.write(os.urandom(16).hex())
    os.chmod(secret, 0o600)
    etcd = cfg["rdzv"] == "etcd" and not alone
    restart = "worker" if alone else "group"
    bin_dir = cfg["bin_dir"]
    hosts = list(range(world + 1 if etcd else world))
    launchers = {}

    def start(i):
        rdzv = ["--rdzv", f"etcd://{ETCD}/chaos-{os.getpid()}-{n}"] if etcd else [
            "--node-rank", str(i), "--rdzv", f"{NET}.1:29500"]
        cmd = ["ip", "netns", "exec", h.names[i], "unshare", "--pid", "--fork", "--kill-child",
               "--mount-proc", os.path.join(bin_dir, "rpcrun"), "--nnodes", str(world),
               "--nproc", "1", *rdzv, "--secret-file", secret, "--max-restarts", "3",
               "--restart", restart, "--", os.path.join(bin_dir, example),
               *cfg["flags"][example], *cfg["quiet"][example], "--out-dir", out_dir]
        launchers[i] = subprocess.Popen(
            cmd, stdout=open(os.path.join(out_dir, f"host{i}.out"), "w"),
            stderr=open(os.path.join(out_dir, f"host{i}.err"), "w"))
        h.launchers.append(launchers[i])

    start_t = time.monotonic()
    for i in hosts[:world]:
        start(i)
    if etcd:
        # The spare joins once round 0 formed (the launchers rank in the order they joined).
        while time.monotonic() - start_t < 60 and not any(
                "node 0 of" in open(os.path.join(out_dir, f"host{i}.err")).read()
                for i in hosts[:world]):
            time.sleep(0.05)
        start(world)
    done_steps, children, rank_of = cfg["done_steps"], cfg["children"], cfg["rank_of"]

    def where(rank):
        """(host, pid) of `rank`'s process now."""
        for i, p in launchers.items():
            for launcher in children(p.pid):
                for c in children(launcher):
                    if rank_of(c) == rank:
                        return i, c
        return None, None

    injected, frozen, detail, killed_host = None, None, None, None
    while (done_steps(out_dir) < at and time.monotonic() - start_t < limit
           and all(p.poll() is None for p in launchers.values())):
        time.sleep(0.005)
    rank = 0 if fault in ("damage", "rendezvous") else rng.randrange(world)
    host, pid = where(rank)
    if pid is not None and done_steps(out_dir) >= at:
        injected = done_steps(out_dir)
        if fault == "kill":
            os.kill(pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(pid, signal.SIGSTOP)
            frozen = pid
        elif fault == "damage":
            detail = cfg["damage"](out_dir)
            os.kill(pid, signal.SIGKILL)
        elif fault == "rendezvous":
            launchers[host].kill()
            killed_host = host
        else:
            secs = round(rng.uniform(2, 4), 1)
            detail = f"host {host} cut for {secs} s"
            h.cut(host, secs)
    codes = {}
    for i, p in launchers.items():
        try:
            codes[i] = p.wait(timeout=max(1, limit - (time.monotonic() - start_t)))
        except subprocess.TimeoutExpired:
            codes[i] = None
    cfg["end_frozen"](frozen)
    for p in launchers.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    seconds = time.monotonic() - start_t
    leftover = cfg["sweep"](out_dir)
    outs = "".join(open(os.path.join(out_dir, f"host{i}.out")).read() for i in hosts)
    errs = {i: open(os.path.join(out_dir, f"host{i}.err")).read() for i in hosts}
    j = cfg["last_json"]("\n".join(l for l in outs.splitlines() if "params_sha256" in l)) or {}
    rest = {i: c for i, c in codes.items() if i != killed_host}
    if any(c is None for c in rest.values()):
        outcome = "hang"
    elif injected is None:
        outcome = "not injected (the run ended first)"
    elif leftover:
        outcome = "process left behind"
    elif all(c == 0 for c in rest.values()) and j.get("params_sha256") == reference.get(example):
        outcome = "identical"
    elif (all(c == 0 for c in rest.values()) and example == "param-server"
          and j.get("updates_lost") == 0 and j.get("finished") is True):
        outcome = "no update lost"
    elif all(c == 0 for c in rest.values()):
        outcome = "WRONG PARAMETERS"
    elif all(c != 0 and "error" in errs[i].strip().splitlines()[-1:][0].lower()
             for i, c in rest.items() if errs[i].strip()):
        outcome = "clear error"
    else:
        outcome = "unclear failure"
    # A trial that did not pass keeps its logs (one `hostN.err` per host) for a look.
    passed_now = outcome in ("identical", "no update lost") or (
        outcome == "clear error" and not etcd and fault == "rendezvous")
    if passed_now or os.environ.get("CHAOS_KEEP") != "1":
        shutil.rmtree(out_dir, ignore_errors=True)
    line = {"trial": n, "example": example, "fault": fault, "restart": restart,
            "rdzv": "etcd" if etcd else "node 0", "rank": rank, "host": host,
            "at_step": injected, "outcome": outcome, "exits": codes,
            "seconds": round(seconds, 1), "recoveries": j.get("recoveries"),
            "time_lost_s": j.get("time_lost_s")}
    if elastic:
        # Rolled back and re-formed: the recovery's own time (detection is before it).
        line["recoveries"] = j.get("reforms")
        line["time_lost_s"] = [round(j["recovery_s"], 3)] if j.get("recovered_from_step") else None
    # With etcd the job outlives node 0's host; at node 0 it cannot, and must say so.
    line["passed"] = passed_now
    if not passed_now and os.environ.get("CHAOS_KEEP") == "1":
        line["kept"] = out_dir
    if detail:
        line["detail"] = detail
    if example == "param-server":
        line["recoveries"] = None
        line["time_lost_s"] = None
        line["replaced"] = [r for r, i in enumerate(j.get("incarnations") or []) if i]
        line["updates_lost"] = j.get("updates_lost")
        line["applied_updates"] = j.get("applied_updates")
    if outcome not in ("identical", "no update lost"):
        line["stderr_tail"] = {i: e.strip().splitlines()[-2:] for i, e in errs.items()}
    return line
