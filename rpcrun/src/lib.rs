//! A launcher for groups of worker processes, in the spirit of torchrun.
//!
//! [`Launch`] starts `nproc` copies of a program on this machine (one node of `nnodes`), each
//! with the variables the framework's `rpc_core::init` reads: `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the node's rank), `MASTER_ADDR`,
//! `MASTER_PORT`, `RPC_RESTART_COUNT`, `RPC_JOB_ID` (the same in every restart, another in
//! the next launch; with `--rdzv HOST:PORT`, node 0's only: the others' processes take it
//! from the rendezvous), and the group secret as a file (`RPC_SECRET_FILE`,
//! readable by this user only; never on a command line). On one node it chooses the
//! rendezvous's port itself and keeps it bound: rank 0 inherits that socket and serves on it
//! (`RPC_RENDEZVOUS_FD`, RDV-8), so that no other process can take the port first. It then
//! supervises them:
//!
//! - each child's output is passed on line by line, prefixed with `[rank<R>]: ` (unless
//!   [`Launch::prefix_output`] turns that off);
//! - SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every child (each runs
//!   in a process group of its own, so a terminal's Ctrl-C reaches them once, through here),
//!   which get [`Launch::stop_grace`] to exit before they are killed; the launcher then exits
//!   with 128 + the signal's number;
//! - when a child fails (exits non-zero or is killed by a signal), the others are stopped and,
//!   while restarts are left ([`Launch::max_restarts`]), all are started again with
//!   `RPC_RESTART_COUNT` one higher (torchrun's `--max-restarts`: the whole group restarts, and
//!   the program resumes from its checkpoint). Out of restarts, the launcher ends with the
//!   first failure's status (128 + its signal for a child killed by one). A child that exits
//!   with [`FATAL_EXIT_CODE`] says a restart would meet the same failure (a bad flag, a
//!   checkpoint that cannot be written): the launcher stops the others and ends with it, its
//!   restarts unspent;
//! - a child never outlives the launcher: it is killed if the launcher dies (Linux's parent
//!   death signal) and its whole process group is killed when its attempt ends.
//!
//! - every launcher, on every node, watches its own children through a pipe each inherits
//!   (`rpc_core::supervisor`: a status line every heartbeat interval from the child's failure
//!   detector thread) and kills one that stops writing for its failure timeout and half again
//!   (frozen, as its peers see it: they declared it failed by then), that says the group
//!   declared it failed, or that lost its rendezvous longer than its failure timeout ago
//!   (SUP-1..3); the kill is its failure, restarted as any other, its reason in the failure's
//!   description. A child that never reports (no agent, heartbeats off) is not watched.
//!
//! With [`Restart::Worker`], only the failed process is restarted, and it rejoins the running
//! group in its own place (its name and rank, the next incarnation; the group refuses the
//! previous one from then on). The launcher of node 0 hosts the group's rendezvous itself
//! (children are told not to, with `RPC_SERVE_RENDEZVOUS=0`), so any rank can be replaced,
//! rank 0 included; it hears there of every failure the group's detectors decide, and kills
//! a local child declared failed that has not exited (frozen, cut off) so it is restarted
//! too. Survivors keep their processes and their state; what the program does about a
//! replaced peer is the program's (`Agent::watch_membership`).
//!
//! With the `etcd` feature, `--rdzv etcd://HOST:PORT[,HOST:PORT...]/JOB` has the launchers
//! meet in etcd instead of at node 0: they agree there, round after round, which nodes take
//! part (node ranks in the order they joined; extra launchers wait as spares), node 0 of a
//! round serves the group's rendezvous through its rank 0, and a failure anywhere, or a node
//! whose lease lapsed (killed, frozen, cut off), begins the next round on every node. The job
//! outlives any host while enough launchers are left (ETC-1..4, docs/recovery.md).
//!
//! ```no_run
//! let exit = rpcrun::Launch::new("target/release/hybrid-rnn")
//!     .nproc(3)
//!     .max_restarts(3)
//!     .run()?;
//! std::process::exit(exit.code);
//! # Ok::<(), rpcrun::LaunchError>(())
//! ```

