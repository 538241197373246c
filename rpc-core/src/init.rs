//! Forming the group: [`init`] binds this worker's listeners, meets every peer at the
//! rendezvous, builds the worker's state ([`Inner`]) and starts serving.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::config::Config;
use crate::error::InitError;
use crate::group::Group;
use crate::layers::Layers;
use crate::lifecycle::Lifecycle;
use crate::net::{Directory, Net, Standing, WorkerFailed};
use crate::rendezvous::{self, Join, RendezvousServer, Report};
use crate::shutdown::state::State as ShutdownState;
use crate::state::{Agent, Callee, Caller, Inner, Registry};

/// Forms the group: binds this worker's listener, meets every peer at the rendezvous, and
/// starts serving `registry`. Returns once every rank is known.
///
/// Must run inside a Tokio runtime; the agent's tasks run on it.
///
/// # Cancel safety
/// Not cancel safe: dropping the future mid-way leaves this rank missing from the rendezvous,
/// which then fails for the other ranks with this rank named.
pub async fn init(config: Config, mut registry: Registry) -> Result<Agent, InitError> {
    crate::config::warn_of_near_misses();
    let cfg = config.resolve()?;
    // The framework's own functions.
    registry.insert_internal::<crate::dispatch::CancelCall>();
    registry.insert_internal::<crate::shutdown::ShutdownBarrier>();
    registry.insert_internal::<crate::trace::TraceClock>();
    registry.insert_internal::<crate::trace::TraceWanted>();
    registry.insert_internal::<crate::trace::TracePart>();
    registry.insert_internal::<crate::view_sync::KnowsIncarnation>();
    let net_cfg = &cfg.net;
    let bind_error = |source| InitError::Bind {
        addr: cfg.listen_addr.clone(),
        source,
    };
    let listener = net_cfg
        .transport
        .bind(&cfg.listen_addr)
        .await
        .map_err(bind_error)?;
    let my_addr = listener.local_addr().map_err(bind_error)?;
    // The failure detector's own listener, on the same host, served by its own thread.
    let heartbeats = if net_cfg.heartbeat_interval.is_zero() {
        None
    } else {
        let host = cfg.listen_addr.rsplit_once(':').map_or("", |(h, _)| h);
        let addr = format!("{host}:0");
        let l = net_cfg
            .transport
            .bind_detached(&addr)
            .map_err(|source| InitError::Bind { addr, source })?;
        Some(l)
    };
    let heartbeat_addr = match &heartbeats {
        Some(l) => l.local_addr().map_err(bind_error)?,
        None => String::new(),
    };
    let server = if cfg.serve_rendezvous {
        let (t, secret) = (&net_cfg.transport, net_cfg.secret.clone());
        Some(match &cfg.rendezvous_listener {
            Some(l) => {
                let l = l.try_clone().map_err(|source| InitError::Bind {
                    addr: cfg.rendezvous.clone(),
                    source,
                })?;
                RendezvousServer::adopt(l, secret, cfg.size, cfg.init_timeout)?
            }
            None => {
                RendezvousServer::start(t, &cfg.rendezvous, secret, cfg.size, cfg.init_timeout)
                    .await?
            }
        })
    } else {
        None
    };
    // TR-7: the job's name from this process's launcher, for the members whose launcher gave
    // them none (the other nodes' of an `rpcrun HOST:PORT` launch).
    if let (Some(s), Some(job)) = (&server, &cfg.job_id) {
        s.name_job(job);
    }
    // TR-9: node 0's launcher's sink, for the members its launcher did not name it to.
    if let (Some(s), Some(sink)) = (&server, &cfg.trace_sink) {
        s.trace_sink(sink);
    }
    let join = Join {
        name: cfg.name.clone(),
        rank: net_cfg.rank,
        size: cfg.size,
        addr: my_addr,
        heartbeat: heartbeat_addr,
        replace: cfg.replace,
        token: cfg.replace_token.clone(),
        resume: None,
    };
    let redial = rendezvous::Redial {
        transport: net_cfg.transport.clone(),
        addr: cfg.rendezvous.clone(),
        secret: net_cfg.secret.clone(),
        protection: net_cfg.protection,
        me: join.clone(),
    };
    let (view, link, token) = rendezvous::join(
        &net_cfg.transport,
        &cfg.rendezvous,
        &net_cfg.secret,
        net_cfg.protection,
        join,
        cfg.init_timeout,
    )
    .await?;
    let me = net_cfg.rank;
    let mut net_cfg = cfg.net;
    net_cfg.incarnation = view.members[me as usize].endpoint.incarnation;
    let standing: Vec<_> = view.members.iter().map(|m| m.standing.clone()).collect();
    let directory = Arc::new(Directory::new(
        view.members
            .into_iter()
            .map(|m| (m.standing != Standing::Vacant).then_some(m.endpoint))
            .collect(),
    ));
    let life = Arc::new(Lifecycle::new());
    // Bounded: reports are a worker's few verdicts and one leave; one that finds the queue
    // full is dropped (the rendezvous hears of it from another member).
    let (reports, reports_rx) = mpsc::channel(256);
    let incarnation = net_cfg.incarnation;
    let tracer = cfg.tracer;
    let sink = (cfg.trace_sink.clone()).or_else(|| view.sink.clone());
    if let Some(sink) = sink.as_deref().filter(|_| tracer.is_on()) {
        // TR-11: its launcher knows where to say that this node has no part, if need be.
        crate::net::supervisor::report_sink(sink);
    }
    tracer.set_who(crate::trace::Who {
        rank: me,
        name: cfg.name.clone(),
        incarnation,
        restart: cfg.restart_count,
        job: (cfg.job_id.clone())
            .or_else(|| view.named.clone())
            .unwrap_or_else(|| view.job.clone()),
        group: view.job.clone(),
        sink,
        ranks: (0..)
            .zip(&standing)
            .filter(|(_, s)| **s != Standing::Vacant)
            .map(|(r, _)| r)
            .collect(),
    });
    let inner = Arc::new(Inner {
        group: Group::new(me, Arc::clone(&directory)),
        callee: Callee::new(registry, cfg.max_concurrent_calls),
        caller: Caller::new(cfg.rpc_timeout, cfg.sync_connections),
        layers: Layers::default(),
        shutdown: ShutdownState::new(cfg.shutdown_timeout, cfg.replaced_on_failure),
        net: Arc::new(Net::new(
            net_cfg,
            directory,
            Arc::clone(&life),
            view.generation,
            &standing,
            tracer,
        )),
        life,
        reports,
        rendezvous: std::sync::Mutex::new(server),
    });
    {
        let world = inner.group.size();
        // The barrier waits for no rank that is vacant, left or failed as this worker joins.
        for (r, st) in standing.iter().enumerate() {
            match st {
                Standing::Vacant | Standing::Left => inner.shutdown.depart(r as u32, world),
                Standing::Failed(_) => {
                    let inc = inner.net.directory().incarnation(r as u32);
                    inner.shutdown.excuse(r as u32, inc, world)
                }
                Standing::Alive => {}
            }
        }
        // AG-6: the shutdown barrier does not wait for a worker declared failed.
        let weak = Arc::downgrade(&inner);
        inner
            .net
            .membership
            .on_failure(Arc::new(move |f: &WorkerFailed| {
                if let Some(inner) = weak.upgrade() {
                    inner.shutdown.excuse(f.rank, f.incarnation, world);
                    // The group hears of this worker's verdicts (RDV-3).
                    if f.rank != me {
                        let _ = inner.reports.try_send(Report::Failed {
                            rank: f.rank,
                            incarnation: f.incarnation,
                            cause: f.cause.clone(),
                        });
                    }
                }
            }));
        // A rank that left does not come to the barrier; a new incarnation of one does.
        let weak = Arc::downgrade(&inner);
        inner.net.membership.on_left(Arc::new(move |rank| {
            if let Some(inner) = weak.upgrade() {
                inner.shutdown.depart(rank, world);
            }
        }));
        let weak = Arc::downgrade(&inner);
        inner.net.membership.on_rejoin(Arc::new(move |rank| {
            if let Some(inner) = weak.upgrade() {
                let incarnation = inner.net.directory().incarnation(rank);
                inner.shutdown.readmit(rank, incarnation);
            }
        }));
    }
    // RDV-5: this incarnation's token goes to its launcher, which hands it to a replacement.
    inner.net.membership.own.set_token(token);
    tokio::spawn(rendezvous::follow(
        link,
        Arc::clone(&inner.net.membership),
        reports_rx,
        Arc::clone(&inner.life),
        (me, incarnation),
        redial,
    ));
    inner.net.serve(listener, Arc::clone(&inner), heartbeats);
    if let Some(grace) = cfg.signal_grace {
        crate::signals::watch(Arc::downgrade(&inner), grace)
            .map_err(|source| InitError::Config(format!("cannot watch signals: {source}")))?;
    }
    let agent = Agent { inner };
    crate::trace::keep_in_sync(&agent);
    // TR-5: with a grace, its own handler ends the process with `exit`, which writes the part.
    crate::trace::write_at_exit(&agent.tracer(), cfg.signal_grace.is_none());
    tracing::info!(
        worker = %agent.name(),
        rank = agent.rank(),
        incarnation,
        world = agent.world_size(),
        "joined group",
    );
    Ok(agent)
}
