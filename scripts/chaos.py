#!/usr/bin/env python3
"""A chaos harness for the training examples: each trial runs one example under its own
launcher (local mode, `--max-restarts 3`) and injects one fault at a random step, chosen from a
printed seed: SIGKILL or SIGSTOP of a random rank's process, the rendezvous's host (rank 0,
which hosts it with `--restart group`) killed, or the newest checkpoint damaged and then the
master killed (the restart must skip the damaged file). A trial passes when the run ends
with the uninterrupted run's `params_sha256`, or exits non-zero with a clear error, within its
time limit, with no process of it left behind.

    scripts/chaos.py [--trials N] [--seed S] [--examples hybrid-rnn,pipeline] [--limit SECS]
                     [--hosts [--rdzv etcd|embedded]]

`--hosts`: every rank on an emulated host of its own, under `rpcrun` per host, with link cuts
among the faults and the launchers meeting in etcd (scripts/chaos_hosts.py says more).

BIN_DIR names the directory of the example binaries (default: builds target/release);
CHAOS_KEEP=1 keeps the logs of a trial across hosts that did not pass (its line names them). One
JSON line per trial, then a summary line; the exit status is 0 when every trial passed.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_hosts  # noqa: E402

# Small configurations: each run about 100 steps, a checkpoint every 20.
FLAGS = {
    "hybrid-rnn": ["--embedding", "8", "--hidden", "16", "--head-hidden", "16",
                   "--train-limit", "6400", "--test-limit", "200", "--local-steps", "0",
                   "--epochs", "1", "--checkpoint-every", "20"],
    "pipeline": ["--batch", "64", "--emb", "16", "--hidden", "32", "--mlp-width", "48",
                 "--train-limit", "6400", "--test-limit", "200", "--epochs", "1",
                 "--stages", "3", "--micro-batches", "4", "--checkpoint-every", "20"],
}
# Under `--hosts` only, each rank replaced alone: elastic data parallelism (every rank a
# replica), and the parameter server (rank 0 coordinates, 1-2 serve, 3-5 train; the steps a
# lost trainer's index missed while vacant are not made up, so it passes on `updates_lost: 0`
# and every trainer index at its last step, not on bits).
FLAGS["elastic-ddp"] = ["--steps", "150", "--commit-every", "20"]
FLAGS["param-server"] = ["--steps", "150", "--slow-factor", "1"]
WORLD = {"hybrid-rnn": 3, "pipeline": 4, "elastic-ddp": 4, "param-server": 6}
# Flags every run of the example gets besides its out-dir.
QUIET = {"hybrid-rnn": ["--quiet"], "pipeline": ["--quiet"], "elastic-ddp": [],
         "param-server": []}
# Examples whose runs are not bit-reproducible: no reference run, judged by their own line.
NO_REFERENCE = {"param-server"}
HOSTS_ONLY = {"elastic-ddp", "param-server"}
FAULTS = ["kill", "stop", "rendezvous", "damage"]

# The process group of the run under way: ended with the harness, however it ends.
RUNNING = []


def stop_running(*_):
    for pgid in RUNNING:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    sys.exit(143)  # with --hosts, the `finally` of main ends the launchers and the hosts


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"RANK="):
                    return int(kv[5:])
    except (OSError, ValueError):
        pass
    return None


def ranks(launcher):
    return {r: p for p in children(launcher) if (r := rank_of(p)) is not None}


def left_behind(tag):
    """Processes whose command line or environment names this trial's directory."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(") ", 1)[-1][:1]
        except OSError:
            continue
        if tag.encode() in cmd and state != "Z":
            out.append(int(p))
    return out


def end_frozen(pid):
    """Kills a process the trial stopped (SIGKILL, then SIGCONT so that it dies), if any."""
    for s in (signal.SIGKILL, signal.SIGCONT) if pid else ():
        try:
            os.kill(pid, s)
        except OSError:
            pass


