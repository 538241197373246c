//! `scripts/three-hosts.sh` in a small configuration: the hybrid example on three emulated
//! hosts (network and PID namespaces, one `rpcrun --nnodes 3` each) and a fault mid-run:
//! host 2's link cut for 3 s and restored (the group restarts), or host 1's only process
//! frozen with SIGSTOP (its launcher must end it, SUP-1), with the whole group restarted or
//! only the frozen process; the link between hosts 1 and 2 alone cut (neither worker is
//! evicted, RDV-4); or an impostor with the secret claiming rank 1 from host 2 (refused,
//! RDV-5). Each run must recover, every launcher exit 0, and the parameters end bit-identical
//! to the same run on loopback; every host traces to a directory of its own, and the parts of
//! all three must name one job (TR-7), host 0's merged trace holding every rank (TR-8). Before the launchers watched their children,
//! a frozen process hung its launcher for good. Host 0, where the rendezvous and the master
//! live, killed or frozen: the group cannot go on, and the launchers of hosts 1 and 2 must end
//! with an error naming the rendezvous within 60 s, giving it 15 s to answer (`--rdzv-timeout`;
//! RDV-7: before, a frozen rendezvous left them waiting on it). One loopback reference run
//! serves every scenario (the script's `REF_CACHE`). With the launchers' rendezvous in etcd (`RDZV=etcd`, a fourth host
//! waiting as a spare), the loss of that host (killed or frozen) costs one restart and the run
//! ends bit-identical, traced into one file by node 0 of the last round; etcd's own death ends every launcher with an error naming it. Those
//! need `rpcrun` built with its `etcd` feature and Debian's `etcd-server` (`.ci/run` has
//! both); elsewhere they are skipped, saying why.
//!
//! Skipped, with the reason printed, where namespaces cannot be made (the script says why) or
//! where `rpcrun` was not built beside `hybrid-rnn` (`cargo test --workspace` builds both).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The script, its process group ended on drop (its own trap then removes the namespaces).
struct Script(std::process::Child);

