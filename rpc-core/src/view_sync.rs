//! After a replacement joined, each member hears of it from the rendezvous in its own time: a
//! coordinator that asks the others to work with the new process right away (a collective
//! with it, a call that reaches it) may find one that still takes the rank for the failed
//! incarnation. [`Agent::await_known`] waits until they all know it.
//!
//! - VIEW-1: when `await_known` returns an empty list, every worker it asked knew the given
//!   incarnation of the rank (or a later one) as live before it answered.

use std::time::Duration;

use crate::error::{BoxError, RpcError};
use crate::registry::RemoteFn;
use crate::state::{Agent, CallContext};

/// Internal: waits, within the given milliseconds, until this worker knows incarnation
/// `incarnation` (or a later one) of `rank` as live; the incarnation it knows then.
pub(crate) struct KnowsIncarnation;

impl RemoteFn for KnowsIncarnation {
    const NAME: &'static str = "rpc_core::knows_incarnation";
    type Args = (u32, u64, u64);
    type Output = u64;
    async fn call(
        ctx: CallContext,
        (rank, incarnation, ms): (u32, u64, u64),
    ) -> Result<u64, BoxError> {
        let agent = ctx.agent();
        Ok(wait_known(agent, rank, incarnation, Duration::from_millis(ms)).await?)
    }
}

/// Waits at most `within` until `agent` knows incarnation `incarnation` of `rank` as live;
/// the incarnation it knows then.
async fn wait_known(
    agent: &Agent,
    rank: u32,
    incarnation: u64,
    within: Duration,
) -> Result<u64, RpcError> {
    let by = tokio::time::Instant::now() + within;
    let mut changes = agent.watch_membership();
    loop {
        let known = agent.incarnation_of(rank)?;
        if (known >= incarnation && agent.is_live(rank)?) || tokio::time::Instant::now() >= by {
            return Ok(known);
        }
        // Re-checked on every change, and every 20 ms in case one was missed.
        let _ = tokio::time::timeout(Duration::from_millis(20), changes.next()).await;
    }
}

impl Agent {
    /// Waits, at most `timeout`, until each of `workers` knows incarnation `incarnation` (or a
    /// later one) of worker `rank` as live (VIEW-1); returns those that still did not when
    /// the time was up (empty: all do). A coordinator calls it after a replacement joined,
    /// before it asks the others to work with the new process (each hears of it from the
    /// rendezvous in its own time).
    ///
    /// ```no_run
    /// # async fn demo(agent: rpc_core::Agent) -> Result<(), rpc_core::RpcError> {
    /// let new = agent.incarnation_of(1u32)?;
    /// let late = agent.await_known([2, 3], 1, new, std::time::Duration::from_secs(10)).await?;
    /// assert!(late.is_empty(), "workers {late:?} do not know the replacement yet");
    /// # Ok(()) }
    /// ```
    pub async fn await_known(
        &self,
        workers: impl IntoIterator<Item = u32>,
        rank: u32,
        incarnation: u64,
        timeout: Duration,
    ) -> Result<Vec<u32>, RpcError> {
        let ms = timeout.as_millis().min(u128::from(u64::MAX)) as u64;
        let asks = workers.into_iter().map(|w| async move {
            let known = if w == self.rank() {
                wait_known(self, rank, incarnation, timeout).await
            } else {
                let t = timeout + Duration::from_secs(5);
                self.rpc_async_timeout(w, KnowsIncarnation, (rank, incarnation, ms), t)
                    .await
            };
            known.map(|k| (w, k))
        });
        let known = futures::future::try_join_all(asks).await?;
        Ok(known
            .into_iter()
            .filter(|&(_, k)| k < incarnation)
            .map(|(w, _)| w)
            .collect())
    }
}
