//! `rpcrun`: starts a group of worker processes and restarts it after a failure (see the
//! `rpcrun` library's docs).
//!
//! ```text
//! rpcrun --nproc 3 --max-restarts 3 -- target/release/hybrid-rnn --epochs 6
//! rpcrun --nproc 4 --max-restarts 5 --restart worker -- target/release/my-server
//! rpcrun --nproc 1 --nnodes 3 --node-rank 1 --rdzv node0:29500 --secret-file /shared/s -- prog
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Starts NPROC copies of PROGRAM as ranks of one group; restarts them all after a failure.
#[derive(Parser, Debug)]
#[command(name = "rpcrun", version, about)]
struct Args {
    /// Processes on this node.
    #[arg(long, default_value_t = 1)]
    nproc: u32,
    /// Nodes in the group (each runs its own rpcrun with its --node-rank).
    #[arg(long, default_value_t = 1)]
    nnodes: u32,
    /// This node's rank in 0..NNODES (not with an etcd rendezvous, which ranks the nodes).
    #[arg(long, default_value_t = 0)]
    node_rank: u32,
    /// The rendezvous: HOST:PORT on node 0 (default on one node: 127.0.0.1, a free port), or
    /// etcd://HOST:PORT[,HOST:PORT...]/JOB (built with the `etcd` feature), where the job
    /// outlives any node while enough launchers are left.
    #[arg(long)]
    rdzv: Option<String>,
    /// With an etcd rendezvous: the address this node offers the others (default: the one
    /// it reaches etcd from).
    #[arg(long)]
    local_addr: Option<String>,
    /// With an etcd rendezvous: seconds a round may take to gather NNODES launchers.
    #[arg(long, default_value_t = 120)]
    join_timeout: u64,
    /// With a rendezvous on node 0 (HOST:PORT): seconds the launchers of the other nodes wait,
    /// after a failure, for it to answer again before they give up with an error.
    #[arg(long, default_value_t = 60)]
    rdzv_timeout: u64,
    /// Restarts after failures before giving up (of the group, or of single processes).
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// What a failure restarts: `group` (every process) or `worker` (only the failed one,
    /// which rejoins the running group).
    #[arg(long, default_value = "group")]
    restart: rpcrun::Restart,
    /// File holding the group secret (needed with --nnodes > 1; default: a fresh one).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Pass the children's output on as is, without `[rank<R>]: ` prefixes.
    #[arg(long)]
    no_prefix: bool,
    /// Seconds children get to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    stop_grace_secs: f64,
    /// Trace the job into one file (Trace Event Format, for Perfetto or chrome://tracing):
    /// every rank records, and the parts are merged here when the group ends.
    #[arg(long, value_name = "PATH")]
    trace: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<std::ffi::OsString>,
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("rpcrun=info,warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
    let args = Args::parse();
    if !(args.stop_grace_secs.is_finite() && args.stop_grace_secs >= 0.0) {
        eprintln!("rpcrun: error: --stop-grace-secs must be a non-negative number");
        std::process::exit(2);
    }
    let (program, rest) = args.command.split_first().expect("clap requires one");
    let mut launch = rpcrun::Launch::new(program)
        .args(rest.iter().cloned())
        .nproc(args.nproc)
        .nodes(args.nnodes, args.node_rank)
        .max_restarts(args.max_restarts)
        .restart(args.restart)
        .prefix_output(!args.no_prefix)
        .stop_grace(Duration::from_secs_f64(args.stop_grace_secs));
    if let Some(r) = args.rdzv {
        launch = launch.rendezvous(r);
    }
    if let Some(a) = args.local_addr {
        launch = launch.local_addr(a);
    }
    launch = launch.join_timeout(Duration::from_secs(args.join_timeout));
    launch = launch.rendezvous_timeout(Duration::from_secs(args.rdzv_timeout));
    if let Some(f) = args.secret_file {
        launch = launch.secret_file(f);
    }
    if let Some(t) = args.trace {
        launch = launch.trace(t);
    }
    match launch.run() {
        Ok(exit) => std::process::exit(exit.code),
        Err(e) => {
            eprintln!("rpcrun: error: {e}");
            std::process::exit(1);
        }
    }
}
