//! A pass that fails on one member.
//!
//! - DDP-5: when a member's overlapped pass fails (its backward, a DDP-2 or DDP-4 refusal, a
//!   bucket that could not start), the buckets it has not started are failed on every member
//!   with one verdict naming it and the cause (COL-4), so the others' passes fail at once
//!   instead of waiting for them until the RPC timeout. With the built-in hooks (each bucket
//!   one all-reduce) the member knows how many operations the others take (the learnt
//!   buckets, or, in the pass that learns them, the parameters' order), fails exactly those,
//!   and the members stay in step for the next pass. With a hook of the user's own it cannot
//!   know: it fails the next one, and every member whose pass failed refuses later passes,
//!   saying why: their operations would no longer pair up, and a later pass would combine
//!   one pass's gradients with another's.

use super::DistributedDataParallel;
use crate::group::CollectiveError;

impl DistributedDataParallel {
    /// Fails if an earlier pass left this member out of step with the others (DDP-5).
    pub(super) fn check_in_step(&self) -> Result<(), CollectiveError> {
        let why = self.out_of_step.lock().unwrap_or_else(|p| p.into_inner());
        match why.as_ref() {
            None => Ok(()),
            Some(why) => Err(CollectiveError::Failed {
                op: "ddp backward",
                members: self.group.ranks().to_vec(),
                message: format!(
                    "this member is out of step with the group: {why}; its operations no \
                     longer pair up with the others', so make a new DistributedDataParallel \
                     over a fresh group (`new_group_tagged`)"
                ),
            }),
        }
    }

    /// DDP-5: a pass failed here with `e` after `started` of its operations started (`all`:
    /// every one of them; the pass that learns the buckets starts with the plan's agreement).
    /// Fails the rest on every member and returns the pass's error.
    pub(super) async fn pass_failed(
        &self,
        e: CollectiveError,
        planned: bool,
        started: usize,
        all: bool,
    ) -> CollectiveError {
        let rest = match (all, self.one_op_per_bucket()) {
            (true, true) => Some(0),
            (false, true) => {
                // The buckets, the used parameters' flags (DDP-9) and, in the pass that
                // learns the buckets, first the plan's agreement.
                let total = match planned {
                    true => self.planned_buckets() + 1,
                    false => 1 + self.param_buckets().len() + 1,
                };
                Some(total.saturating_sub(started))
            }
            (_, false) => None,
        };
        self.fail_rest(e, rest, !all).await
    }

    /// DDP-5: this member failed with `e`, leaving `rest` operations of the group unstarted
    /// that the others will call (`None`: an unknown number, and then `left_some` says
    /// whether it left any). Fails them on every member (where the number is unknown, the
    /// next one only) and returns the error to report; where the number is unknown, this
    /// member is out of step from now on.
    pub(super) async fn fail_rest(
        &self,
        e: CollectiveError,
        rest: Option<usize>,
        left_some: bool,
    ) -> CollectiveError {
        let count = rest.unwrap_or(usize::from(left_some));
        let e = if count == 0 {
            e
        } else {
            let why = format!(
                "ddp backward failed on rank {}: {}",
                self.group.agent().rank(),
                cause(&e)
            );
            self.group.fail_next("ddp backward", why, count).await
        };
        if rest.is_none() {
            let cause = cause(&e);
            let mut why = self.out_of_step.lock().unwrap_or_else(|p| p.into_inner());
            why.get_or_insert(format!(
                "a pass failed with a hook whose operations per bucket are unknown ({cause})"
            ));
        }
        e
    }

    /// Whether every bucket is one operation of the group: the hook is the ring all-reduce
    /// (in some element type) for every parameter's type.
    pub(super) fn one_op_per_bucket(&self) -> bool {
        self.vars
            .iter()
            .all(|v| self.hook.ring_dtype(v.dtype()).is_some())
    }

    /// How many buckets a learnt pass starts.
    fn planned_buckets(&self) -> usize {
        let plan = self.plan.lock().unwrap_or_else(|p| p.into_inner());
        plan.as_ref().map_or(0, |p| {
            p.after.iter().map(Vec::len).sum::<usize>() + p.unused.len()
        })
    }
}

/// An error and its sources on one line (without a backtrace candle may have appended).
fn cause(e: &CollectiveError) -> String {
    let chain = rpc_core::error_chain(e);
    chain.lines().next().unwrap_or_default().to_owned()
}