def sweep(tag):
    """Kills what is left of a trial (a moment after its end) and returns their pids."""
    time.sleep(0.2)
    leftover = left_behind(tag)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    return leftover


def done_steps(out_dir):
    try:
        with open(os.path.join(out_dir, "progress")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line.split("]: ", 1)[-1])
        except ValueError:
            continue
    return None


def run(bin_dir, example, out_dir, extra, limit):
    """Runs `example` to its end (at most `limit` s): (code, stdout, stderr, seconds)."""
    cmd = [os.path.join(bin_dir, example)] + FLAGS[example] + QUIET[example]
    cmd += ["--out-dir", out_dir] + extra
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    RUNNING[:] = [p.pid]
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err, time.monotonic() - start
    return p.returncode, out, err, time.monotonic() - start


def damage_newest_checkpoint(out_dir):
    ckpts = sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt-"))
    if not ckpts:
        return None
    path = os.path.join(out_dir, ckpts[-1])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(64))
    return ckpts[-1]


def trial(bin_dir, rng, example, n, limit, reference, tmp):
    fault = rng.choice(FAULTS)
    restart = rng.choice(["group", "worker"])
    if fault == "rendezvous":
        restart = "group"  # rank 0 hosts the rendezvous only then
    world = WORLD[example]
    rank = 0 if fault in ("rendezvous", "damage") else rng.randrange(world)
    at = rng.randrange(22, 85)
    out_dir = os.path.join(tmp, f"chaos-{os.getpid()}-{n}")
    cmd = [os.path.join(bin_dir, example)] + FLAGS[example] + [
        "--quiet", "--out-dir", out_dir, "--max-restarts", "3", "--restart", restart]
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    RUNNING[:] = [p.pid]
    injected, frozen, detail = None, None, None
    try:
        while done_steps(out_dir) < at and p.poll() is None and time.monotonic() - start < limit:
            time.sleep(0.005)
        if p.poll() is None and done_steps(out_dir) >= at:
            pid = ranks(p.pid).get(rank)
            if pid is not None:
                if fault == "damage":
                    detail = damage_newest_checkpoint(out_dir)
                sig = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
                os.kill(pid, sig)
                frozen = pid if fault == "stop" else None
                injected = done_steps(out_dir)
        try:
            out, err = p.communicate(timeout=max(1, limit - (time.monotonic() - start)))
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            code = None
    finally:
        end_frozen(frozen)
    seconds = time.monotonic() - start
    leftover = sweep(out_dir)
    j = last_json(out) or {}
    if code is None:
        outcome = "hang"
    elif injected is None:
        outcome = "not injected (the run ended first)"
    elif leftover:
        outcome = "process left behind"
    elif code == 0 and j.get("params_sha256") == reference[example]:
        outcome = "identical"
    elif code == 0:
        outcome = "WRONG PARAMETERS"
    elif any("error" in l.lower() for l in err.strip().splitlines()[-1:]):
        outcome = "clear error"
    else:
        outcome = "unclear failure"
    subprocess.run(["rm", "-rf", out_dir])
    line = {"trial": n, "example": example, "fault": fault, "restart": restart, "rank": rank,
            "at_step": injected, "outcome": outcome, "exit": code, "seconds": round(seconds, 1),
            "recoveries": j.get("recoveries"), "time_lost_s": j.get("time_lost_s")}
    if detail:
        line["damaged"] = detail
    if outcome in ("clear error", "unclear failure", "hang"):
        line["stderr_tail"] = err.strip().splitlines()[-3:]
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--examples", default=None,
                    help="default: hybrid-rnn,pipeline (with --hosts: and elastic-ddp)")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds per trial")
    ap.add_argument("--hosts", action="store_true", help="each rank on a host of its own")
    ap.add_argument("--rdzv", choices=["etcd", "embedded"], default=None,
                    help="with --hosts: where the launchers meet (default: etcd if usable)")
    a = ap.parse_args()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop_running)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(json.dumps({"chaos": True, "seed": seed, "trials": a.trials}), flush=True)
    rng = random.Random(seed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir = os.environ.get("BIN_DIR")
    if not bin_dir:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "examples", "--bin",
                        "hybrid-rnn", "--bin", "pipeline", "--bin", "elastic-ddp", "--bin",
                        "param-server"], cwd=root,
                       check=True)
        if a.hosts:
            etcd = ["--features", "etcd"] if shutil.which("protoc") else []
            subprocess.run(["cargo", "build", "--release", "-q", "-p", "rpcrun", "--bin",
                            "rpcrun", *etcd], cwd=root, check=True)
        bin_dir = os.path.join(root, "target", "release")
    hosts = None
    if a.hosts:
        why = chaos_hosts.usable(bin_dir)
        if why:
            print(json.dumps({"chaos": True, "skipped": why}))
            return int(os.environ.get("SKIP_STATUS", "0"))
        rdzv = a.rdzv or ("embedded" if chaos_hosts.etcd_usable(bin_dir) else "etcd")
        if rdzv == "etcd" and (why := chaos_hosts.etcd_usable(bin_dir)):
            print(json.dumps({"chaos": True, "skipped": why}))
            return int(os.environ.get("SKIP_STATUS", "0"))
    examples = (a.examples or ("hybrid-rnn,pipeline,elastic-ddp,param-server" if a.hosts
                               else "hybrid-rnn,pipeline")).split(",")
    if not a.hosts and HOSTS_ONLY & set(examples):
        print(json.dumps({"chaos": True, "error": f"{sorted(HOSTS_ONLY)} run only with --hosts"}))
        return 2
    tmp = tempfile.mkdtemp(prefix="chaos-")
    reference = {}
    for ex in examples:
        if ex in NO_REFERENCE:
            continue
        code, out, err, secs = run(bin_dir, ex, os.path.join(tmp, f"ref-{ex}"), [], a.limit)
        j = last_json(out) or {}
        if code != 0 or "params_sha256" not in j:
            print(json.dumps({"reference": ex, "exit": code, "stderr": err[-2000:]}))
            return 1
        reference[ex] = j["params_sha256"]
        print(json.dumps({"reference": ex, "seconds": round(secs, 1),
                          "params_sha256": reference[ex][:16]}), flush=True)
    outcomes = {}
    lost = []
    ok = True
    if a.hosts:
        hosts = chaos_hosts.Hosts(max(WORLD[e] for e in examples) + 1, f"rpcx{os.getpid()}")
        cfg = {"bin_dir": bin_dir, "flags": FLAGS, "quiet": QUIET, "world": WORLD, "rdzv": rdzv,
               "done_steps": done_steps, "children": children, "rank_of": rank_of,
               "damage": damage_newest_checkpoint, "end_frozen": end_frozen, "sweep": sweep,
               "last_json": last_json}
        print(json.dumps({"hosts": len(hosts.names), "rdzv": rdzv}), flush=True)
    try:
        if hosts and rdzv == "etcd":
            hosts.start_etcd(os.path.join(tmp, "etcd"))
        for n in range(a.trials):
            ex = rng.choice(examples)
            if hosts:
                line = chaos_hosts.trial(hosts, cfg, rng, ex, n, a.limit, reference, tmp)
            else:
                line = trial(bin_dir, rng, ex, n, a.limit, reference, tmp)
                line["passed"] = line["outcome"] in ("identical", "clear error")
            print(json.dumps(line), flush=True)
            outcomes[line["outcome"]] = outcomes.get(line["outcome"], 0) + 1
            lost += line.get("time_lost_s") or []
            ok = ok and line["passed"]
    finally:
        if hosts:
            hosts.close()
    if os.environ.get("CHAOS_KEEP") != "1":
        subprocess.run(["rm", "-rf", tmp])
    print(json.dumps({"summary": True, "seed": seed, "trials": a.trials, "outcomes": outcomes,
                      "time_lost_s_median": sorted(lost)[len(lost) // 2] if lost else None,
                      "passed": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
