//! The launch loop with an etcd rendezvous: join a round, run this node's processes while the
//! round holds, and end or begin the next round on their outcome (see the module's docs).

use std::net::{TcpListener, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::store::{Joiner, Store};
use super::Spec;
use crate::env::Rendezvous;
use crate::secret::SecretFile;
use crate::supervise::{run_attempt, Ended, Handlers};
use crate::{Exit, Launch, LaunchError};

/// How often etcd is read while joining, waiting, or watching a round.
const POLL: Duration = Duration::from_millis(250);

/// How long the nodes of a round get to say that their processes succeeded, once this
/// node's did.
const FINISH_WAIT: Duration = Duration::from_secs(60);

/// How long a launcher whose lease was lost tries to take a new one.
const LEASE_BACK: Duration = Duration::from_secs(30);

/// A round this launcher takes part in.
struct Round {
    gen: u64,
    restart: u32,
    /// The run's token (`job/run`; "" for a job an older launcher created).
    run: String,
    node_rank: u32,
    members: Vec<Joiner>,
    rdzv: Rendezvous,
    /// Node 0's socket for the group's rendezvous, handed to its rank 0 (RDV-8).
    held: Option<TcpListener>,
}

/// How joining ended.
enum Joined {
    Round(Round),
    /// The job ended with this status (ETC-4).
    Ended(i32),
    /// The launcher got this signal.
    Signalled(i32),
}

fn rdzv_error(why: String) -> LaunchError {
    LaunchError::Rendezvous(why)
}

/// `trace`: the job's trace, merged by the launcher that was node 0 of the last round.
pub(crate) fn run(
    launch: &Launch,
    spec: &Spec,
    trace: Option<&std::path::Path>,
) -> Result<Exit, LaunchError> {
    let secret = SecretFile::resolve(launch)?;
    let handlers = Handlers::install()?;
    // TR-9: a launcher that is node 0 of a round takes the other nodes' trace parts.
    let mut parts = crate::parts::Parts::new(launch, trace)?;
    // Launchers may start before etcd does.
    let mut store = patiently(|| Store::connect(spec))?;
    let host = local_host(launch, spec)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let id = format!("{host}-{}-{nanos:x}", std::process::id());
    let mut failures = Vec::new();
    let mut restarts = 0;
    let mut fresh = true;
    // The last round this launcher took part in, and its node rank there.
    let mut last: Option<(u64, u32)> = None;
    let ended = loop {
        let mut round = match join(&mut store, launch, &id, &host, fresh, &handlers)? {
            Joined::Round(r) => r,
            Joined::Ended(code) => break code,
            Joined::Signalled(s) => break 128 + s,
        };
        fresh = false;
        restarts = round.restart;
        let mut node = launch.clone();
        node.node_rank = round.node_rank;
        last = Some((round.gen, round.node_rank));
        // The job's run, the same on every node and in every round, another in a run on a
        // fresh etcd (TR-7).
        let base = round.gen - u64::from(round.restart);
        node.env.push((
            rpc_core::JOB_ID_ENV[0].to_owned(),
            match round.run.as_str() {
                "" => format!("{}/{base}", spec.job),
                run => format!("{}/{base}-{run}", spec.job),
            },
        ));
        if let (Some(p), Some(t), 0) = (&mut parts, trace, round.node_rank) {
            let sink = p.serve(&round.rdzv.host, t, &mut node.env)?;
            patiently(|| store.set_sink(round.gen, &sink))?;
        }
        tracing::info!(
            round = round.gen,
            restart = round.restart,
            "this node is node {} of {} (rendezvous at {}:{})",
            round.node_rank,
            launch.nnodes,
            round.rdzv.host,
            round.rdzv.port
        );
        let handed = round.held.as_ref().map(|l| l.as_raw_fd());
        let stop = AtomicBool::new(false);
        let reason = Mutex::new(None::<String>);
        let ended = std::thread::scope(|s| {
            s.spawn(|| watch(&store, &round, &stop, &reason));
            let ended = run_attempt(
                &node,
                round.restart,
                (&round.rdzv, handed),
                secret.path(),
                &handlers,
                &mut || reason.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                // The round's sink is in etcd (`round/<gen>/sink`), which every launcher reads.
                &mut None,
            );
            stop.store(true, Ordering::SeqCst);
            ended
        })?;
        drop(round.held.take());
        match ended {
            Ended::Success => match finish_round(&store, launch, &round, &handlers)? {
                Some(code) => break code,
                None => continue,
            },
            Ended::Signalled(s) => break 128 + s,
            Ended::Failed(f) => {
                let code = f.code;
                failures.push(f);
                // A failure in a round that already ended (this node was frozen or cut off
                // meanwhile) decides nothing: the job's current round does.
                let st = patiently(|| store.state())?;
                if st.gen != Some(round.gen) || st.done.is_some() {
                    continue;
                }
                if code == crate::FATAL_EXIT_CODE || round.restart >= launch.max_restarts {
                    tracing::warn!(
                        "ending the job with status {code} ({})",
                        if code == crate::FATAL_EXIT_CODE {
                            "a process said a restart cannot help".to_owned()
                        } else {
                            format!("out of restarts: {} used", round.restart)
                        }
                    );
                    patiently(|| store.finish(code))?;
                    // ETC-4: one status for every node, the first to be written.
                    break patiently(|| store.state())?.done.unwrap_or(code);
                }
                patiently(|| store.next_round(round.gen))?;
                tracing::warn!(
                    "restarting the job on every node (restart {} of {})",
                    round.restart + 1,
                    launch.max_restarts
                );
            }
            Ended::Abandoned(why) => {
                tracing::warn!("stopped this node's processes: {why}");
                if store.lease_lost().is_some() {
                    retake_lease(&mut store)?;
                }
            }
        }
    };
    // The round that ended the job, if this launcher took part in it: not a spare that never
    // ran, nor a launcher frozen through the job's last rounds (it finds the job over when it
    // thaws). Where etcd cannot say, this launcher's last round.
    let last_node = match last {
        Some((gen, node)) if trace.is_some() => match store.state() {
            Ok(st) if st.gen != Some(gen) => None,
            _ => Some(node),
        },
        _ => None,
    };
    // TR-9: where node 0 of that round takes the parts (asked while this launcher still
    // holds its lease).
    let sink = match (&parts, last, last_node) {
        (Some(_), Some((gen, _)), Some(node)) if node != 0 => store.sink(gen).ok().flatten(),
        _ => None,
    };
    store.leave();
    // Node 0 of the last round merges.
    let trace = match (trace, last_node) {
        (Some(t), Some(node)) => {
            if let Some(p) = &mut parts {
                let others = launch.nnodes as usize - 1;
                p.exchange(t, node == 0, others, sink.as_deref(), &id);
            }
            crate::parts::merge_trace(t, node == 0)
        }
        _ => None,
    };
    Ok(Exit {
        code: ended,
        restarts,
        failures,
        trace,
    })
}

/// Joins the job's current round, or waits as a spare for the next, until a round this node
/// is a member of forms (ETC-1), the job ends, or `--join-timeout` passes with too few nodes.
fn join(
    store: &mut Store,
    launch: &Launch,
    id: &str,
    host: &str,
    mut fresh: bool,
    handlers: &Handlers,
) -> Result<Joined, LaunchError> {
    let nnodes = launch.nnodes as usize;
    let mut deadline = Instant::now() + launch.join_timeout;
    let mut offered: Option<(u64, TcpListener, String)> = None;
    let mut spare_in = None;
    loop {
        if let Some(s) = handlers.received() {
            return Ok(Joined::Signalled(s));
        }
        if store.lease_lost().is_some() {
            retake_lease(store)?;
            offered = None;
        }
        let st = patiently(|| store.state())?;
        let Some(gen) = st.gen else {
            patiently(|| store.create_job())?;
            continue;
        };
        if fresh {
            fresh = false;
            let abandoned = match patiently(|| store.members(gen))? {
                Some(m) => {
                    let alive = patiently(|| store.joined(gen))?;
                    !m.iter().any(|j| alive.iter().any(|a| a.id == j.id))
                }
                None => false,
            };
            if st.done.is_some() || abandoned {
                tracing::info!(
                    "the job's last run {}; starting a new run",
                    match st.done {
                        Some(c) => format!("ended with status {c}"),
                        None => "has no launcher left".to_owned(),
                    }
                );
                patiently(|| store.new_run(gen))?;
                continue;
            }
        }
        if let Some(code) = st.done {
            tracing::info!("the job ended with status {code}");
            return Ok(Joined::Ended(code));
        }
        if offered.as_ref().map(|o| o.0) != Some(gen) {
            let l = TcpListener::bind((host, 0)).map_err(|source| LaunchError::System {
                what: "binding a port for the rendezvous",
                source,
            })?;
            let port = l.local_addr().map(|a| a.port()).unwrap_or_default();
            let addr = format!("{host}:{port}");
            patiently(|| store.join(gen, id, &addr))?;
            offered = Some((gen, l, addr));
        }
        match patiently(|| store.members(gen))? {
            Some(members) => {
                if let Some(node_rank) = members.iter().position(|j| j.id == id) {
                    let (_, listener, _) = offered.take().expect("offered above");
                    let (h, p) = members[0].addr.rsplit_once(':').unwrap_or_default();
                    return Ok(Joined::Round(Round {
                        gen,
                        restart: gen.saturating_sub(st.base) as u32,
                        run: st.run.clone(),
                        node_rank: node_rank as u32,
                        rdzv: Rendezvous {
                            host: h.to_owned(),
                            port: p.parse().unwrap_or_default(),
                        },
                        held: (node_rank == 0).then_some(listener),
                        members,
                    }));
                }
                if spare_in != Some(gen) {
                    tracing::info!("round {gen} formed without this node: waiting as a spare");
                    spare_in = Some(gen);
                }
                // A spare ends a round whose member is gone too (ETC-2), and waits as long as
                // the job runs.
                let alive = patiently(|| store.joined(gen))?;
                if let Some(gone) = members.iter().find(|j| !alive.iter().any(|a| a.id == j.id)) {
                    tracing::warn!("{} left round {gen}: beginning the next", gone.addr);
                    patiently(|| store.next_round(gen))?;
                }
                deadline = Instant::now() + launch.join_timeout;
            }
            None => {
                let joined = patiently(|| store.joined(gen))?;
                if joined.len() >= nnodes {
                    patiently(|| store.form(gen, &joined[..nnodes]))?;
                    continue;
                }
                if Instant::now() >= deadline {
                    let who: Vec<&str> = joined.iter().map(|j| j.addr.as_str()).collect();
                    return Err(rdzv_error(format!(
                        "round {gen}: {} of {nnodes} nodes joined within {} s ({})",
                        joined.len(),
                        launch.join_timeout.as_secs(),
                        who.join(", ")
                    )));
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

/// ETC-2: watches round `round` while this node's processes run; sets `reason` once they
/// must stop (a newer round, the job's end, a member gone, this node's lease lost).
fn watch(store: &Store, round: &Round, stop: &AtomicBool, reason: &Mutex<Option<String>>) {
    let set = |why: String| *reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    let gen = round.gen;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(POLL);
        if let Some(why) = store.lease_lost() {
            return set(format!(
                "this node's etcd lease is lost ({why}): the others go on without it"
            ));
        }
        let st = match store.state() {
            Ok(st) => st,
            Err(e) => {
                tracing::warn!("{e}");
                continue;
            }
        };
        if let Some(code) = st.done {
            return set(format!("the job ended elsewhere with status {code}"));
        }
        if st.gen != Some(gen) {
            return set(format!("round {gen} ended: another node restarts the job"));
        }
        let Ok(alive) = store.joined(gen) else {
            continue;
        };
        if let Some((r, gone)) = round
            .members
            .iter()
            .enumerate()
            .find(|(_, j)| !alive.iter().any(|a| a.id == j.id))
        {
            let _ = store.next_round(gen);
            return set(format!(
                "node {r} ({}) left round {gen}: its launcher's etcd lease expired",
                gone.addr
            ));
        }
    }
}

/// After this node's processes succeeded: says so, and waits for the other members (ETC-4).
/// `Some(status)` ends the launcher; `None` joins the next round (another node failed).
fn finish_round(
    store: &Store,
    launch: &Launch,
    round: &Round,
    handlers: &Handlers,
) -> Result<Option<i32>, LaunchError> {
    let gen = round.gen;
    patiently(|| store.succeeded(gen, round.node_rank))?;
    let deadline = Instant::now() + FINISH_WAIT;
    loop {
        if let Some(s) = handlers.received() {
            return Ok(Some(128 + s));
        }
        let st = patiently(|| store.state())?;
        if let Some(code) = st.done {
            return Ok(Some(code));
        }
        if st.gen != Some(gen) {
            tracing::warn!("round {gen} ended before every node finished: joining the next");
            return Ok(None);
        }
        let ok = patiently(|| store.succeeded_nodes(gen))?;
        if ok.len() >= launch.nnodes as usize {
            patiently(|| store.finish(0))?;
            let st = patiently(|| store.state())?;
            return Ok(Some(st.done.unwrap_or(0)));
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> = (0..launch.nnodes)
                .filter(|r| !ok.contains(r))
                .map(|r| r.to_string())
                .collect();
            tracing::error!(
                "nodes {} of round {gen} did not finish within {} s of this one",
                missing.join(", "),
                FINISH_WAIT.as_secs()
            );
            patiently(|| store.finish(1))?;
            return Ok(Some(1));
        }
        std::thread::sleep(POLL);
    }
}

/// Runs `f` until it succeeds, trying again for [`LEASE_BACK`] after a failure (etcd
/// restarting, electing a leader, or briefly out of reach); then its error, naming etcd.
fn patiently<T>(mut f: impl FnMut() -> Result<T, String>) -> Result<T, LaunchError> {
    let deadline = Instant::now() + LEASE_BACK;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => {
                return Err(rdzv_error(format!(
                    "{e} (tried for {} s)",
                    LEASE_BACK.as_secs()
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

/// Takes a new lease after the last one was lost, within [`LEASE_BACK`].
fn retake_lease(store: &mut Store) -> Result<(), LaunchError> {
    let deadline = Instant::now() + LEASE_BACK;
    loop {
        match store.renew_lease() {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(rdzv_error(format!(
                    "this node's etcd lease was lost and no new one could be had within {} s: {e}",
                    LEASE_BACK.as_secs()
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

/// The address this node offers for the rendezvous: `--local-addr`, else the one this
/// machine reaches etcd from.
fn local_host(launch: &Launch, spec: &Spec) -> Result<String, LaunchError> {
    if let Some(h) = &launch.local_addr {
        return Ok(h.clone());
    }
    let route = || -> std::io::Result<String> {
        let to = spec.endpoints[0]
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other("no address"))?;
        let s = UdpSocket::bind(if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
        s.connect(to)?;
        Ok(s.local_addr()?.ip().to_string())
    };
    route().map_err(|source| LaunchError::System {
        what: "finding the address that reaches etcd (give --local-addr)",
        source,
    })
}
