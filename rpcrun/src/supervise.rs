//! The launch loops: start every process, watch them, and on a failure either stop them all
//! and start them again ([`Restart::Group`]) or start only the failed one again, which rejoins
//! the running group ([`Restart::Worker`]), while restarts are left; stop them all on a signal.

use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::child::{self, Child};
use crate::env::{child_env, Rendezvous};
use crate::secret::SecretFile;
use crate::{Exit, Failure, Launch, LaunchError, Restart};

/// How often children are checked.
const POLL: Duration = Duration::from_millis(10);

/// Signals forwarded to the children.
const FORWARDED: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// How one attempt ended.
pub(crate) enum Ended {
    /// Every child exited with status 0.
    Success,
    /// A child failed; the others were stopped.
    Failed(Failure),
    /// The launcher got this signal; it was forwarded and every child stopped.
    Signalled(i32),
    /// The attempt's `abort` said why every child had to stop (etcd: ETC-2); they were.
    Abandoned(String),
}

/// The launcher's signal handlers, removed on drop.
pub(crate) struct Handlers {
    got: Arc<AtomicUsize>,
    ids: Vec<signal_hook::SigId>,
}

impl Handlers {
    pub(crate) fn install() -> Result<Self, LaunchError> {
        let got = Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::new();
        for s in FORWARDED {
            let id = signal_hook::flag::register_usize(s, Arc::clone(&got), s as usize).map_err(
                |source| LaunchError::System {
                    what: "installing signal handlers",
                    source,
                },
            )?;
            ids.push(id);
        }
        Ok(Self { got, ids })
    }

    /// The signal received, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        match self.got.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Supervises the launch (see the crate docs); `sink` gets where node 0's launcher takes the
/// job's trace parts, if a child said (TR-11).
pub(crate) fn run(launch: &Launch, sink: &mut Option<String>) -> Result<Exit, LaunchError> {
    if launch.restart == Restart::Worker {
        return run_workers(launch, sink);
    }
    let secret = SecretFile::resolve(launch)?;
    let handlers = Handlers::install()?;
    let mut failures = Vec::new();
    let mut attempt = 0;
    loop {
        // Held for the attempt: rank 0 serves the rendezvous on it (RDV-8).
        let (rdzv, held) = rendezvous(launch)?;
        tracing::info!(
            attempt,
            nproc = launch.nproc,
            world_size = launch.world_size(),
            master = %format!("{}:{}", rdzv.host, rdzv.port),
            "starting {} processes", launch.nproc
        );
        let handed = held.as_ref().map(|l| l.as_raw_fd());
        let ended = run_attempt(
            launch,
            attempt,
            (&rdzv, handed),
            secret.path(),
            &handlers,
            &mut || None,
            sink,
        )?;
        let code = match ended {
            Ended::Success => 0,
            Ended::Signalled(s) => {
                tracing::warn!("stopped every process on {}", child::signal_name(s));
                128 + s
            }
            // No abort was given: nothing abandons this attempt.
            Ended::Abandoned(why) => {
                tracing::error!("stopped every process: {why}");
                1
            }
            Ended::Failed(f) => {
                let code = f.code;
                failures.push(f);
                if code == crate::FATAL_EXIT_CODE {
                    tracing::warn!(
                        "a process said a restart cannot help (status {code}); not restarting"
                    );
                    code
                } else if attempt >= launch.max_restarts {
                    if launch.max_restarts > 0 {
                        tracing::warn!(
                            "out of restarts ({} used); \
                             exiting with the last failure's status {code}",
                            launch.max_restarts
                        );
                    }
                    code
                } else {
                    match rendezvous_back(launch, &rdzv, secret.path()) {
                        Err(why) => {
                            // RDZ-1: the group's rendezvous (rank 0's, on node 0) is gone.
                            tracing::error!("{why}; not restarting");
                            failures.push(Failure {
                                attempt,
                                rank: launch.node_rank * launch.nproc,
                                code: 1,
                                what: why,
                            });
                            1
                        }
                        Ok(Back::Ended) => {
                            tracing::info!("{JOB_ENDED}; not restarting");
                            0
                        }
                        Ok(Back::Answered) => {
                            attempt += 1;
                            tracing::warn!(
                                "restarting all {} processes (restart {attempt} of {})",
                                launch.nproc,
                                launch.max_restarts
                            );
                            continue;
                        }
                    }
                }
            }
        };
        return Ok(Exit {
            code,
            restarts: attempt,
            failures,
            trace: None,
        });
    }
}

/// RDZ-1: before a group restart on a node other than 0, the rendezvous must answer (a connection
/// and the authenticated handshake, `rpc_core::probe_rendezvous`) within the launch's rendezvous
/// timeout (`Launch::rendezvous_timeout`, 60 s unless set: with `--restart group` rank 0's process
/// hosts it, and node 0's launcher restarts that too: it is back within seconds; with `--restart
/// worker` node 0's launcher hosts it and it never left; only a node 0 gone or frozen keeps it
/// silent that long). Without it, each restart's processes waited their whole init timeout (120 s
/// in the examples) for a rendezvous whose host was dead or frozen, restart after restart. `Err`
/// names the address and the last cause.
fn rendezvous_back(
    launch: &Launch,
    rdzv: &Rendezvous,
    secret: &std::path::Path,
) -> Result<Back, String> {
    if launch.nnodes <= 1 || launch.node_rank == 0 {
        return Ok(Back::Answered);
    }
    let addr = format!("{}:{}", rdzv.host, rdzv.port);
    let secret = rpc_core::Secret::from_file(secret).map_err(|e| format!("{e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting a runtime to reach the rendezvous: {e}"))?;
    let deadline = Instant::now() + launch.rdzv_timeout;
    // At least one try, however short the timeout; no try outlasts the deadline by more than
    // half a second (a frozen rendezvous holds a handshake until its bound).
    let last = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let tried = rt.block_on(rpc_core::probe_rendezvous(
            &rpc_core::Transport::Tcp,
            &addr,
            &secret,
            left.clamp(Duration::from_millis(500), Duration::from_secs(5)),
        ));
        match tried {
            Ok(()) => return Ok(Back::Answered),
            Err(rpc_core::InitError::JobEnded { .. }) => return Ok(Back::Ended),
            Err(e) if Instant::now() + PROBE_PAUSE >= deadline => break rpc_core::error_chain(&e),
            Err(_) => std::thread::sleep(PROBE_PAUSE),
        }
    };
    Err(format!(
        "the rendezvous at {addr} did not answer within {:.0} s of the failure (its host is down, \
         frozen or cut off): {last}",
        launch.rdzv_timeout.as_secs_f64()
    ))
}