#![deny(missing_docs)]

mod child;
mod env;
mod etcd;
mod parts;
pub mod report;
mod secret;
mod supervise;
mod watch;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// The exit status by which a child says that restarting it cannot help (the training
/// examples use it for a flag out of range, a checkpoint written with other flags, a
/// checkpoint write that failed): the launcher does not restart for it, in either mode, and
/// exits with it. It is 78, `EX_CONFIG` of BSD's `sysexits.h`, which few programs return
/// otherwise.
pub const FATAL_EXIT_CODE: i32 = 78;

/// Why a launch could not be carried out (a child's failure is not one: see [`Exit`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The launch's settings contradict each other or are out of range.
    #[error("invalid launch: {0}")]
    Invalid(String),
    /// A child process could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank it was to run as.
        rank: u32,
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The group secret could not be written or read.
    #[error("group secret {path}: {source}")]
    Secret {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// [`Launch::run`] was called from async code: it blocks its thread for the whole job (and
    /// may start a runtime of its own), so it belongs in `main` or on a thread of its own.
    #[error(
        "Launch::run blocks until the group ends and cannot run inside an async runtime: \
         call it from main before starting one, or from a std::thread"
    )]
    InsideRuntime,
    /// The launchers' rendezvous failed them (etcd: unreachable, a lost lease not taken
    /// again, a round that did not form in time).
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Another system call the launcher needs failed (signal handlers, a free port).
    #[error("{what}: {source}")]
    System {
        /// What the launcher was doing.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// How a launch ended.
#[derive(Clone, Debug)]
pub struct Exit {
    /// The status to exit with: 0 when every child of the last attempt succeeded, else the
    /// first failure's code (128 + its signal for a child killed by one, or 128 + the signal
    /// the launcher itself received).
    pub code: i32,
    /// How many times the group was restarted.
    pub restarts: u32,
    /// Every failure seen, in order.
    pub failures: Vec<Failure>,
    /// The job's merged trace, with [`Launch::trace`] on node 0 (`None` otherwise, or when
    /// no part could be merged: the reason was printed).
    pub trace: Option<rpc_core::trace::MergeSummary>,
}

/// One child's failure.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The attempt it happened in (0 for the first start).
    pub attempt: u32,
    /// The child's global rank.
    pub rank: u32,
    /// Its exit code, or 128 + the signal that killed it.
    pub code: i32,
    /// A description: `exited with status 1`, `killed by signal 9 (SIGKILL)`.
    pub what: String,
}

/// What is restarted after a failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Restart {
    /// Every process of the node (torchrun's behaviour; the program resumes from its
    /// checkpoint).
    #[default]
    Group,
    /// Only the process that failed; it rejoins the running group as the next incarnation of
    /// its rank.
    Worker,
}

impl std::str::FromStr for Restart {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "group" => Ok(Self::Group),
            "worker" => Ok(Self::Worker),
            other => Err(format!("{other:?}: expected `worker` or `group`")),
        }
    }
}

/// A group of processes to start and supervise. Build it with [`Launch::new`] and the
/// setters, then [`Launch::run`] it (not from inside an async runtime: it blocks, and it
/// runs a runtime of its own for the rendezvous when it hosts one).
#[derive(Clone, Debug)]
pub struct Launch {
    program: PathBuf,
    args: Vec<OsString>,
    nproc: u32,
    nnodes: u32,
    node_rank: u32,
    rdzv: Option<String>,
    max_restarts: u32,
    restart: Restart,
    secret_file: Option<PathBuf>,
    prefix: bool,
    stop_grace: Duration,
    env: Vec<(String, String)>,
    trace: Option<PathBuf>,
    local_addr: Option<String>,
    join_timeout: Duration,
    rdzv_timeout: Duration,
}

