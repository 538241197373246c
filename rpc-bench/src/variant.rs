//! What every process of a benchmark group is configured with: busy polling, the variant the
//! driver sets between groups (shared memory, wire protection, failure detector, trace), the
//! flags that pass it to the processes it starts, and the `Config` they build from it.

use std::time::Duration;

use rpc_core::{Config, Secret, WireProtection};

/// `--busy-poll-us`: `Config::busy_poll` of both processes (0: off).
pub(crate) static BUSY_POLL_US: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// What every process of a group is configured with besides the defaults (the driver
/// changes it between the groups of `overhead`; the processes it starts get it as flags).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Variant {
    /// `--no-shm`: bulk blobs stream over TCP (`Config::shm_arena_bytes` 0).
    pub(crate) no_shm: bool,
    /// `--wire-protection`.
    pub(crate) protection: Option<WireProtection>,
    /// `--heartbeat-ms`.
    pub(crate) heartbeat_ms: Option<u64>,
    /// `--trace`: both processes record the job's trace (`Config::trace`), to
    /// [`trace_path`].
    pub(crate) trace: bool,
}

static VARIANT: std::sync::Mutex<Variant> = std::sync::Mutex::new(Variant {
    no_shm: false,
    protection: None,
    heartbeat_ms: None,
    trace: false,
});

/// Where a traced group's parts go (removed after each group).
pub(crate) fn trace_path() -> std::path::PathBuf {
    std::env::temp_dir().join("rpc-bench-trace.json")
}

pub(crate) fn variant() -> Variant {
    *VARIANT.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn set_variant(v: Variant) {
    *VARIANT.lock().unwrap_or_else(|p| p.into_inner()) = v;
}

pub(crate) fn no_shm() -> bool {
    variant().no_shm
}

pub(crate) fn protection_name(p: Option<WireProtection>) -> &'static str {
    match p {
        None | Some(WireProtection::Auto) => "auto",
        Some(WireProtection::Mac) => "mac",
        Some(WireProtection::Encrypt) => "encrypt",
        Some(WireProtection::Off) => "off",
        Some(_) => "other",
    }
}

/// The flags every process of a run shares, to pass on to the processes it starts.
pub(crate) fn shared_flags(threads: usize) -> Vec<String> {
    let mut v = vec![
        "--threads".to_owned(),
        threads.to_string(),
        "--busy-poll-us".to_owned(),
        BUSY_POLL_US.get().copied().unwrap_or(0).to_string(),
    ];
    let var = variant();
    if var.no_shm {
        v.push("--no-shm".to_owned());
    }
    if let Some(p) = var.protection {
        v.extend([
            "--wire-protection".to_owned(),
            protection_name(Some(p)).to_owned(),
        ]);
    }
    if let Some(ms) = var.heartbeat_ms {
        v.extend(["--heartbeat-ms".to_owned(), ms.to_string()]);
    }
    if var.trace {
        v.push("--trace".to_owned());
    }
    v
}

/// How bulk blobs travel in this run, for the JSON lines.
pub(crate) fn bulk_path() -> &'static str {
    if no_shm() {
        "tcp"
    } else {
        "shm_if_same_host"
    }
}

pub(crate) fn config(rank: u32, rendezvous: &str, secret: Secret) -> Config {
    let var = variant();
    let mut cfg = Config::new();
    if let Some(p) = var.protection {
        cfg = cfg.with_wire_protection(p);
    }
    if let Some(ms) = var.heartbeat_ms {
        cfg = cfg.with_heartbeat_interval(Duration::from_millis(ms));
    }
    if var.trace {
        cfg = cfg.with_trace(trace_path());
    }
    cfg.with_rank(rank)
        .with_world_size(2)
        .with_name(if rank == 0 { "bench" } else { "peer" })
        .with_init_method(format!("tcp://{rendezvous}"))
        .with_serve_rendezvous(false)
        .with_secret(secret)
        .with_init_timeout(Duration::from_secs(30))
        .with_busy_poll(Duration::from_micros(
            BUSY_POLL_US.get().copied().unwrap_or(0),
        ))
        .with_shm_arena_bytes(if no_shm() { 0 } else { 128 << 20 })
}
