//! The environment variables a worker reads when its program leaves a setting unset, named
//! once here: the launchers' (torchrun, Slurm, Open MPI, MPICH and Intel MPI, this project's
//! `rpcrun`) and this framework's own.

use crate::error::InitError;

/// The environment as a lookup (tests pass their own).
pub(crate) type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The variables a launcher names a worker's rank in, the first one set winning: torchrun's
/// (and this project's launchers'), Slurm's, Open MPI's, then MPICH's and Intel MPI's.
pub const RANK_ENV: [&str; 4] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];
/// The variables a launcher names the world size in, in the order of [`RANK_ENV`].
pub const WORLD_SIZE_ENV: [&str; 4] = [
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
];

/// The first of `keys` set in `env`, as a number; an error naming the variable if it is not one.
pub(crate) fn env_number(
    env: Env<'_>,
    keys: &[&str],
    what: &str,
) -> Result<Option<u32>, InitError> {
    for k in keys {
        if let Some(v) = env(k) {
            return v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| InitError::Config(format!("{k}={v:?} is not a valid {what}")));
        }
    }
    Ok(None)
}

/// The rank a launcher started this process as (see [`RANK_ENV`]), as `Config` will read
/// it; `None` when no launcher did (a program then usually launches its workers itself).
pub fn launched_rank() -> Result<Option<u32>, InitError> {
    env_number(&|k| std::env::var(k).ok(), &RANK_ENV, "rank")
}

/// Set (to `True`) by torchrun in its workers' environment when its agent's own store listens
/// at `MASTER_ADDR:MASTER_PORT`; the rendezvous then uses `MASTER_PORT + 1` on that host.
pub const TORCHRUN_AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// The variables a launcher counts its restarts in (how many times this process's group, or
/// this process, was started again after a failure): this project's `rpcrun`, then torchrun's.
pub const RESTART_COUNT_ENV: [&str; 2] = ["RPC_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"];

/// The variables a launcher names its job in, the same for every process of the job and
/// every restart (this project's `rpcrun`, then torchrun's `--rdzv-id`): a traced worker's
/// part carries it, so that a merge takes one job's parts only. Without a launcher, the
/// group's rendezvous draws one as it starts.
pub const JOB_ID_ENV: [&str; 2] = ["RPC_JOB_ID", "TORCHELASTIC_RUN_ID"];

/// The variable that says whether rank 0 hosts the rendezvous (`0` or `1`; see
/// [`Config::serve_rendezvous`](crate::Config::serve_rendezvous)): a launcher that hosts a standalone one sets `0`.
pub const SERVE_RENDEZVOUS_ENV: &str = "RPC_SERVE_RENDEZVOUS";

/// The variable in which a launcher hands a restarted process the token the rendezvous issued
/// to the process it replaces (the old process told its launcher, `rpc_core::supervisor`):
/// with it, the replacement takes the rank at once, even from a holder not yet declared failed
/// (RDV-5); without it, only once the group has declared the holder failed.
pub const REPLACE_TOKEN_ENV: &str = "RPC_REPLACE_TOKEN";

/// The variable a launcher sets to say what it restarts after a failure: `worker` (each
/// failed process alone, into the running group) or `group` (every process); see
/// [`Config::replaced_on_failure`](crate::Config::replaced_on_failure).
pub const RESTART_MODE_ENV: &str = "RPC_RESTART_MODE";

/// How many times a launcher has restarted this process after a failure (see
/// [`RESTART_COUNT_ENV`]); 0 on the first start or without a launcher. A program resumes from
/// its latest checkpoint when this is positive.
pub fn launched_restart_count() -> Result<u32, InitError> {
    Ok(env_number(
        &|k| std::env::var(k).ok(),
        &RESTART_COUNT_ENV,
        "restart count",
    )?
    .unwrap_or(0))
}

/// The variable that gives a group's maximum world size (see [`Config::max_world_size`](crate::Config::max_world_size)).
pub const MAX_WORLD_SIZE_ENV: &str = "RPC_MAX_WORLD_SIZE";

