//! Plumbing shared by the example programs: logging, and launching a group of worker processes
//! on this machine (each example's binary is also its own worker).
//!
//! A launched worker finds `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and the group
//! secret in its environment, which is also how the same binary joins a group spread over
//! several machines (the rank and world size may also come from Slurm or MPI, see
//! [`rpc_core::RANK_ENV`]).

pub mod canvas;
pub mod checkpoint;
pub mod lang;
pub mod recovery;
pub mod resume;

use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, Result};
use rpc_core::{Config, Registry, Secret};

/// An error that a restart would meet again: a flag out of range, a checkpoint written with
/// other flags, a checkpoint that cannot be written (a full disk). A program that ends with
/// one (anywhere in its error's chain) exits with [`rpcrun::FATAL_EXIT_CODE`], and the launcher
/// gives up at once instead of spending its restarts on it.
#[derive(Debug)]
pub struct Fatal(pub String);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Fatal {}

/// Whether `e` is, or was caused by, a [`Fatal`] error, or by a configuration that joining
/// the group refused (`rpc_core::InitError::Config`: a short secret, a bad address; every
/// restart would meet it again).
pub fn is_fatal(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Fatal>().is_some()
        || e.chain().any(|c| {
            c.is::<Fatal>()
                || matches!(
                    c.downcast_ref::<rpc_core::InitError>(),
                    Some(rpc_core::InitError::Config(_))
                )
        })
}

/// `x` rounded to `digits` decimals (for the JSON lines).
pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// Logs to stderr: `RUST_LOG` if set, else warnings.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Keeps freed tensor buffers in the process instead of returning them to the kernel.
///
/// glibc serves allocations of 128 KiB and more (a 64 × 512 `f32` tensor is exactly that) with
/// fresh `mmap`s and unmaps them on free, so a training step that allocates a few hundred such
/// tensors spends a third of its time in page faults. Raising the thresholds makes them reuse
/// the heap. A no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// This process's peak resident memory in MiB (`VmHWM` in `/proc/self/status`), or 0 where
/// the system does not report it.
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The runtime every example process uses: multi-threaded (so blocking `rpc_sync` works) with
/// two workers, which suits the small machines the examples run on.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Whether this process was started as a worker of a group: its environment names a rank in
/// one of the variables of [`rpc_core::RANK_ENV`] (ours, torchrun's, Slurm's, MPI's). A rank
/// that is not a number counts too, so that joining reports it.
pub fn is_worker() -> bool {
    !matches!(rpc_core::launched_rank(), Ok(None))
}

/// Worker side: joins the group described by the environment, serves `registry` until every
/// worker has called shutdown, and checks that the shutdown was clean and that the group lost
/// no worker on the way (the survivors of a failure may still shut down cleanly together, but
/// the job did not succeed: a non-zero exit lets a launcher restart this process too, also
/// when it is the only one on its node).
pub async fn serve_until_shutdown(registry: Registry, timeout: Duration) -> Result<()> {
    let (agent, report) = serve(registry, timeout).await?;
    job_outcome(&agent, &report)?;
    anyhow::ensure!(
        report.is_clean(),
        "{} shut down uncleanly: {report:?}",
        agent.name()
    );
    if let Some(f) = agent.failed_workers().first() {
        anyhow::bail!(
            "{}: the group lost `{}` (rank {}): {}",
            agent.name(),
            f.name,
            f.rank,
            f.cause
        );
    }
    Ok(())
}

/// Like [`serve_until_shutdown`] for a program that survives the loss of workers: the shutdown
/// barrier may miss workers the group declared failed (they are logged), and the process
/// succeeds if its own shutdown aborted nothing.
pub async fn serve_through_failures(registry: Registry, timeout: Duration) -> Result<()> {
    let (agent, report) = serve(registry, timeout).await?;
    check_shutdown(&agent, &report)
}

/// Joins the group the environment describes and serves until the whole group shuts down
/// (`Agent::wait_for_group`: however long the master trains).
async fn serve(
    registry: Registry,
    timeout: Duration,
) -> Result<(rpc_core::Agent, rpc_core::ShutdownReport)> {
    let cfg = Config::new()
        .with_shutdown_timeout(timeout)
        .with_rpc_timeout(timeout)
        .with_signal_grace(SIGNAL_GRACE);
    let agent = rpc_core::init(cfg, registry).await?;
    let report = agent.wait_for_group().await;
    Ok((agent, report))
}

