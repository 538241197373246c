//! Remote functions for the distributed autograd tests: parameters live on workers in a
//! per-process map and are initialized deterministically, so every test can recompute its
//! model in one process with the same values.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use autograd_dist::RTensor;
use candle_core::{DType, Device, Tensor, Var};
use rpc_core::{remote, BoxError, CallContext};

type Params = Mutex<HashMap<(String, String), Var>>;

fn params() -> &'static Params {
    static P: OnceLock<Params> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// Deterministic values for a parameter called `name`.
pub fn init_value(name: &str, rows: usize, cols: usize) -> Tensor {
    let salt = name
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    let v: Vec<f64> = (0..rows * cols)
        .map(|i| {
            (((i as u64).wrapping_mul(2_654_435_761).wrapping_add(salt) % 1000) as f64 / 1000.0
                - 0.5)
                * 0.8
        })
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("shape matches")
}

fn param(ctx: &CallContext, name: &str) -> Result<Var, BoxError> {
    params()
        .lock()
        .unwrap()
        .get(&(ctx.agent().name().to_owned(), name.to_owned()))
        .cloned()
        .ok_or_else(|| format!("no parameter {name} on {}", ctx.agent().name()).into())
}

/// Creates parameter `name` on this worker.
#[remote]
pub async fn init_param(
    ctx: CallContext,
    name: String,
    rows: usize,
    cols: usize,
) -> Result<(), BoxError> {
    let v = Var::from_tensor(&init_value(&name, rows, cols))?;
    params()
        .lock()
        .unwrap()
        .insert((ctx.agent().name().to_owned(), name), v);
    Ok(())
}

/// `x @ W` (then ReLU if asked) with this worker's parameter `w`, through
/// `grad_once::matmul`: the distributed backward writes `W`'s gradient once (the tests that
/// compare it with one process's plain backward check that it is the same).
#[remote]
pub async fn linear(
    ctx: CallContext,
    w: String,
    x: RTensor,
    relu: bool,
) -> Result<RTensor, BoxError> {
    let y = autograd_dist::grad_once::matmul(&x, param(&ctx, &w)?.as_tensor())?;
    Ok(RTensor(if relu { y.relu()? } else { y }))
}

/// `linear` here, then `linear` with `next_w` on worker `next` (a nested call), returned back.
#[remote]
pub async fn linear_then(
    ctx: CallContext,
    w: String,
    x: RTensor,
    next: u32,
    next_w: String,
) -> Result<RTensor, BoxError> {
    let h = x.matmul(param(&ctx, &w)?.as_tensor())?.tanh()?;
    let out = ctx
        .agent()
        .rpc_async(next, linear, (next_w, RTensor(h), false))
        .await?;
    Ok(RTensor((out.0 * 2.0)?))
}

/// [`linear_then`] with the nested call made from a task this handler spawns with
/// [`rpc_core::spawn`] (which carries the autograd context into the task).
#[remote]
pub async fn linear_then_spawned(
    ctx: CallContext,
    w: String,
    x: RTensor,
    next: u32,
    next_w: String,
) -> Result<RTensor, BoxError> {
    let h = x.matmul(param(&ctx, &w)?.as_tensor())?.tanh()?;
    let agent = ctx.agent().clone();
    let out = rpc_core::spawn(async move {
        agent
            .rpc_async(next, linear, (next_w, RTensor(h), false))
            .await
    })
    .await??;
    Ok(RTensor((out.0 * 2.0)?))
}

/// [`linear_then_spawned`] with a bare `tokio::spawn` (the trap: the task has no call scope,
/// so the nested call carries no autograd context), or, with `detach`, sending `h.detach()`
/// from that task (its value alone, on purpose).
#[remote]
pub async fn linear_then_bare_spawned(
    ctx: CallContext,
    w: String,
    x: RTensor,
    next: u32,
    next_w: String,
    detach: bool,
) -> Result<RTensor, BoxError> {
    let h = x.matmul(param(&ctx, &w)?.as_tensor())?.tanh()?;
    let h = if detach { h.detach() } else { h };
    let agent = ctx.agent().clone();
    let out = tokio::spawn(async move {
        agent
            .rpc_async(next, linear, (next_w, RTensor(h), false))
            .await
    })
    .await??;
    Ok(RTensor((out.0 * 2.0)?))
}

/// The gradient of parameter `w` in autograd context `ctx_id` on this worker.
#[remote]
pub async fn param_grad(
    ctx: CallContext,
    ctx_id: u64,
    w: String,
) -> Result<Option<RTensor>, BoxError> {
    let v = param(&ctx, &w)?;
    Ok(autograd_dist::gradients(ctx.agent(), ctx_id)
        .remove(&v.as_tensor().id())
        .map(RTensor))
}