/// The pause between two tries to reach the rendezvous.
const PROBE_PAUSE: Duration = Duration::from_millis(200);

/// How a launcher says that the job ended before it restarted a process (RDZ-2).
const JOB_ENDED: &str = "the job ended meanwhile (the rendezvous says so)";

/// How long node 0's launcher, its processes done, waits for the other members to go.
const SETTLE: Duration = Duration::from_secs(5);

/// How long node 0's launcher then keeps telling the launchers of ranks still running or lost
/// that the job ended (RDZ-2): each hears it when it next asks, within its child's failure
/// timeout and the kill.
const LINGER: Duration = Duration::from_secs(15);

/// RDZ-2 (`--restart worker`, node 0, its processes done): waits up to [`SETTLE`] for the
/// members still linked to the rendezvous to go; if some are linked then, or `lost` (failed,
/// no successor: their launchers may be about to restart them), the rendezvous says that the
/// job has ended to whoever asks and closes the links still open (`RendezvousServer::end`,
/// RDV-10), for [`LINGER`], unless a signal comes. Before, node 0's launcher exited at once: a
/// launcher that restarted a rank lost near the end, or whose replacement had just joined,
/// found no rendezvous, waited 60 s (RDZ-1) and exited 1 for a job that had succeeded.
fn linger(
    server: &rpc_core::RendezvousServer,
    lost: &std::collections::BTreeSet<u32>,
    handlers: &Handlers,
) {
    let settle = Instant::now() + SETTLE;
    while !server.linked_ranks().is_empty()
        && Instant::now() < settle
        && handlers.received().is_none()
    {
        std::thread::sleep(POLL);
    }
    let linked = server.linked_ranks();
    if linked.is_empty() && lost.is_empty() {
        return;
    }
    server.end();
    tracing::info!(
        ?linked,
        ?lost,
        "the job ended here with ranks still running or lost; telling their launchers for {} s",
        LINGER.as_secs()
    );
    let until = Instant::now() + LINGER;
    while Instant::now() < until && handlers.received().is_none() {
        std::thread::sleep(POLL);
    }
}