/// How long a launched process of a training example goes on after its launcher's SIGTERM
/// (`Config::signal_grace`): long enough for the master to report the failure that made the
/// launcher stop the group, short of the launcher's 5 s before SIGKILL.
pub const SIGNAL_GRACE: Duration = Duration::from_secs(3);

/// Checks a shutdown report of a program that survives failures: nothing aborted, and a
/// barrier that is incomplete only when the group has declared some worker failed.
pub fn check_shutdown(agent: &rpc_core::Agent, report: &rpc_core::ShutdownReport) -> Result<()> {
    job_outcome(agent, report)?;
    let failed = agent.failed_workers();
    anyhow::ensure!(
        report.aborted == 0 && (report.barrier.is_ok() || !failed.is_empty()),
        "{} shut down uncleanly: {report:?}",
        agent.name()
    );
    for f in failed {
        tracing::info!(
            worker = %f.name,
            incarnation = f.incarnation,
            cause = %f.cause,
            "the group lost a worker on the way",
        );
    }
    Ok(())
}

/// Shuts `agent` down after `result`, the work it did: a failure is told to every member
/// (`Agent::shutdown_failed`), so that no process of a failed job exits 0; a [`Fatal`] one
/// says that a restart cannot help.
///
/// Under [`main_with`], a failure's error line is written first: the other members exit as
/// soon as they are told, a launcher then stops this process with SIGTERM, and the shutdown
/// can outlast the signal's grace (seen on a loaded machine: the master's line naming the
/// cause was lost, only the workers' echoes of it remained).
pub async fn shutdown_after<T>(
    agent: &rpc_core::Agent,
    result: &Result<T>,
) -> rpc_core::ShutdownReport {
    match result {
        Ok(_) => agent.shutdown().await,
        Err(e) => {
            if PROGRAM.get().is_some() {
                report_error(e);
            }
            agent.shutdown_failed(said(e), !is_fatal(e)).await
        }
    }
}

/// `e` and its causes on one line, each said once ([`rpc_core::error_chain`]): `{:#}`
/// repeats a cause whose parent's message holds it too (an I/O error under `safetensors`'
/// "I/O error: ..." was said twice).
pub fn said(e: &anyhow::Error) -> String {
    rpc_core::error_chain(e.as_ref())
}

/// The program's name under [`main_with`], for its error line.
static PROGRAM: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The error line this process wrote, if any (each is written once).
static REPORTED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Writes `e` as this process's error line (`<program>: error: ...`), unless that very line
/// was written already.
fn report_error(e: &anyhow::Error) {
    use std::io::Write;
    let name = PROGRAM.get().map_or("error", String::as_str);
    let line = format!("{name}: error: {}\n", said(e));
    let mut reported = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
    if reported.as_deref() == Some(line.as_str()) {
        return;
    }
    // One write for the whole line: the processes of a run share their stderr, and
    // `eprintln!` writes a line piece by piece (they interleaved).
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    *reported = Some(line);
}

/// The job's failure another member told this one at shutdown, as this process's error
/// ([`Fatal`] when a restart cannot help); its own failure is the caller's to report.
pub fn job_outcome(agent: &rpc_core::Agent, report: &rpc_core::ShutdownReport) -> Result<()> {
    match &report.job_failed {
        Some(f) if f.rank != agent.rank() && !f.retry => Err(Fatal(f.to_string()).into()),
        Some(f) if f.rank != agent.rank() => Err(anyhow::anyhow!("{f}")),
        _ => Ok(()),
    }
}