impl Drop for Script {
    fn drop(&mut self) {
        let pg = -(self.0.id() as i32);
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pg, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::kill(pg, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// The scenarios make namespaces and load the machine: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn three_hosts_survive_a_cut_link_bit_identically() {
    scenario("cut", "group", "cutting host 2's link");
}

#[test]
fn three_hosts_survive_a_frozen_process_with_the_group_restarted() {
    scenario("freeze", "group", "froze host 1's process");
}

#[test]
fn three_hosts_survive_a_frozen_process_replaced_alone() {
    scenario("freeze", "worker", "froze host 1's process");
}

#[test]
fn three_hosts_end_with_an_error_when_the_rendezvous_host_is_killed() {
    scenario("rdvkill", "group", "killed host 0");
}

#[test]
fn three_hosts_end_with_an_error_when_the_rendezvous_host_freezes() {
    scenario("rdvfreeze", "group", "froze host 0");
}

/// RDV-4 in a training run: the link between two healthy workers cut; neither is evicted.
#[test]
fn three_hosts_finish_untouched_when_the_link_between_two_workers_is_cut() {
    scenario(
        "pair",
        "group",
        "cutting the link between hosts 1 and 2 alone",
    );
}

/// RDV-5 across hosts: a process with the secret but no token claims a live rank.
#[test]
fn three_hosts_refuse_an_impostor_claiming_a_live_rank() {
    scenario("impostor", "worker", "the impostor was refused: rank 1");
}

#[test]
fn three_hosts_meeting_in_etcd_go_on_when_node_0_is_killed() {
    in_rendezvous(
        "etcd",
        "rdvkill",
        "group",
        "(node 0: its launcher and the master)",
    );
}

#[test]
fn three_hosts_meeting_in_etcd_go_on_when_node_0_freezes() {
    in_rendezvous("etcd", "rdvfreeze", "group", "(node 0: launcher pid");
}

#[test]
fn three_hosts_meeting_in_etcd_end_with_an_error_when_etcd_dies() {
    in_rendezvous("etcd", "etcdkill", "group", "killed etcd");
}

/// Runs the script with `FAULT=fault` and `RESTART=restart`; `said` is its line about the
/// fault.
fn scenario(fault: &str, restart: &str, said: &str) {
    in_rendezvous("embedded", fault, restart, said)
}

/// [`scenario`] with `RDZV=rdzv`.
fn in_rendezvous(rdzv: &str, fault: &str, restart: &str, said: &str) {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let bin = Path::new(env!("CARGO_BIN_EXE_hybrid-rnn"))
        .parent()
        .unwrap();
    if !bin.join("rpcrun").exists() {
        eprintln!(
            "skipped: no rpcrun binary in {} (cargo build -p rpcrun)",
            bin.display()
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let tag = format!(
        "three-hosts-{rdzv}-{fault}-{restart}-{}",
        std::process::id()
    );
    let out = std::env::temp_dir().join(&tag);
    let log = std::env::temp_dir().join(format!("{tag}.log"));
    let mut script = Script(
        Command::new("bash")
            .arg(root.join("scripts/three-hosts.sh"))
            .args(["--embedding", "8", "--hidden", "16", "--head-hidden", "16"])
            .args([
                "--train-limit",
                "12800",
                "--test-limit",
                "200",
                "--local-steps",
                "0",
            ])
            .args(["--epochs", "1", "--checkpoint-every", "25"])
            .env("BIN_DIR", bin)
            .env("OUT", &out)
            .env("CUT_AT_STEP", "60")
            .env("CUT_SECS", "3")
            .env("FAULT", fault)
            .env("RDZV", rdzv)
            .env("RESTART", restart)
            .env("SKIP_STATUS", "77")
            // The launchers of hosts 1 and 2 give up on a silent rendezvous after 15 s, not
            // rpcrun's default 60 (the fault is the same, the wait shorter), and must have
            // ended within 60 s of the fault (etcd's scenarios keep the script's bound: the
            // whole rest of the run must fit in it).
            .env("RDZV_TIMEOUT", "15")
            .env("RDV_BOUND", if rdzv == "embedded" { "60" } else { "120" })
            // One loopback reference run for every scenario with the same binary and flags.
            .env(
                "REF_CACHE",
                Path::new(env!("CARGO_TARGET_TMPDIR")).join("three-hosts-ref"),
            )
            .env_remove("RANK")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::from(
                std::fs::File::create(log.with_extension("err")).unwrap(),
            ))
            .process_group(0)
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = script.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the script did not end within 600 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&log).unwrap();
    let text = stdout.clone() + &std::fs::read_to_string(log.with_extension("err")).unwrap();
    if status.code() == Some(77) {
        eprintln!("{}", text.trim());
        return;
    }
    let hosts: String = (0..4)
        .map(|i| std::fs::read_to_string(out.join(format!("host{i}.err"))).unwrap_or_default())
        .collect();
    assert!(status.success(), "{text}\n{hosts}");
    // The script's verdict: its last line of output (bash's notes of the processes the fault
    // killed go to its stderr).
    let verdict = stdout.lines().last().unwrap_or_default();
    let j: serde_json::Value =
        serde_json::from_str(verdict).unwrap_or_else(|e| panic!("{e}: {text}"));
    if fault == "etcdkill" || (rdzv == "embedded" && fault.starts_with("rdv")) {
        // The script checked the bound, the non-zero exits and the word of the rendezvous.
        assert_eq!(j["ok"], true, "{text}");
    } else {
        assert_eq!(j["bit_identical"], true, "{text}");
        // Traced: one job's parts (TR-7), on every host; with etcd, every rank of the last
        // start, only the lost host's rank missing from the first start (TR-6); embedded,
        // every rank's.
        assert_eq!(j["trace"]["ok"], true, "{text}");
        // An impostor refused, or a cut that evicts no one, needs no recovery.
        let need = u64::from(!matches!(fault, "pair" | "impostor"));
        assert!(j["recoveries"].as_u64().unwrap() >= need, "{text}");
    }
    assert!(text.contains(said), "{text}");
    eprintln!("{fault}, restart {restart}: {verdict}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(log.with_extension("err"));
}