/// What the rendezvous said when a launcher asked before a restart.
#[derive(Debug, PartialEq, Eq)]
enum Back {
    /// It answers: restart.
    Answered,
    /// RDZ-2: the job has ended (node 0's launcher said so): nothing to restart.
    Ended,
}

/// Where the group meets in this attempt: the given address, else a free port of 127.0.0.1,
/// with the socket bound to it, which the launcher keeps until whoever serves the rendezvous
/// takes it over (RDV-8: let go, any process on the host could take the port in between).
fn rendezvous(launch: &Launch) -> Result<(Rendezvous, Option<TcpListener>), LaunchError> {
    if let Some(hp) = &launch.rdzv {
        let (host, port) = hp.rsplit_once(':').expect("validated");
        let rdzv = Rendezvous {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port: port.parse().expect("validated"),
        };
        return Ok((rdzv, None));
    }
    let system = |source| LaunchError::System {
        what: "binding a free port for the rendezvous",
        source,
    };
    let held = TcpListener::bind("127.0.0.1:0").map_err(system)?;
    let port = held.local_addr().map_err(system)?.port();
    let rdzv = Rendezvous {
        host: "127.0.0.1".into(),
        port,
    };
    Ok((rdzv, Some(held)))
}

/// Starts this node's processes and supervises them until they all succeed, one fails, the
/// launcher gets a signal, or `abort` says why they must stop; `sink` as in [`run`].
pub(crate) fn run_attempt(
    launch: &Launch,
    attempt: u32,
    (rdzv, handed): (&Rendezvous, Option<RawFd>),
    secret: &std::path::Path,
    handlers: &Handlers,
    abort: &mut dyn FnMut() -> Option<String>,
    sink: &mut Option<String>,
) -> Result<Ended, LaunchError> {
    let mut children = spawn_all(launch, |local| {
        let env = child_env(launch, local, attempt, rdzv, Some(secret));
        let rank = launch.node_rank * launch.nproc + local;
        // Rank 0 serves the rendezvous, on the socket held for it if there is one.
        Child::spawn(launch, rank, &env, handed.filter(|_| rank == 0))
    })?;
    loop {
        note_sink(&children, sink);
        if let Some(s) = forward_signal(handlers, &mut children, launch) {
            return Ok(Ended::Signalled(s));
        }
        if let Some(why) = abort() {
            child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
            return Ok(Ended::Abandoned(why));
        }
        let mut running = 0;
        for c in &mut children {
            c.check();
            match c.try_wait() {
                None => running += 1,
                Some(st) if st.success() => {}
                Some(st) => {
                    let (code, what) = c.describe(st);
                    tracing::warn!("rank {} (pid {}) {what}", c.rank, c.pid());
                    let failure = Failure {
                        attempt,
                        rank: c.rank,
                        code,
                        what,
                    };
                    child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                    return Ok(Ended::Failed(failure));
                }
            }
        }
        if running == 0 {
            child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
            return Ok(Ended::Success);
        }
        std::thread::sleep(POLL);
    }
}

/// TR-11: where node 0's launcher takes the job's trace parts, once a child has said.
fn note_sink(children: &[Child], sink: &mut Option<String>) {
    if sink.is_none() {
        *sink = children.iter().find_map(Child::sink).map(str::to_owned);
    }
}

/// Starts every local process with `spawn` (given its local rank); if one cannot start, those
/// started are stopped.
fn spawn_all(
    launch: &Launch,
    spawn: impl Fn(u32) -> Result<Child, LaunchError>,
) -> Result<Vec<Child>, LaunchError> {
    let mut children = Vec::new();
    for local in 0..launch.nproc {
        match spawn(local) {
            Ok(c) => children.push(c),
            Err(e) => {
                child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                return Err(e);
            }
        }
    }
    Ok(children)
}