/// Worker processes started by a launcher; killed and reaped if the launcher stops early.
pub struct Workers {
    children: Vec<Child>,
    /// The command-line arguments every worker gets.
    args: Vec<String>,
    /// Ranks killed on purpose and not started again.
    killed: std::collections::HashSet<u32>,
    port: u16,
    /// The rendezvous's socket, bound when the port was chosen, which rank 0 serves on
    /// (RDV-8: let go, another process could take the port before rank 0 binds it).
    rendezvous: std::sync::Arc<std::net::TcpListener>,
    secret: Secret,
    world: u32,
    /// The job's trace (`--trace PATH`): every process records, the parts merge at the end.
    trace: Option<std::path::PathBuf>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Workers {
    /// Starts ranks `1..world` as copies of this binary on 127.0.0.1, with a fresh secret and a
    /// free rendezvous port (rank 0, the caller, serves the rendezvous).
    pub fn spawn(world: u32) -> Result<Self> {
        Self::spawn_with_args(world, Vec::new())
    }

    /// [`Workers::spawn`], passing `args` to every worker (and to replacements).
    pub fn spawn_with_args(world: u32, args: Vec<String>) -> Result<Self> {
        Self::spawn_traced(world, args, None)
    }

    /// [`Workers::spawn_with_args`], every process recording the job's trace at `trace` (see
    /// `rpc_core::trace`) when given: earlier parts there are removed first (those an earlier run
    /// left unmerged merged into `*.prev.json`, TR-10), and
    /// [`Workers::wait_success`] merges the parts into one file.
    pub fn spawn_traced(
        world: u32,
        args: Vec<String>,
        trace: Option<&std::path::Path>,
    ) -> Result<Self> {
        let trace = trace.map(std::path::absolute).transpose()?;
        if let Some(t) = &trace {
            // TR-10: an earlier run's unmerged parts are merged into `*.prev.json` first.
            let kept = rpc_core::trace::clear_parts(t, true)
                .context("clearing the earlier trace parts")?;
            if let Some(kept) = kept {
                eprintln!("{kept}");
            }
        }
        let rendezvous = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = rendezvous.local_addr()?.port();
        let mut w = Self {
            children: Vec::new(),
            args,
            killed: Default::default(),
            port,
            rendezvous: std::sync::Arc::new(rendezvous),
            secret: Secret::generate(),
            world,
            trace,
        };
        for rank in 1..world {
            let child = w.start(rank, 0)?;
            w.children.push(child);
        }
        Ok(w)
    }

    /// Starts a process of rank `rank` that has been restarted `restarts` times (a positive
    /// count makes it join as the replacement of a failed one, see `Config::replace`).
    fn start(&self, rank: u32, restarts: u32) -> Result<Child> {
        let mut cmd = Command::new(std::env::current_exe()?);
        if let Some(t) = &self.trace {
            cmd.env(rpc_core::trace::TRACE_ENV, t);
        }
        cmd.args(&self.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string())
            .env(
                rpc_core::SECRET_ENV,
                self.secret.as_str().context("generated secrets are text")?,
            )
            .env(rpc_core::RESTART_COUNT_ENV[0], restarts.to_string())
            .spawn()
            .context("starting a worker process")
    }

    /// The config of rank 0 (this process) in the group.
    pub fn rank0_config(&self, name: &str, timeout: Duration) -> Config {
        let mut cfg = Config::new();
        cfg.trace.clone_from(&self.trace);
        cfg.rendezvous_listener = Some(std::sync::Arc::clone(&self.rendezvous));
        cfg.with_rank(0)
            .with_world_size(self.world)
            .with_name(name)
            .with_init_method(format!("tcp://127.0.0.1:{}", self.port))
            .with_secret(self.secret.clone())
            .with_init_timeout(Duration::from_secs(60))
            .with_rpc_timeout(timeout)
            .with_shutdown_timeout(timeout)
    }

    /// Kills worker `rank` (SIGKILL) and reaps it: a failure injected on purpose.
    pub fn kill(&mut self, rank: u32) -> Result<()> {
        let c = self.child(rank)?;
        c.kill().context("killing a worker")?;
        c.wait().context("reaping a killed worker")?;
        self.killed.insert(rank);
        Ok(())
    }

    /// Starts a new process for `rank`, killed before: it joins the running group as the
    /// rank's next incarnation (the group must be served by a rendezvous that outlives its
    /// formation, as rank 0's does).
    pub fn respawn(&mut self, rank: u32) -> Result<()> {
        anyhow::ensure!(
            self.killed.contains(&rank),
            "worker {rank} was not killed, so it cannot be replaced"
        );
        let child = self.start(rank, 1)?;
        *self.child(rank)? = child;
        self.killed.remove(&rank);
        Ok(())
    }

    fn child(&mut self, rank: u32) -> Result<&mut Child> {
        rank.checked_sub(1)
            .and_then(|i| self.children.get_mut(i as usize))
            .with_context(|| format!("no worker process of rank {rank}"))
    }

    /// Waits (at most `timeout` in all) for every worker to exit; the exit status of each, by
    /// rank from 1 (an error if one did not exit in time; those still running are then
    /// killed, by `Drop`).
    pub fn wait_all(mut self, timeout: Duration) -> Result<Vec<std::process::ExitStatus>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut out = Vec::new();
        for (i, c) in self.children.iter_mut().enumerate() {
            out.push(loop {
                if let Some(status) = c.try_wait()? {
                    break status;
                }
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "worker {} did not exit within {timeout:?} of the end of the run",
                    i + 1
                );
                std::thread::sleep(Duration::from_millis(20));
            });
        }
        Ok(out)
    }

    /// Waits (at most `timeout` in all) for every worker to exit; fails if one did not exit
    /// successfully or in time (a worker killed on purpose, and not started again, is not
    /// expected to succeed).
    pub fn wait_success(self, timeout: Duration) -> Result<()> {
        let killed = self.killed.clone();
        let trace = self.trace.clone();
        let statuses = self.wait_all(timeout);
        // The parts there are, whatever became of the workers: a killed one writes none.
        if let Some(t) = trace {
            merge_trace(&t);
        }
        for (i, status) in statuses?.into_iter().enumerate() {
            let rank = i as u32 + 1;
            anyhow::ensure!(
                status.success() || killed.contains(&rank),
                "worker {rank} exited with {status}"
            );
        }
        Ok(())
    }
}

