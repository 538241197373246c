//! The server's side of the trainers' calls: pull (waiting as the consistency mode requires,
//! PS-1), push and join (through the shard's log, PS-5).

use rpc_core::{BoxError, CallContext, RemoteFn};

use super::log::{self, shards};
use super::shard::Change;
use autograd_dist::RTensor;

/// Trainer → server: the shard's parameters for the trainer's step `clock`.
#[derive(Clone, Copy)]
pub(crate) struct Pull;

impl RemoteFn for Pull {
    const NAME: &'static str = "collectives::ps_pull";
    type Args = (u64, usize, u64);
    type Output = Vec<RTensor>;
    async fn call(
        cx: CallContext,
        (shard, trainer, clock): Self::Args,
    ) -> Result<Vec<RTensor>, BoxError> {
        let m = shards(cx.agent());
        let rank = cx.caller().id.0;
        let incarnation = cx.agent().incarnation_of(rank)?;
        loop {
            let mut rx = {
                let mut g = m.lock();
                let s = &mut g
                    .shards
                    .get_mut(&shard)
                    .ok_or_else(|| {
                        format!("no parameter shard {shard} on `{}`", cx.agent().name())
                    })?
                    .state;
                s.check_trainer(trainer)?;
                // Known from its first call, so that its failure is its departure (PS-3).
                s.trainer_ranks[trainer].get_or_insert((rank, incarnation));
                // PS-3: only live trainers' clocks count (the caller is one).
                let min = s.min_live_clock(None).unwrap_or(clock);
                let ahead = clock.saturating_sub(min);
                if ahead <= s.consistency.bound() {
                    s.max_staleness = s.max_staleness.max(ahead);
                    return Ok(s.params.iter().cloned().map(RTensor).collect());
                }
                s.changed.subscribe()
            };
            // PS-1: wait for a push to move the slowest clock; the call's deadline bounds this.
            rx.changed().await.map_err(|_| "the shard was dropped")?;
        }
    }
}

/// Trainer → server: gradients for the trainer's step `clock`.
#[derive(Clone, Copy)]
pub(crate) struct Push;

impl RemoteFn for Push {
    const NAME: &'static str = "collectives::ps_push";
    type Args = (u64, usize, u64, Vec<RTensor>);
    type Output = ();
    async fn call(
        cx: CallContext,
        (shard, trainer, clock, grads): Self::Args,
    ) -> Result<(), BoxError> {
        let rank = cx.caller().id.0;
        let change = Change::Push {
            trainer,
            rank,
            clock,
            grads,
        };
        log::submit(cx.agent(), &shards(cx.agent()), shard, change).await?;
        Ok(())
    }
}

/// Trainer → server: a replacement trainer takes over trainer index `trainer` from step `at`
/// or later (PS-6); returns the step it starts at.
#[derive(Clone, Copy)]
pub(crate) struct Join;

impl RemoteFn for Join {
    const NAME: &'static str = "collectives::ps_join";
    type Args = (u64, usize, u64);
    type Output = u64;
    async fn call(cx: CallContext, (shard, trainer, at): Self::Args) -> Result<u64, BoxError> {
        let rank = cx.caller().id.0;
        let incarnation = cx.agent().incarnation_of(rank)?;
        let change = Change::Join {
            trainer,
            rank,
            incarnation,
            at,
        };
        log::submit(cx.agent(), &shards(cx.agent()), shard, change).await
    }
}
