//! A trainer's side: [`PsClient`] routes each shard's calls to its primary, and to its backup
//! once the group has declared the primary failed (PS-5), for good (PS-8).

use candle_core::Tensor;
use rpc_core::{Agent, RemoteFn, RpcError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::log;
use super::server::{Join, Pull, Push};
use autograd_dist::RTensor;

/// Where a trainer finds one shard.
#[derive(Clone, Debug)]
struct Route {
    server: u32,
    shard: u64,
    backup: Option<u32>,
}

/// A trainer's view of the sharded parameters.
#[derive(Clone, Debug)]
pub struct PsClient {
    agent: Agent,
    routes: Arc<Vec<Route>>,
    /// Per shard: whether calls go to the backup (the primary was declared failed).
    failed_over: Arc<Vec<AtomicBool>>,
    trainer: usize,
    acked: Arc<AtomicU64>,
}

impl PsClient {
    /// A client for trainer number `trainer` over `shards` (`(server rank, shard id)`).
    pub fn new(agent: &Agent, shards: Vec<(u32, u64)>, trainer: usize) -> Self {
        let routes: Vec<Route> = shards
            .into_iter()
            .map(|(server, shard)| Route {
                server,
                shard,
                backup: None,
            })
            .collect();
        Self {
            agent: agent.clone(),
            failed_over: Arc::new(routes.iter().map(|_| AtomicBool::new(false)).collect()),
            routes: Arc::new(routes),
            trainer,
            acked: Arc::default(),
        }
    }

    /// Names each shard's backup (the rank given to [`serve_replica`](super::serve_replica) as `Replica::Backup`'s
    /// host), in the order of the shards: calls fail over to it once the primary has been
    /// declared failed.
    pub fn with_backups(mut self, backups: impl IntoIterator<Item = Option<u32>>) -> Self {
        let mut routes = (*self.routes).clone();
        for (r, b) in routes.iter_mut().zip(backups) {
            r.backup = b;
        }
        self.routes = Arc::new(routes);
        self
    }

    /// How many pushes to a shard were acknowledged (each holds one shard's gradients).
    pub fn acked_pushes(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    /// Whether calls for shard number `i` (in the client's order) go to its backup now.
    pub fn failed_over(&self, i: usize) -> bool {
        self.failed_over
            .get(i)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Calls `f` on shard `i`'s server, failing over to its backup once the group has declared
    /// the primary failed (PS-5).
    async fn call<F: RemoteFn + Copy>(
        &self,
        i: usize,
        f: F,
        args: F::Args,
    ) -> Result<F::Output, RpcError>
    where
        F::Args: Clone,
    {
        let r = &self.routes[i];
        if !self.failed_over(i) && r.backup.is_some() && self.ever_failed(r.server) {
            // PS-8: a replacement of the primary's process holds nothing of the shard.
            tracing::warn!(
                shard = r.shard,
                primary = r.server,
                backup = r.backup,
                "failing over to the shard's backup: its primary failed before",
            );
            self.failed_over[i].store(true, Ordering::Relaxed);
        }
        if !self.failed_over(i) {
            let e = match self.agent.rpc_async(r.server, f, args.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let Some(backup) = r.backup else {
                return Err(e);
            };
            if !self.primary_lost(r.server, &e).await {
                return Err(e);
            }
            tracing::warn!(
                shard = r.shard,
                primary = r.server,
                backup,
                cause = %e,
                "failing over to the shard's backup",
            );
            self.failed_over[i].store(true, Ordering::Relaxed);
        }
        let backup = r.backup.expect("failed over only with a backup");
        self.agent.rpc_async(backup, f, args).await
    }

    /// Whether `e` from `server` means the group declared it failed (waiting, bounded by the
    /// call timeout, for the verdict after a lost connection).
    async fn primary_lost(&self, server: u32, e: &RpcError) -> bool {
        if matches!(e, RpcError::PeerFailed { .. } | RpcError::PeerLeft { .. })
            || self.ever_failed(server)
        {
            return true;
        }
        if !log::transient(e) {
            return false;
        }
        let deadline = Instant::now() + self.agent.wait_bound();
        while Instant::now() < deadline {
            if !self.agent.is_live(server).unwrap_or(true) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn ever_failed(&self, server: u32) -> bool {
        primary_failed(&self.agent, server)
    }

    /// Every shard's parameters for step `clock` (waiting as the consistency mode requires).
    pub async fn pull(&self, clock: u64) -> Result<Vec<Vec<Tensor>>, RpcError> {
        let calls = (0..self.routes.len()).map(|i| {
            let shard = self.routes[i].shard;
            self.call(i, Pull, (shard, self.trainer, clock))
        });
        Ok(futures::future::try_join_all(calls)
            .await?
            .into_iter()
            .map(|v| v.into_iter().map(|t| t.0).collect())
            .collect())
    }

    /// Pushes step `clock`'s gradients, one list per shard (in the client's order; another
    /// number of lists is refused before anything is sent).
    pub async fn push(&self, clock: u64, grads: Vec<Vec<Tensor>>) -> Result<(), RpcError> {
        if grads.len() != self.routes.len() {
            return Err(RpcError::TypeMismatch {
                worker: self.agent.name().to_owned(),
                fn_name: Push::NAME.to_owned(),
                detail: format!(
                    "trainer {} pushed {} gradient lists for {} shards",
                    self.trainer,
                    grads.len(),
                    self.routes.len()
                ),
            });
        }
        let calls = grads.into_iter().enumerate().map(|(i, g)| {
            let shard = self.routes[i].shard;
            let g: Vec<RTensor> = g.into_iter().map(RTensor).collect();
            async move {
                self.call(i, Push, (shard, self.trainer, clock, g)).await?;
                self.acked.fetch_add(1, Ordering::Relaxed);
                Ok::<_, RpcError>(())
            }
        });
        futures::future::try_join_all(calls).await.map(|_| ())
    }

    /// A replacement trainer takes over this client's trainer index (whose previous holder
    /// was declared failed) on every shard (PS-6); returns the step to go on from: the
    /// earliest step one of the shards needs from this trainer index (a holder that died
    /// between its pushes to two shards left one shard a step ahead: that shard acknowledges
    /// the repeated step without applying it again, PS-4).
    pub async fn join(&self) -> Result<u64, RpcError> {
        let calls = (0..self.routes.len()).map(|i| {
            let shard = self.routes[i].shard;
            self.call(i, Join, (shard, self.trainer, 0))
        });
        let got = futures::future::try_join_all(calls).await?;
        Ok(got.into_iter().min().unwrap_or(0))
    }
}

/// Whether any incarnation of server `server` has failed, as `agent` sees it (PS-8): the group
/// declared one failed, or the rank runs as a replacement (a process that joined later knows
/// of no verdict). A shard whose primary this is lives at its backup.
pub fn primary_failed(agent: &Agent, server: u32) -> bool {
    agent.incarnation_of(server).is_ok_and(|i| i > 0)
        || agent.failed_workers().iter().any(|f| f.rank == server)
}