/// Number of autograd contexts with state on this worker.
#[remote]
pub async fn live_contexts(ctx: CallContext) -> Result<usize, BoxError> {
    Ok(autograd_dist::live_contexts(ctx.agent()))
}

/// Returns its argument (tensors of any dtype and layout).
#[remote]
pub async fn echo_tensor(_ctx: CallContext, t: RTensor) -> Result<RTensor, BoxError> {
    Ok(t)
}

/// Where its argument landed on this worker (`cpu`, `cuda:0`), and the argument.
#[remote]
pub async fn device_of(_ctx: CallContext, t: RTensor) -> Result<(String, RTensor), BoxError> {
    Ok((autograd_dist::DeviceSpec::of(t.device()).to_string(), t))
}

/// Constructor of a remote tensor: `x @ W` kept on this worker.
#[remote]
pub async fn make_activation(ctx: CallContext, w: String, x: RTensor) -> Result<RTensor, BoxError> {
    Ok(RTensor(x.matmul(param(&ctx, &w)?.as_tensor())?))
}

/// A deterministic input batch.
pub fn input(rows: usize, cols: usize) -> Tensor {
    init_value("input", rows, cols)
        .to_dtype(DType::F64)
        .expect("f64")
}

/// A remote tensor's method: adds `t` to the tensor behind `this` (runs on its owner).
#[remote]
pub async fn add_to(
    _ctx: CallContext,
    this: rref::RRef<RTensor>,
    t: RTensor,
) -> Result<RTensor, BoxError> {
    let v = this.local_value().await?;
    let g = v.lock().await;
    Ok(RTensor((&g.0 + &t.0)?))
}

/// Calls `add_to` on a tensor reference from this worker (a user of it): RRef method proxy
/// with a tensor argument and result.
#[remote]
pub async fn keep_and_add(
    _ctx: CallContext,
    r: rref::RRef<RTensor>,
    t: RTensor,
) -> Result<RTensor, BoxError> {
    Ok(r.rpc_async(add_to, (t,)).await?)
}

/// References to this worker's parameters `names`, for a `DistributedOptimizer`.
#[remote]
pub async fn param_refs(
    ctx: CallContext,
    names: Vec<String>,
) -> Result<Vec<rref::RRef<autograd_dist::Parameter>>, BoxError> {
    let vars = names
        .iter()
        .map(|n| param(&ctx, n))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(autograd_dist::parameter_rrefs(ctx.agent(), vars))
}

/// The current value of this worker's parameter `name`.
#[remote]
pub async fn param_value(ctx: CallContext, name: String) -> Result<RTensor, BoxError> {
    Ok(RTensor(param(&ctx, &name)?.as_tensor().detach()))
}

/// Overwrites this worker's parameter `name`.
#[remote]
pub async fn set_param(ctx: CallContext, name: String, value: RTensor) -> Result<(), BoxError> {
    param(&ctx, &name)?.set(&value.0)?;
    Ok(())
}

/// A module for the remote-module tests: `x @ W` (then ReLU if asked), `W` initialized by
/// [`init_value`] under its name.
pub struct StageLinear {
    w: Var,
    relu: bool,
}

impl autograd_dist::Module for StageLinear {
    const NAME: &'static str = "tests::StageLinear";
    /// (name, rows, cols, relu)
    type Init = (String, usize, usize, bool);
    fn new((name, rows, cols, relu): Self::Init, device: &Device) -> candle_core::Result<Self> {
        Ok(Self {
            w: Var::from_tensor(&init_value(&name, rows, cols).to_device(device)?)?,
            relu,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(self.w.as_tensor())?;
        if self.relu {
            y.relu()
        } else {
            Ok(y)
        }
    }
    fn parameters(&self) -> Vec<Var> {
        vec![self.w.clone()]
    }
}

/// Adds these functions and the engine's to `b` (which must already have `rref::install`).
pub fn register(b: rpc_core::RegistryBuilder) -> rpc_core::RegistryBuilder {
    b.register(init_param)
        .and_then(|b| b.register(param_refs))
        .and_then(|b| b.register(param_value))
        .and_then(|b| b.register(set_param))
        .and_then(|b| b.register(linear))
        .and_then(|b| b.register(linear_then))
        .and_then(|b| b.register(linear_then_spawned))
        .and_then(|b| b.register(linear_then_bare_spawned))
        .and_then(|b| b.register(param_grad))
        .and_then(|b| b.register(live_contexts))
        .and_then(|b| b.register(echo_tensor))
        .and_then(|b| b.register(device_of))
        .and_then(|b| b.register(make_activation))
        .and_then(|b| b.register(add_to))
        .and_then(|b| b.register(keep_and_add))
        .and_then(autograd_dist::register_module::<StageLinear>)
        .and_then(autograd_dist::install)
        .expect("distinct names")
}