/// The signal the launcher got, if any, after forwarding it to every child and stopping them.
fn forward_signal(handlers: &Handlers, children: &mut [Child], launch: &Launch) -> Option<i32> {
    let s = handlers.received()?;
    tracing::warn!(
        "got {}; forwarding it to every process",
        child::signal_name(s)
    );
    child::stop_all(children, s, launch.stop_grace);
    Some(s)
}

/// How long the rendezvous this launcher hosts waits for the group to form.
const FORM_TIMEOUT: Duration = Duration::from_secs(120);

/// [`Restart::Worker`]: only a failed process is started again; it rejoins the running group.
fn run_workers(launch: &Launch, sink: &mut Option<String>) -> Result<Exit, LaunchError> {
    let secret = SecretFile::resolve(launch)?;
    let handlers = Handlers::install()?;
    let (rdzv, held) = rendezvous(launch)?;
    let system = |what| move |source| LaunchError::System { what, source };
    // The rendezvous (node 0's launcher hosts it) and what it decides about local ranks.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(system("starting the rendezvous's runtime"))?;
    let (verdicts_tx, verdicts) = std::sync::mpsc::sync_channel::<rpc_core::MembershipEvent>(1024);
    let rdzv_server = if launch.node_rank == 0 {
        let key = rpc_core::Secret::from_file(secret.path()).map_err(|e| LaunchError::Secret {
            path: secret.path().display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let loopback = rdzv.host == "localhost"
            || rdzv
                .host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        let host = if loopback {
            rdzv.host.as_str()
        } else {
            "0.0.0.0"
        };
        let bind = format!("{host}:{}", rdzv.port);
        let server = match held {
            // RDV-8: the port chosen here, never let go.
            Some(l) => rt.block_on(async {
                rpc_core::RendezvousServer::adopt(l, key, launch.world_size(), FORM_TIMEOUT)
            }),
            None => rt.block_on(rpc_core::RendezvousServer::start(
                &rpc_core::Transport::Tcp,
                &bind,
                key,
                launch.world_size(),
                FORM_TIMEOUT,
            )),
        }
        .map_err(|e| LaunchError::System {
            what: "starting the rendezvous",
            source: std::io::Error::other(e.to_string()),
        })?;
        // TR-7: the job's name for the other nodes' processes, which their launchers name none.
        if let Some((_, job)) =
            (launch.env.iter().rev()).find(|(k, _)| k == rpc_core::JOB_ID_ENV[0])
        {
            server.name_job(job);
        }
        // TR-9: node 0's sink for the other nodes' trace parts, named to them likewise.
        if let Some((_, sink)) =
            (launch.env.iter().rev()).find(|(k, _)| k == rpc_core::trace::TRACE_SINK_ENV)
        {
            server.trace_sink(sink);
        }
        let mut events = server.subscribe();
        rt.spawn(async move {
            loop {
                match events.recv().await {
                    Ok(e) => {
                        if verdicts_tx.try_send(e).is_err() {
                            tracing::warn!("membership events dropped: the launcher is behind");
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!("{n} membership events dropped: the launcher is behind");
                    }
                    Err(_) => return,
                }
            }
        });
        Some(server)
    } else {
        None
    };
    let first_rank = launch.node_rank * launch.nproc;
    // A restarted process gets the token of the one it replaces (RDV-5).
    let spawn = |local: u32, count: u32, token: Option<String>| {
        let mut env = child_env(launch, local, count, &rdzv, Some(secret.path()));
        env.push((rpc_core::SERVE_RENDEZVOUS_ENV.to_owned(), "0".to_owned()));
        if let Some(t) = token {
            env.push((rpc_core::REPLACE_TOKEN_ENV.to_owned(), t));
        }
        Child::spawn(launch, first_rank + local, &env, None)
    };
    tracing::info!(
        nproc = launch.nproc,
        world_size = launch.world_size(),
        master = %format!("{}:{}", rdzv.host, rdzv.port),
        "starting {} processes (a failed one is restarted alone)", launch.nproc
    );
    let mut children = spawn_all(launch, |local| spawn(local, 0, None))?;
    // Per local rank: how often it was restarted, the incarnation its running process holds
    // (`None` until a restarted one has joined), and whether it finished.
    let mut counts = vec![0u32; launch.nproc as usize];
    let mut incarnation: Vec<Option<u64>> = vec![Some(0); launch.nproc as usize];
    let mut done = vec![false; launch.nproc as usize];
    let mut failures = Vec::new();
    let mut restarts = 0;
    // Node 0: the ranks (of any node) whose last incarnation failed and has no successor yet.
    let mut lost = std::collections::BTreeSet::new();
    loop {
        note_sink(&children, sink);
        if let Some(s) = forward_signal(&handlers, &mut children, launch) {
            let code = 128 + s;
            return Ok(Exit {
                code,
                restarts,
                failures,
                trace: None,
            });
        }
        while let Ok(e) = verdicts.try_recv() {
            match e.change {
                rpc_core::MembershipChange::Failed { .. } => {
                    lost.insert(e.rank);
                }
                rpc_core::MembershipChange::Joined { .. } => {
                    lost.remove(&e.rank);
                }
                _ => {}
            }
            let Some(local) = e.rank.checked_sub(first_rank).filter(|l| *l < launch.nproc) else {
                continue;
            };
            let l = local as usize;
            match e.change {
                rpc_core::MembershipChange::Joined { .. } => incarnation[l] = Some(e.incarnation),
                rpc_core::MembershipChange::Failed { cause, .. }
                    if incarnation[l] == Some(e.incarnation)
                        && children[l].try_wait().is_none() =>
                {
                    let why = format!("the group declared rank {} failed ({cause})", e.rank);
                    children[l].end(why, Instant::now());
                }
                _ => {}
            }
        }
        for l in 0..children.len() {
            if done[l] {
                continue;
            }
            children[l].check();
            let Some(st) = children[l].try_wait() else {
                continue;
            };
            if st.success() {
                done[l] = true;
                continue;
            }
            let (code, what) = children[l].describe(st);
            let rank = children[l].rank;
            tracing::warn!("rank {rank} (pid {}) {what}", children[l].pid());
            failures.push(Failure {
                attempt: counts[l],
                rank,
                code,
                what,
            });
            let fatal = code == crate::FATAL_EXIT_CODE;
            if fatal {
                tracing::warn!(
                    "a process said a restart cannot help (status {code}); not restarting"
                );
            }
            if fatal || restarts >= launch.max_restarts {
                if launch.max_restarts > 0 && !fatal {
                    tracing::warn!(
                        "out of restarts ({} used); exiting with the last failure's status {code}",
                        launch.max_restarts
                    );
                }
                child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                return Ok(Exit {
                    code,
                    restarts,
                    failures,
                    trace: None,
                });
            }
            match rendezvous_back(launch, &rdzv, secret.path()) {
                Err(why) => {
                    // RDZ-1: node 0's launcher, which hosts the rendezvous, is gone.
                    tracing::error!("{why}; not restarting");
                    failures.push(Failure {
                        attempt: counts[l],
                        rank,
                        code: 1,
                        what: why,
                    });
                    child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                    return Ok(Exit {
                        code: 1,
                        restarts,
                        failures,
                        trace: None,
                    });
                }
                Ok(Back::Ended) => {
                    // RDZ-2: the group finished without this rank.
                    tracing::info!("{JOB_ENDED}; not restarting rank {rank}");
                    done[l] = true;
                    continue;
                }
                Ok(Back::Answered) => {}
            }
            restarts += 1;
            counts[l] += 1;
            incarnation[l] = None;
            tracing::warn!(
                "restarting rank {rank} alone (restart {restarts} of {})",
                launch.max_restarts
            );
            let token = children[l].replace_token();
            match spawn(l as u32, counts[l], token) {
                Ok(c) => children[l] = c,
                Err(e) => {
                    child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
                    return Err(e);
                }
            }
        }
        if done.iter().all(|d| *d) {
            child::stop_all(&mut children, libc::SIGTERM, launch.stop_grace);
            if let Some(server) = &rdzv_server {
                linger(server, &lost, &handlers);
            }
            return Ok(Exit {
                code: 0,
                restarts,
                failures,
                trace: None,
            });
        }
        std::thread::sleep(POLL);
    }
}
