//! The workers' side: the classifier head replicas, `NetShard1` (one device) and `NetShard2`
//! (split across two devices), their remote methods, and the data-parallel group that keeps
//! them identical.
//!
//! Creating a shard also joins the two workers' data-parallel group: the replicas start from
//! the first worker's values (a broadcast), and every `DistributedOptimizer` step on a worker
//! first sums the two replicas' gradients with a ring all-reduce (a gradient hook), so the
//! update is the gradient of the whole batch's loss on both. Each instance of the model
//! has a group of its own ([`instance`]): one abandoned after a failure, perhaps in the middle
//! of an all-reduce, leaves nothing the next one could receive.

use std::sync::Arc;

use autograd_dist::{parameter_rrefs, DeviceSpec, Parameter, RTensor};
use candle_core::Var;
use collectives::{DistributedDataParallel, ReduceOp};
use rpc_core::{remote, BoxError, CallContext};
use rref::RRef;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use examples::lang::model::{Dims, Head};

/// The ranks of the two head replicas.
pub const SHARD_RANKS: [u32; 2] = [1, 2];

/// One head replica, held by its worker.
pub struct NetShard {
    head: Head,
    vars: Vec<Var>,
}

impl Serialize for NetShard {
    fn serialize<S: Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "a model shard stays on its worker",
        ))
    }
}

impl<'de> Deserialize<'de> for NetShard {
    fn deserialize<D: Deserializer<'de>>(_d: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "a model shard stays on its worker",
        ))
    }
}

/// The tag of the data-parallel group of the master's `k`-th model instance (its recoveries
/// in place count up `k`; a replaced master is a new incarnation): never one an earlier
/// instance of this group used.
pub fn instance(agent: &rpc_core::Agent, k: u32) -> u64 {
    (agent.incarnation() << 32) | u64::from(k)
}

async fn build(
    ctx: &CallContext,
    dims: Dims,
    seed: u64,
    devices: (DeviceSpec, DeviceSpec),
    instance: u64,
) -> Result<NetShard, BoxError> {
    let head = Head::new(&dims, seed, (devices.0.device()?, devices.1.device()?))?;
    let vars = head.vars();
    let group = collectives::new_group_tagged(ctx.agent(), &SHARD_RANKS, instance)?;
    let ddp = DistributedDataParallel::new(group, vars.clone())
        .await?
        .with_reduce_op(ReduceOp::Sum);
    autograd_dist::set_gradient_hook(ctx.agent(), Arc::new(ddp));
    Ok(NetShard { head, vars })
}

/// Whether this worker can use `devices`: `Err` names the first it cannot and why (no CUDA in
/// this build, no driver, too few GPUs). A value, not a failed call: the master stops the
/// job for it instead of restarting into the same refusal.
#[remote]
pub async fn usable_devices(
    _ctx: CallContext,
    devices: Vec<DeviceSpec>,
) -> Result<Result<(), String>, BoxError> {
    Ok(devices
        .iter()
        .try_for_each(|d| d.device().map(drop))
        .map_err(|e| e.to_string()))
}

/// `NetShard1`: the head on one device.
#[remote]
pub async fn new_net_shard1(
    ctx: CallContext,
    dims: Dims,
    seed: u64,
    device: DeviceSpec,
    instance: u64,
) -> Result<NetShard, BoxError> {
    build(&ctx, dims, seed, (device, device), instance).await
}

/// `NetShard2`: the head's first Linear on `device0`, its ReLU and second Linear on `device1`.
#[remote]
pub async fn new_net_shard2(
    ctx: CallContext,
    dims: Dims,
    seed: u64,
    device0: DeviceSpec,
    device1: DeviceSpec,
    instance: u64,
) -> Result<NetShard, BoxError> {
    build(&ctx, dims, seed, (device0, device1), instance).await
}

/// Logits for encodings `x` (recorded for distributed autograd inside a context).
#[remote]
pub async fn shard_forward(
    _ctx: CallContext,
    shard: RRef<NetShard>,
    x: RTensor,
) -> Result<RTensor, BoxError> {
    let local = shard.local_value().await?;
    let guard = local.lock().await;
    Ok(RTensor(guard.head.forward(&x.0)?))
}

/// References to the shard's parameters, for the master's `DistributedOptimizer`.
#[remote]
pub async fn shard_parameters(
    ctx: CallContext,
    shard: RRef<NetShard>,
) -> Result<Vec<RRef<Parameter>>, BoxError> {
    let local = shard.local_value().await?;
    let guard = local.lock().await;
    Ok(parameter_rrefs(ctx.agent(), guard.vars.clone()))
}

/// The shard's parameter values (for a checkpoint).
#[remote]
pub async fn shard_values(
    _ctx: CallContext,
    shard: RRef<NetShard>,
) -> Result<Vec<RTensor>, BoxError> {
    let local = shard.local_value().await?;
    let guard = local.lock().await;
    Ok(guard
        .vars
        .iter()
        .map(|v| RTensor(v.as_tensor().detach()))
        .collect())
}

/// Replaces the shard's parameter values (from a checkpoint); shapes must match.
#[remote]
pub async fn load_shard_values(
    _ctx: CallContext,
    shard: RRef<NetShard>,
    values: Vec<RTensor>,
) -> Result<(), BoxError> {
    let local = shard.local_value().await?;
    let guard = local.lock().await;
    if values.len() != guard.vars.len() {
        return Err(format!(
            "{} values for {} parameters",
            values.len(),
            guard.vars.len()
        )
        .into());
    }
    for (v, RTensor(t)) in guard.vars.iter().zip(values) {
        if t.dims() != v.dims() {
            return Err(
                format!("parameter is {:?}, checkpoint has {:?}", v.dims(), t.dims()).into(),
            );
        }
        v.set(&t.to_device(v.device())?)?;
    }
    Ok(())
}

/// This process's peak resident memory in MiB (`VmHWM`), or 0 where unknown.
#[remote]
pub async fn peak_rss_mb(_ctx: CallContext) -> Result<f64, BoxError> {
    Ok(examples::peak_rss_mb())
}
