//! Point-to-point tensor messages, process groups, and ring collectives.
//!
//! Everything travels as RPCs of `rpc-core` (tensors as [`RTensor`]s, so large ones take the
//! bulk path) into a per-worker mailbox matched by source and tag.
//!
//! - [`send`] / [`recv`] (and [`isend`] / [`irecv`], which return handles): point to point.
//! - [`ProcessGroup`]: the whole group ([`world`]) or a subset ([`new_group`]). Every member
//!   must call the group's collectives in the same order (each call takes the group's next
//!   sequence number, which names its messages).
//! - [`ProcessGroup::all_reduce`]: the bandwidth-optimal ring (reduce-scatter, then
//!   all-gather), so each rank sends `2(n-1)/n` of the data whatever `n` is. Each chunk is
//!   reduced on exactly one rank and then copied, so every rank gets bit-identical results.
//!   Also `broadcast`, `all_gather`, `reduce_scatter`, `barrier`, and `*_async` variants.
//! - COL-1: a rank that finds a mismatch (shape, dtype) aborts the operation on every member,
//!   so the others fail with the same clear error instead of waiting for messages that will
//!   not come. Every wait is bounded by the group's call timeout.
//!
//! Install the functions in every worker's registry with [`install`].
//!
//! # Layout
//! - `mailbox`: per-worker matching of messages by (source, tag), aborts.
//! - `group`: [`ProcessGroup`], the ring algorithms, [`ReduceOp`].
//! - `ddp`: [`DistributedDataParallel`] (bucketed gradient averaging), [`DistributedSampler`].
//! - `ps`: a parameter server with BSP, SSP and ASP consistency ([`PsClient`], PS-1).
#![deny(missing_docs)]

mod ddp;
mod group;
mod mailbox;
mod ps;

pub use autograd_dist::RTensor;
pub use ddp::{DistributedDataParallel, DistributedSampler};
pub use group::{new_group, world, CollectiveError, Element, ProcessGroup, ReduceOp, Work};
pub use mailbox::{irecv, isend, recv, send, Handle, P2pError};
pub use ps::{serve_shard, shard_stats, Consistency, PsClient};

/// Adds the collectives' functions to a worker's registry.
pub fn install(
    b: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    b.register(mailbox::Deliver)?
        .register(mailbox::DeliverRaw)?
        .register(mailbox::Abort)?
        .register(ps::Pull)?
        .register(ps::Push)
}
