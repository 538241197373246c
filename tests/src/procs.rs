//! Running groups of worker processes from a test: each child is killed and reaped when the
//! test ends, however it ends, and what the children print comes back line by line.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rpc_core::{RendezvousServer, Secret, Transport};

/// Children that are killed and reaped when the test ends, however it ends.
pub struct Procs {
    /// The children, by rank.
    pub children: Vec<Child>,
    lines: mpsc::Receiver<(u32, String)>,
    seen: Vec<(u32, String)>,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Procs {
    /// Waits for a line from `rank` starting with `prefix`; returns the rest. Lines read
    /// meanwhile are kept for later calls.
    pub fn expect(&mut self, rank: u32, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(i) = self
                .seen
                .iter()
                .position(|(r, l)| *r == rank && l.starts_with(prefix))
            {
                let (_, line) = self.seen.remove(i);
                return line[prefix.len()..].trim().to_owned();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((r, line)) => {
                    eprintln!("[rank {r}] {line}");
                    self.seen.push((r, line));
                }
                Err(_) => panic!("no `{prefix}` line from rank {rank} within {within:?}"),
            }
        }
    }

    /// Whether `rank` has printed a line starting with `prefix` (among those printed so far,
    /// without waiting).
    pub fn has_line(&mut self, rank: u32, prefix: &str) -> bool {
        while let Ok((r, line)) = self.lines.try_recv() {
            eprintln!("[rank {r}] {line}");
            self.seen.push((r, line));
        }
        self.seen
            .iter()
            .any(|(r, l)| *r == rank && l.starts_with(prefix))
    }

    /// Sends signal `sig` (`libc::SIGSTOP`, `SIGCONT`, `SIGKILL`) to `children[child]` (the
    /// child of that rank when [`start`] started them).
    pub fn signal(&self, child: usize, sig: i32) {
        let pid = self.children[child].id() as i32;
        // SAFETY: kill(2) on a child this test started and has not reaped yet.
        let r = unsafe { libc::kill(pid, sig) };
        assert_eq!(
            r,
            0,
            "kill({pid}, {sig}): {}",
            std::io::Error::last_os_error()
        );
    }

    /// Waits (bounded) for every child to exit; returns their exit codes.
    pub fn wait_all(&mut self, within: Duration) -> Vec<Option<i32>> {
        let deadline = Instant::now() + within;
        let mut codes = vec![None; self.children.len()];
        while Instant::now() < deadline && codes.iter().any(Option::is_none) {
            for (i, c) in self.children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    if let Ok(Some(s)) = c.try_wait() {
                        codes[i] = Some(s.code().unwrap_or(-1));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        codes
    }
}

/// A rendezvous for a group of `size` on 127.0.0.1, served by the returned runtime (30 s to
/// form), with a fresh secret.
pub fn rendezvous(
    size: impl Into<rpc_core::GroupSize>,
) -> (tokio::runtime::Runtime, RendezvousServer, Secret) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let secret = Secret::generate();
    let server = rt
        .block_on(RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret.clone(),
            size,
            Duration::from_secs(30),
        ))
        .unwrap();
    (rt, server, secret)
}

/// Starts one `program` process per scenario (rank = position) against a rendezvous this
/// process hosts, with the group secret in `RPC_SECRET` and `env` set; lines they print come
/// back through [`Procs::expect`]. The runtime hosts the rendezvous until everyone joined.
pub fn start(
    program: &str,
    scenarios: &[&str],
    env: &[(&str, &str)],
) -> (tokio::runtime::Runtime, Procs) {
    let world = scenarios.len() as u32;
    let (rt, server, secret) = rendezvous(world);
    let addr = server.local_addr().to_owned();
    // The server runs on `rt` until every worker joined.
    std::mem::forget(server);
    let ranks: Vec<(u32, &str)> = scenarios
        .iter()
        .enumerate()
        .map(|(rank, s)| (rank as u32, *s))
        .collect();
    let procs = spawn(program, &ranks, world, &addr, &secret, env);
    (rt, procs)
}

/// Starts one `program` process per `(rank, scenario)` of a group of `world` whose rendezvous
/// is at `rendezvous` (the other ranks are the caller's business, e.g. agents in this
/// process). `children` are in the order given.
pub fn spawn(
    program: &str,
    ranks: &[(u32, &str)],
    world: u32,
    rendezvous: &str,
    secret: &Secret,
    env: &[(&str, &str)],
) -> Procs {
    spawn_commands(
        ranks
            .iter()
            .map(|&(rank, scenario)| {
                let mut cmd = Command::new(program);
                cmd.args(worker_args(scenario, rank, world, rendezvous))
                    .env("RPC_SECRET", secret.as_str().expect("a textual secret"))
                    .envs(env.iter().copied());
                (rank, cmd)
            })
            .collect(),
    )
}

/// The arguments of a worker binary of this crate: `<scenario> --rank R --world N
/// --rendezvous ADDR`.
pub fn worker_args(scenario: &str, rank: u32, world: u32, rendezvous: &str) -> Vec<String> {
    vec![
        scenario.to_owned(),
        "--rank".to_owned(),
        rank.to_string(),
        "--world".to_owned(),
        world.to_string(),
        "--rendezvous".to_owned(),
        rendezvous.to_owned(),
    ]
}

/// What a worker binary of this crate was started with ([`worker_args`], read back).
pub struct WorkerArgs {
    /// What the worker does.
    pub scenario: String,
    /// Its rank.
    pub rank: u32,
    /// The group's size.
    pub world: u32,
    /// The rendezvous address (`host:port`).
    pub rendezvous: String,
    all: Vec<String>,
}

impl WorkerArgs {
    /// This process's arguments.
    pub fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        let all: Vec<String> = std::env::args().collect();
        let scenario = all
            .get(1)
            .context("usage: <worker> <scenario> --rank R --world N --rendezvous ADDR")?
            .clone();
        let flag = |name: &str| -> anyhow::Result<String> {
            let i = all
                .iter()
                .position(|a| a == name)
                .with_context(|| format!("missing {name}"))?;
            all.get(i + 1)
                .cloned()
                .with_context(|| format!("{name} needs a value"))
        };
        Ok(Self {
            rank: flag("--rank")?.parse()?,
            world: flag("--world")?.parse()?,
            rendezvous: flag("--rendezvous")?,
            scenario,
            all,
        })
    }

    /// Whether `flag` was given.
    pub fn has(&self, flag: &str) -> bool {
        self.all.iter().any(|a| a == flag)
    }

    /// The configuration every worker binary starts from: its rank in the group at the
    /// rendezvous (served elsewhere), 30 s to join, `shutdown` to wait at the barrier.
    pub fn config(&self, shutdown: Duration) -> rpc_core::Config {
        rpc_core::Config::new()
            .with_rank(self.rank)
            .with_world_size(self.world)
            .with_init_method(format!("tcp://{}", self.rendezvous))
            .with_serve_rendezvous(false)
            .with_init_timeout(Duration::from_secs(30))
            .with_shutdown_timeout(shutdown)
    }
}

/// Prints `line` for the test that started this worker and flushes it at once (the test
/// reads it with [`Procs::expect`]).
pub fn say(line: String) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Starts each command (tagged with its rank), its standard output read line by line (see
/// [`Procs::expect`]); `children` are in the order given.
pub fn spawn_commands(commands: Vec<(u32, Command)>) -> Procs {
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    for (rank, mut cmd) in commands {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((rank, line));
            }
        });
        children.push(child);
    }
    Procs {
        children,
        lines,
        seen: Vec::new(),
    }
}
