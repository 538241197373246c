//! The shards a worker serves, and each shard's log: how a change reaches both copies of a
//! replicated shard before anyone sees it (PS-5).
//!
//! A change passes one at a time through its shard's lane, in a task of its own (so it reaches
//! its end whatever happens to the call that asked for it: the trainer's deadline, a cancel,
//! the trainer declared failed). The primary admits it, numbers it, sends it to the backup
//! until the backup holds it (or the group has declared the backup failed), and only then
//! applies it to its own copy and acknowledges it. A change the backup may hold but the primary
//! has not applied (a send that failed in between) stays at the head of the log and is settled
//! before the next one. The backup applies each number once, in order; a resend of a number it
//! holds is acknowledged without applying it again.

use rpc_core::ext::{AgentExt, WeakAgent};
use rpc_core::{Agent, BoxError, CallContext, RemoteFn, RpcError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::shard::{Admitted, Change, Shard};
use super::Replica;

/// A shard's log position on one copy.
#[derive(Default)]
pub(crate) struct Log {
    /// Primary: the number of the last change sent to the backup.
    sent: u64,
    /// Primary: a change sent to the backup and not yet applied here (its number and itself).
    unconfirmed: Option<(u64, Change)>,
    /// Backup: the number of the last change applied.
    applied: u64,
}

/// A shard served here and its lane (changes pass one at a time, primary then backup).
pub(crate) struct Hosted {
    pub state: Shard,
    lane: Arc<tokio::sync::Mutex<Log>>,
}

#[derive(Default)]
pub(crate) struct ShardsInner {
    pub shards: HashMap<u64, Hosted>,
    /// Every failure this worker has heard of: (incarnation, name, cause) by rank.
    pub failed: HashMap<u32, (u64, String, String)>,
}

/// Every shard this worker serves.
#[derive(Default)]
pub(crate) struct Shards(Mutex<ShardsInner>);

impl Shards {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, ShardsInner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts serving `state` as shard `shard` (a peer already declared failed cannot hold
    /// its other copy); `Err` (nothing changed) if it is served already.
    pub(crate) fn insert(&self, shard: u64, mut state: Shard) -> Result<(), ()> {
        let mut g = self.lock();
        if g.shards.contains_key(&shard) {
            return Err(());
        }
        if let Replica::Primary { backup: r } | Replica::Backup { primary: r } = state.replica {
            if g.failed.contains_key(&r) {
                state.replica = Replica::Sole;
            }
        }
        let lane = Arc::default();
        g.shards.insert(shard, Hosted { state, lane });
        Ok(())
    }

    /// Stops serving shard `shard`; its state, if it was served.
    pub(crate) fn remove(&self, shard: u64) -> Option<Shard> {
        self.lock().shards.remove(&shard).map(|h| h.state)
    }

    /// Runs `f` on shard `shard`'s state; an error naming `agent`'s worker if it serves no
    /// such shard.
    pub(crate) fn with<R>(
        &self,
        agent: &Agent,
        shard: u64,
        f: impl FnOnce(&mut Shard) -> R,
    ) -> Result<R, BoxError> {
        let mut g = self.lock();
        let h = g
            .shards
            .get_mut(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} on `{}`", agent.name()))?;
        Ok(f(&mut h.state))
    }

    fn lane(&self, agent: &Agent, shard: u64) -> Result<Arc<tokio::sync::Mutex<Log>>, BoxError> {
        let g = self.lock();
        let h = g
            .shards
            .get(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} on `{}`", agent.name()))?;
        Ok(Arc::clone(&h.lane))
    }
}

/// The shards `agent`'s worker serves (created on first use, with the hook that turns
/// failures into promotions and departures).
pub(crate) fn shards(agent: &Agent) -> Arc<Shards> {
    let mut created = false;
    let s = agent.extension(|| {
        created = true;
        Shards::default()
    });
    if created {
        let weak = Arc::downgrade(&s);
        let agent_weak = agent.downgrade();
        let rt = tokio::runtime::Handle::try_current().ok();
        agent.on_worker_failed(move |f| {
            let Some(s) = weak.upgrade() else { return };
            let departures = worker_failed(&s, f);
            for (shard, change) in departures {
                let (agent_weak, s) = (agent_weak.clone(), Arc::clone(&s));
                let task = async move { submit_departure(&agent_weak, &s, shard, change).await };
                match &rt {
                    Some(rt) => {
                        rt.spawn(task);
                    }
                    None => futures::executor::block_on(task),
                }
            }
        });
    }
    s
}

/// A worker was declared failed: promotes the backups whose primary it was and returns the
/// departures to apply (through the lane) on the shards that decide them.
fn worker_failed(s: &Shards, f: &rpc_core::WorkerFailed) -> Vec<(u64, Change)> {
    let mut g = s.lock();
    g.failed
        .insert(f.rank, (f.incarnation, f.name.clone(), f.cause.clone()));
    let ShardsInner { shards, failed } = &mut *g;
    let mut out = Vec::new();
    for (&id, Hosted { state: shard, .. }) in shards.iter_mut() {
        match shard.replica {
            Replica::Backup { primary } if primary == f.rank => {
                tracing::warn!(
                    shard = id,
                    primary = %f.name,
                    "the shard's primary failed; its backup here serves the shard now",
                );
                shard.replica = Replica::Sole;
            }
            Replica::Primary { backup } if backup == f.rank => {
                tracing::warn!(
                    shard = id,
                    backup = %f.name,
                    "the shard's backup failed; the primary here goes on alone",
                );
                shard.replica = Replica::Sole;
            }
            // The primary decides departures and forwards them (PS-5).
            Replica::Backup { .. } => continue,
            _ => {}
        }
        // Every failed trainer departs (after a promotion also those the primary did not get
        // to forward).
        for (t, r) in shard.trainer_ranks.iter().enumerate() {
            let Some((rank, _)) = r else { continue };
            if let Some((incarnation, worker, cause)) = failed.get(rank) {
                if shard.departed[t].is_none() {
                    out.push((
                        id,
                        Change::Depart {
                            trainer: t,
                            incarnation: *incarnation,
                            worker: worker.clone(),
                            cause: cause.clone(),
                        },
                    ));
                }
            }
        }
    }
    out
}

async fn submit_departure(agent: &WeakAgent, s: &Arc<Shards>, shard: u64, change: Change) {
    let Some(agent) = agent.upgrade() else { return };
    if let Err(e) = submit(&agent, s, shard, change).await {
        tracing::warn!(shard, cause = %e, "recording a trainer's departure failed");
    }
}

/// Passes `change` through shard `shard`'s log (PS-5) and returns the trainer's clock after
/// it. The change runs in a task of its own: it reaches its end (held by both copies, or by
/// neither) also when this future is dropped.
pub(crate) async fn submit(
    agent: &Agent,
    s: &Arc<Shards>,
    shard: u64,
    change: Change,
) -> Result<u64, BoxError> {
    let (a, s) = (agent.clone(), Arc::clone(s));
    // A bare spawn on purpose: the change must outlive the call (and the deadline) that
    // asked for it; it is bounded by the replication's own deadline.
    agent
        .runtime()
        .spawn(async move { commit(&a, &s, shard, change).await })
        .await
        .map_err(|e| format!("parameter shard {shard}: the change's task failed: {e}"))?
}

async fn commit(agent: &Agent, s: &Shards, shard: u64, change: Change) -> Result<u64, BoxError> {
    let lane = s.lane(agent, shard)?;
    let mut log = lane.lock().await;
    if let Some((seq, doubt)) = log.unconfirmed.clone() {
        // The backup may hold it already: it settles first, on both copies.
        replicate(agent, s, shard, seq, &doubt).await?;
        log.unconfirmed = None;
        s.with(agent, shard, |sh| sh.apply(doubt))??;
    }
    let (admitted, replicated) = s.with(agent, shard, |sh| {
        (sh.admit(change), is_primary(sh.replica))
    })?;
    let change = match admitted? {
        Admitted::Held(clock) => return Ok(clock),
        Admitted::Apply(c) => c,
    };
    if replicated {
        log.sent += 1;
        let seq = log.sent;
        log.unconfirmed = Some((seq, change.clone()));
        replicate(agent, s, shard, seq, &change).await?;
        log.unconfirmed = None;
    }
    s.with(agent, shard, |sh| sh.apply(change))?
}

fn is_primary(r: Replica) -> bool {
    matches!(r, Replica::Primary { .. })
}

/// Sends change `seq` to the shard's backup until the backup holds it, or until the group has
/// declared the backup failed (the primary goes on alone). Fails, leaving the change
/// unconfirmed, when the backup refuses it (its view has this primary failed: a frozen primary
/// that thaws is fenced) or stays unreachable past the call timeout without a verdict.
async fn replicate(
    agent: &Agent,
    s: &Shards,
    shard: u64,
    seq: u64,
    change: &Change,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + agent.wait_bound();
    loop {
        let Replica::Primary { backup } = s.with(agent, shard, |sh| sh.replica)? else {
            // The backup was declared failed meanwhile.
            return Ok(());
        };
        let e = match agent
            .rpc_async(backup, Replicate, (shard, seq, change.clone()))
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let gone = matches!(e, RpcError::PeerFailed { .. } | RpcError::PeerLeft { .. })
            || !agent.is_live(backup).unwrap_or(true);
        if gone {
            s.with(agent, shard, |sh| {
                if sh.replica == (Replica::Primary { backup }) {
                    tracing::warn!(
                        shard, cause = %e, "the shard's backup failed; the primary goes on alone"
                    );
                    sh.replica = Replica::Sole;
                }
            })?;
            return Ok(());
        }
        if !transient(&e) || Instant::now() >= deadline {
            return Err(format!(
                "parameter shard {shard}: its backup `{}` has not confirmed change {seq}: {e}",
                agent.name_of(backup)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Errors after which the peer may still be alive (the detector decides).
pub(crate) fn transient(e: &RpcError) -> bool {
    matches!(
        e,
        RpcError::ConnectionLost { .. }
            | RpcError::Unreachable { .. }
            | RpcError::Transport { .. }
            | RpcError::DeadlineExceeded { .. }
    )
}

/// Primary → backup: change number `seq` of the shard, in the primary's order (PS-5).
pub(crate) struct Replicate;

impl RemoteFn for Replicate {
    const NAME: &'static str = "collectives::ps_replicate";
    type Args = (u64, u64, Change);
    type Output = ();
    async fn call(cx: CallContext, (shard, seq, change): Self::Args) -> Result<(), BoxError> {
        let agent = cx.agent();
        let m = shards(agent);
        let from = cx.caller().id.0;
        let lane = m.lane(agent, shard)?;
        let mut log = lane.lock().await;
        // From here to the end nothing waits: a cancelled call applied all of it or nothing.
        let replica = m.with(agent, shard, |sh| sh.replica)?;
        if replica != (Replica::Backup { primary: from }) {
            return Err(format!(
                "`{}` does not hold a backup of shard {shard} for `{}` (it was declared failed, \
                 or this copy is not its backup)",
                agent.name(),
                cx.caller().name
            )
            .into());
        }
        if seq <= log.applied {
            return Ok(()); // held: a resend after a lost answer
        }
        if seq != log.applied + 1 {
            return Err(format!(
                "shard {shard}: change {seq} arrived after change {} (a gap in the primary's log)",
                log.applied
            )
            .into());
        }
        m.with(agent, shard, |sh| sh.apply(change))??;
        log.applied = seq;
        Ok(())
    }
}