/// The rendezvous's host when `Config::init_method` is unset (torchrun's convention).
pub const MASTER_ADDR_ENV: &str = "MASTER_ADDR";
/// The rendezvous's port when `Config::init_method` is unset (torchrun's convention).
pub const MASTER_PORT_ENV: &str = "MASTER_PORT";
/// [`Config::heartbeat_interval`](crate::Config::heartbeat_interval), in milliseconds.
pub const HEARTBEAT_INTERVAL_ENV: &str = "RPC_HEARTBEAT_INTERVAL_MS";
/// [`Config::failure_timeout`](crate::Config::failure_timeout), in milliseconds.
pub const FAILURE_TIMEOUT_ENV: &str = "RPC_FAILURE_TIMEOUT_MS";
/// [`Config::signal_grace`](crate::Config::signal_grace), in milliseconds.
pub const SIGNAL_GRACE_ENV: &str = "RPC_SIGNAL_GRACE_MS";
/// [`Config::wire_protection`](crate::Config::wire_protection): `auto`, `mac`, `encrypt` or
/// `off`.
pub const WIRE_PROTECTION_ENV: &str = "RPC_WIRE_PROTECTION";

/// Every `RPC_*` variable this framework's workers and launcher read or set.
const KNOWN: [&str; 16] = [
    RESTART_COUNT_ENV[0],
    JOB_ID_ENV[0],
    SERVE_RENDEZVOUS_ENV,
    REPLACE_TOKEN_ENV,
    RESTART_MODE_ENV,
    MAX_WORLD_SIZE_ENV,
    // Set by `rpcrun` for its children.
    "RPC_MAX_RESTARTS",
    HEARTBEAT_INTERVAL_ENV,
    FAILURE_TIMEOUT_ENV,
    SIGNAL_GRACE_ENV,
    WIRE_PROTECTION_ENV,
    crate::trace::TRACE_ENV,
    crate::net::SECRET_ENV,
    crate::net::SECRET_FILE_ENV,
    crate::net::supervisor::SUPERVISOR_FD_ENV,
    crate::rendezvous::RENDEZVOUS_FD_ENV,
];

/// The variables among `names` that look like one of this framework's but are not (a typo,
/// a missing `_MS`, lower case): each with the one it probably means. A setting given that way
/// is read by nothing, and the worker would run without it without a word; `init` warns.
/// Names that resemble none (a program's own `RPC_*` variables) are left alone.
pub(crate) fn near_misses<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for name in names {
        if KNOWN.contains(&name) {
            continue;
        }
        let upper = name.to_ascii_uppercase();
        if !upper.starts_with("RPC") {
            continue;
        }
        let squeeze = |s: &str| s.replace(['_', '-'], "");
        let meant = KNOWN.iter().copied().find(|k| {
            upper == *k
                || squeeze(&upper) == squeeze(k)
                || strsim::levenshtein(&upper, k) <= 2
                || (upper.len() >= 12 && (k.starts_with(upper.as_str()) || upper.starts_with(k)))
        });
        if let Some(k) = meant {
            out.push((name.to_owned(), k));
        }
    }
    out
}

/// Whether this process warns of the near misses in its environment: once per process (a
/// test's group of agents in one process shares one environment), and under a launcher only
/// in local rank 0, since every process of a node inherits the same environment: one warning
/// per node, not one per worker. A `LOCAL_RANK` that is not a number warns.
pub(crate) fn warns_of_near_misses(local_rank: Option<&str>, first_in_process: bool) -> bool {
    let local = local_rank.and_then(|r| r.trim().parse::<u32>().ok());
    first_in_process && local.is_none_or(|r| r == 0)
}

/// Warns (`tracing`) of each variable of this process's environment that [`near_misses`]
/// finds ([`warns_of_near_misses`] says where).
pub(crate) fn warn_of_near_misses() {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let first = !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed);
    let local_rank = std::env::var("LOCAL_RANK").ok();
    if !warns_of_near_misses(local_rank.as_deref(), first) {
        return;
    }
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    for (given, meant) in near_misses(names.iter().map(String::as_str)) {
        tracing::warn!("{given} is set, and nothing reads it: did you mean {meant}?");
    }
}
