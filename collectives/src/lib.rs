//! Point-to-point tensor messages, process groups, and ring collectives.
//!
//! Everything travels as RPCs of `rpc-core` (tensors as [`RTensor`]s, so large ones take the
//! bulk path) into a per-worker mailbox matched by source and tag.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use collectives::ReduceOp;
//! use rpc_core::{testing, Agent, Registry, Secret, Transport};
//!
//! /// What every rank runs: an all-reduce over the whole group, then rank 0 sends its result
//! /// to rank 1 (tag 7).
//! async fn rank_main(agent: Agent) -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
//!     let group = collectives::world(&agent);
//!     let mine = Tensor::full(agent.rank() as f32 + 1.0, 4, &Device::Cpu)?;
//!     let sum = group.all_reduce(&mine, ReduceOp::Sum).await?; // 1 + 2 on every rank
//!     if agent.rank() == 0 {
//!         collectives::send(&agent, 1u32, 7, &sum).await?;
//!     } else {
//!         let got = collectives::recv(&agent, 0u32, 7).await?;
//!         assert_eq!(got.to_vec1::<f32>()?, sum.to_vec1::<f32>()?);
//!     }
//!     Ok(sum.to_vec1()?)
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let registry = |_| collectives::install(Registry::builder()).unwrap().build();
//! let workers =
//!     testing::start_group(2, Transport::Tcp, Secret::generate(), registry, |_, c| c).await?;
//! // Here both ranks run in this process; in a real job each process runs `rank_main`.
//! let sums = futures::future::try_join_all(workers.iter().cloned().map(rank_main)).await?;
//! assert_eq!(sums, vec![vec![3.0; 4]; 2]);
//! futures::future::join_all(workers.iter().map(|w| w.shutdown())).await;
//! # Ok(()) }
//! ```
//!
//! - [`send`] / [`recv`] (and [`isend`] / [`irecv`], which return handles): point to point.
//! - [`ProcessGroup`]: the whole group ([`world`]) or a subset ([`new_group`]). Every member
//!   must call the group's collectives in the same order (each call takes the group's next
//!   sequence number, which names its messages).
//! - [`ProcessGroup::all_reduce`]: the bandwidth-optimal ring (reduce-scatter, then
//!   all-gather), so each rank sends `2(n-1)/n` of the data whatever `n` is. Each chunk is
//!   reduced on exactly one rank and then copied, so every rank gets bit-identical results.
//!   Also `broadcast`, `all_gather`, `reduce_scatter`, `barrier`, `reduce`, `gather`,
//!   `scatter`, `all_to_all` (equal or unequal splits), and `*_async` variants; reductions
//!   by [`ReduceOp`] (sum, mean, max, min, product).
//! - COL-1: a rank that finds a mismatch (shape, dtype, or another call or reduction at the
//!   same place in the group's order) reports it to the group's first
//!   member, which aborts the operation on every member with the first report it got: every
//!   member fails with the same message instead of waiting for messages that will not come.
//!   Every wait is bounded by the group's call timeout.
//! - COL-4: a member that cannot make its part of an operation (a failed or panicking fill
//!   of [`ProcessGroup::all_reduce_fill_async`]) fails the operation on every member the
//!   same way, with one message naming it and the cause, and the group stays in step.
//! - ROOT-1: members that pass different roots to a `broadcast`, `reduce`, `gather` or
//!   `scatter` fail it on every member with one message naming both roots, within about a
//!   second rather than at their timeout (each member's messages carry its root, and
//!   members still waiting after a second compare theirs with their neighbours').
//!
//! Install the functions in every worker's registry with [`install`].
//!
//! # Layout
//! - `mailbox`: per-worker matching of messages by (source, tag), aborts.
//! - `group`: [`ProcessGroup`], the ring algorithms, [`ReduceOp`].
//! - `ddp`: [`DistributedDataParallel`] (bucketed gradient averaging after backward, or
//!   overlapped with it through a [`Pass`]; [`CommHook`]s), [`DdpOptimizer`],
//!   [`DistributedSampler`].
//! - `elastic`: [`ElasticDdp`]: commits, and survivors that re-form their ring after a
//!   member's failure, without it or with its replacement (EL-1..3). Groups are of member
//!   incarnations (COL-3 in `mailbox`).
//! - `ps`: a parameter server with BSP, SSP and ASP consistency ([`PsClient`], PS-1..3),
//!   idempotent pushes, primary-backup shards and replacement trainers (PS-4..6).
#![deny(missing_docs)]

mod ddp;
mod elastic;
mod group;
mod mailbox;
mod ps;

pub use autograd_dist::RTensor;
pub use ddp::{
    AllReduceHook, CommHook, CompressHook, DdpOptimizer, DistributedDataParallel,
    DistributedSampler, Pass,
};
pub use elastic::{ElasticDdp, Rejoin};
pub use group::{
    new_group, new_group_tagged, world, CollectiveError, Element, ProcessGroup, ReduceOp, Work,
};
pub use mailbox::{
    irecv, isend, mailbox_stats, recv, send, set_mailbox_limits, Handle, MailboxLimits,
    MailboxStats, P2pError,
};
pub use ps::{
    primary_failed, retire_shard, serve_replica, serve_shard, shard_stats, Consistency, PsClient,
    Replica, ServeError, ShardStats,
};

/// Adds the collectives' functions to a worker's registry.
pub fn install(
    b: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    b.register(mailbox::Deliver)?
        .register(mailbox::DeliverRaw)?
        .register(mailbox::Abort)?
        .register(group::Verdict)?
        .register(ps::Pull)?
        .register(ps::Push)?
        .register(ps::Join)?
        .register(ps::Replicate)
}