impl Launch {
    /// `program` on one node, one process, no restarts, a fresh secret, prefixed output,
    /// 5 s of grace when stopping.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            nproc: 1,
            nnodes: 1,
            node_rank: 0,
            rdzv: None,
            max_restarts: 0,
            restart: Restart::Group,
            secret_file: None,
            prefix: true,
            stop_grace: Duration::from_secs(5),
            trace: None,
            env: Vec::new(),
            local_addr: None,
            join_timeout: Duration::from_secs(120),
            rdzv_timeout: Duration::from_secs(60),
        }
    }

    /// The program's arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Processes on this node.
    pub fn nproc(mut self, n: u32) -> Self {
        self.nproc = n;
        self
    }

    /// This node is `node_rank` of `nnodes`; its processes are ranks
    /// `node_rank * nproc ..` of a group of `nnodes * nproc`. With more than one node, give
    /// [`Launch::rendezvous`] and [`Launch::secret_file`] (the same on every node).
    pub fn nodes(mut self, nnodes: u32, node_rank: u32) -> Self {
        self.nnodes = nnodes;
        self.node_rank = node_rank;
        self
    }

    /// The group's rendezvous: `HOST:PORT` (rank 0 serves it there), or, with the `etcd`
    /// feature, `etcd://HOST:PORT[,HOST:PORT...]/JOB`: the launchers agree in etcd, round
    /// after round, which nodes take part (node ranks are assigned there, `--node-rank` is
    /// not given), and the job outlives the loss of any node while enough launchers are
    /// left (spares included; see the etcd section of the crate docs). Default, on one node:
    /// 127.0.0.1 and a port free at each start.
    pub fn rendezvous(mut self, addr: impl Into<String>) -> Self {
        self.rdzv = Some(addr.into());
        self
    }

    /// With an etcd rendezvous: the address this node offers the others for the group's
    /// rendezvous when it is node 0 of a round (default: the address it reaches etcd from).
    pub fn local_addr(mut self, host: impl Into<String>) -> Self {
        self.local_addr = Some(host.into());
        self
    }

    /// With an etcd rendezvous: how long a round may take to gather `nnodes` launchers before
    /// this one gives up (default 120 s).
    pub fn join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = timeout;
        self
    }

    /// With a rendezvous on node 0 (`HOST:PORT`): how long the launcher of another node waits,
    /// after a failure and before it restarts anything, for that rendezvous to answer again
    /// (RDZ-1); past it the launcher ends with an error naming the rendezvous (default 60 s:
    /// node 0's host may be rebooting). A node 0 that does not come back costs the job this
    /// long.
    pub fn rendezvous_timeout(mut self, timeout: Duration) -> Self {
        self.rdzv_timeout = timeout;
        self
    }

    /// How many restarts are allowed after failures: of the whole group with
    /// [`Restart::Group`], of single processes (all ranks together) with [`Restart::Worker`].
    pub fn max_restarts(mut self, k: u32) -> Self {
        self.max_restarts = k;
        self
    }

    /// What is restarted after a failure (default: [`Restart::Group`]).
    pub fn restart(mut self, r: Restart) -> Self {
        self.restart = r;
        self
    }

    /// Read the group secret from this file (every node must use the same one). Default: the
    /// launcher's `RPC_SECRET` / `RPC_SECRET_FILE` if set, else (one node only) a fresh random
    /// secret in a private file removed at the end.
    pub fn secret_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.secret_file = Some(path.into());
        self
    }

    /// Whether each line of a child's output is prefixed with `[rank<R>]: ` (default); without,
    /// children write to the launcher's own stdout and stderr directly.
    pub fn prefix_output(mut self, yes: bool) -> Self {
        self.prefix = yes;
        self
    }

    /// How long children get to exit after SIGTERM (or a forwarded signal) before SIGKILL.
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// An extra variable for every child.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Traces the job into one file at `path` (see `rpc_core::trace`): every child records
    /// (`RPC_TRACE`), writes its part under `<path>.parts/` as it shuts down, and node 0's
    /// launcher merges the parts into `path` when the group ends (with an etcd rendezvous, the
    /// launcher that was node 0 of the last round). Each node removes earlier parts there
    /// first (with etcd none does: a spare may start after a round's parts were written), and
    /// the merge leaves out any an earlier run left (TR-7). On several nodes, every worker that
    /// shuts down cleanly also sends its part to rank 0, which writes it under its own path
    /// (TR-8), and every other node's launcher sends node 0's the parts it finds once its
    /// processes have ended, however the job ended (TR-9): no shared filesystem is needed.
    /// Node 0's launcher waits up to 15 s for the other nodes' parts before it merges. A path
    /// whose parts directory cannot be created, or that is a directory, fails the launch
    /// before any process starts.
    pub fn trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.trace = Some(path.into());
        self
    }

    /// The world size: `nnodes * nproc`.
    pub fn world_size(&self) -> u32 {
        self.nnodes.saturating_mul(self.nproc)
    }

    fn validate(&self) -> Result<(), LaunchError> {
        let bad = |m: String| Err(LaunchError::Invalid(m));
        if self.nproc == 0 || self.nnodes == 0 {
            return bad("--nproc and --nnodes must be positive".into());
        }
        if self.nnodes.checked_mul(self.nproc).is_none() {
            return bad("--nnodes x --nproc overflows".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "--node-rank {} is outside --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.nnodes > 1 && self.rdzv.is_none() {
            return bad(format!(
                "--nnodes {} needs --rdzv HOST:PORT, the address of node 0 \
                 (rank 0 serves the rendezvous there)",
                self.nnodes
            ));
        }
        if let Some(spec) = self.rdzv.as_deref().and_then(etcd::Spec::parse) {
            spec.map_err(LaunchError::Invalid)?;
            if !cfg!(feature = "etcd") {
                return bad("this rpcrun was built without etcd: \
                     cargo build --release -p rpcrun --features etcd (needs protoc)"
                    .into());
            }
            if self.node_rank != 0 {
                return bad("--node-rank is not given with an etcd rendezvous: \
                     the launchers are ranked in the order they join"
                    .into());
            }
            if self.restart == Restart::Worker {
                return bad(
                    "--restart worker needs the rendezvous in node 0's launcher: \
                     with etcd, restarts are of the group"
                        .into(),
                );
            }
            return Ok(());
        }
        if let Some(r) = &self.rdzv {
            match r.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {}
                _ => return bad(format!("--rdzv {r:?} is not HOST:PORT")),
            }
        }
        Ok(())
    }

    /// Starts the group and supervises it until it ends (see the crate docs); blocks. Refused
    /// ([`LaunchError::InsideRuntime`]) from inside an async runtime, `spawn_blocking`'s
    /// threads included.
    pub fn run(&self) -> Result<Exit, LaunchError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(LaunchError::InsideRuntime);
        }
        self.validate()?;
        let etcd = self.rdzv.as_deref().and_then(etcd::Spec::parse);
        let (mut launch, trace) = self.traced(etcd.is_some())?;
        #[cfg(feature = "etcd")]
        if let Some(spec) = etcd {
            return etcd::run(
                &launch,
                &spec.map_err(LaunchError::Invalid)?,
                trace.as_deref(),
            );
        }
        if let Some(id) = self.job_id() {
            launch.env.push((rpc_core::JOB_ID_ENV[0].to_owned(), id));
        }
        // TR-9: node 0 takes the other nodes' parts, however the job ends.
        let mut parts = parts::Parts::new(self, trace.as_deref())?;
        if let (Some(p), Some(t), Some(r)) = (&mut parts, &trace, &self.rdzv) {
            if self.node_rank == 0 {
                let host = r.rsplit_once(':').map_or(r.as_str(), |(h, _)| h);
                p.serve(host, t, &mut launch.env)?;
            }
        }
        let mut sink = None;
        let mut exit = supervise::run(&launch, &mut sink)?;
        if let Some(t) = trace {
            if let Some(p) = &mut parts {
                let (me, others) = (self.node_rank, self.nnodes as usize - 1);
                // TR-11: where a child said, so that a node left without parts says so.
                p.exchange(&t, me == 0, others, sink.as_deref(), &format!("node {me}"));
            }
            exit.trace = parts::merge_trace(&t, self.node_rank == 0);
        }
        Ok(exit)
    }

    /// The job's name for its children ([`rpc_core::JOB_ID_ENV`]), the same on every node and
    /// in every restart, another in the next launch (TR-7): the one given to this launcher
    /// (its environment, or [`Launch::env`]), else one drawn now, once per launch, by the
    /// launcher whose children serve the rendezvous (one node, or node 0 of a `--rdzv
    /// HOST:PORT` launch). The other nodes name none: their children take node 0's from the
    /// rendezvous ([`rpc_core::RendezvousServer::name_job`]). With etcd, `etcd::run` names
    /// the job's run.
    fn job_id(&self) -> Option<String> {
        let given = |k: &str| {
            let mine = self
                .env
                .iter()
                .rev()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone());
            mine.or_else(|| std::env::var(k).ok())
                .filter(|v| !v.trim().is_empty() && v != "none")
        };
        if let Some(id) = rpc_core::JOB_ID_ENV.iter().find_map(|k| given(k)) {
            return Some(id);
        }
        if self.rdzv.is_some() && self.node_rank != 0 {
            return None;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        Some(format!("rpcrun {}-{nanos:x}", std::process::id()))
    }

    /// With [`Launch::trace`]: the launch that traces its children (`RPC_TRACE` set), and the
    /// trace's absolute path; the parts' directory is made (a path that cannot be written fails
    /// the launch now, not after the whole job). Each node of a `HOST:PORT` rendezvous clears
    /// the earlier parts in its directory first: no part of this run exists before every node
    /// has started (a worker writes one only once its group formed, and the groups rpcrun
    /// starts form with all their ranks), and a node's own earlier
    /// parts, copied to node 0 by hand, would carry the same job name as this run's; on node 0,
    /// those an earlier run left unmerged are merged into `job.prev.json` first (TR-10). With
    /// etcd, where a spare may start after a round's parts were written, none clears: the
    /// merge leaves out an earlier run's parts by their job (TR-7).
    fn traced(&self, etcd: bool) -> Result<(Self, Option<PathBuf>), LaunchError> {
        let Some(trace) = &self.trace else {
            return Ok((self.clone(), None));
        };
        let system = |what| move |source| LaunchError::System { what, source };
        let trace = std::path::absolute(trace).map_err(system("the trace's path"))?;
        if !etcd {
            let kept = rpc_core::trace::clear_parts(&trace, self.node_rank == 0)
                .map_err(system("clearing the earlier trace parts"))?;
            if let Some(kept) = kept {
                eprintln!("rpcrun: {kept}");
            }
        }
        rpc_core::trace::prepare(&trace)
            .map_err(|e| LaunchError::Invalid(format!("--trace {e}")))?;
        let mut launch = self.clone();
        launch.env.push((
            rpc_core::trace::TRACE_ENV.to_owned(),
            trace.display().to_string(),
        ));
        Ok((launch, Some(trace)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Called from async code, `run` says why it cannot run there, before it starts anything
    /// (it used to panic in the rendezvous's `block_on` with `Restart::Worker`, and block a
    /// runtime thread for the whole job with `Restart::Group`).
    #[test]
    fn run_is_refused_inside_a_runtime() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let launch = Launch::new("/bin/true").nproc(1).restart(Restart::Worker);
        let err = rt.block_on(async { launch.run() }).unwrap_err();
        assert!(matches!(err, LaunchError::InsideRuntime), "{err}");
        let err = rt
            .block_on(async {
                let l = launch.clone();
                tokio::task::spawn_blocking(move || l.run()).await.unwrap()
            })
            .unwrap_err();
        assert!(matches!(err, LaunchError::InsideRuntime), "{err}");
        // Outside a runtime it runs.
        assert_eq!(launch.run().unwrap().code, 0);
    }
}