/// Merges the job's trace parts into `trace` and says so on standard error, as `rpcrun
/// --trace` does; a failure to merge is reported, never fatal.
fn merge_trace(trace: &std::path::Path) {
    match rpc_core::trace::merge_parts(trace, None) {
        Ok(s) => eprintln!("trace {}: {s}", trace.display()),
        Err(e) => eprintln!("trace not written: {e}"),
    }
}

/// The progress bar of one epoch of `epochs` over `len` steps (hidden with `quiet`).
pub fn epoch_bar(quiet: bool, len: u64, epoch: u64, epochs: u64) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "epoch {}/{epochs} [{{bar:30}}] {{pos}}/{{len}} {{msg}} ({{elapsed}}<{{eta}})",
            epoch + 1,
        ))
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    bar
}

/// A launched worker of a training example (rank > 0): serves `registry` until rank 0 shuts
/// the group down, within the seconds in the environment variable `timeout_env` (default an
/// hour). Replaced one by one (`RPC_RESTART_MODE=worker`), a worker outlives the loss of
/// others (rank 0 included: its replacement takes over), so it only fails if its own shutdown
/// does.
pub fn serve_launched(registry: Registry, timeout_env: &str) -> Result<()> {
    let timeout = std::env::var(timeout_env)
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(3600), Duration::from_secs);
    let one_by_one = std::env::var(rpc_core::RESTART_MODE_ENV).is_ok_and(|m| m == "worker");
    runtime()?.block_on(async move {
        if one_by_one {
            serve_through_failures(registry, timeout).await
        } else {
            serve_until_shutdown(registry, timeout).await
        }
    })
}

/// The local mode of a training example: this very binary, `nproc` times (the master, rank
/// 0, and its workers), as children of this process, started and restarted after failures
/// (up to `max_restarts`, by `restart`) with the launcher's code; the children's output is this
/// process's. Restarts and failures are summarized on standard error after `name`. Returns
/// the exit code of the run.
pub fn launch_here(
    name: &str,
    nproc: u32,
    max_restarts: u32,
    restart: rpcrun::Restart,
    trace: Option<&std::path::Path>,
) -> Result<i32> {
    let mut launch = rpcrun::Launch::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .nproc(nproc)
        .max_restarts(max_restarts)
        .restart(restart)
        .prefix_output(false);
    if let Some(t) = trace {
        launch = launch.trace(t);
    }
    let exit = launch.run()?;
    if exit.restarts > 0 || !exit.failures.is_empty() {
        eprintln!(
            "{name}: {} restart(s); failures: {}",
            exit.restarts,
            exit.failures
                .iter()
                .map(|f| format!("rank {} {}", f.rank, f.what))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    Ok(exit.code)
}

/// The `main` of a training example: tracing, the allocator settings, one compute thread per
/// process (several processes share the machine, and one-process baselines measure the same
/// thread count; set before any other thread exists), then `run`; an error is printed with
/// `name` and exits 1 ([`rpcrun::FATAL_EXIT_CODE`] for a [`Fatal`] one), otherwise the process
/// exits with `run`'s code.
pub fn main_with(name: &str, run: impl FnOnce() -> Result<i32>) -> ! {
    init_tracing();
    keep_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let _ = PROGRAM.set(name.to_owned());
    let code = match run() {
        Ok(code) => code,
        Err(e) => {
            report_error(&e);
            if is_fatal(&e) {
                rpcrun::FATAL_EXIT_CODE
            } else {
                1
            }
        }
    };
    std::process::exit(code);
}
