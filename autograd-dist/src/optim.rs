//! [`DistributedOptimizer`]: steps every parameter where it lives.
//!
//! Built from the parameters' remote references, grouped by owner: each owner gets one local
//! optimizer (created there with `remote`) holding its parameters and their optimizer state.
//! `step(ctx)` runs concurrently on every owner with that context's gradients, as PyTorch's
//! `torch.distributed.optim.DistributedOptimizer` does. The update rules are PyTorch's:
//! SGD with momentum and (coupled) weight decay; Adam with coupled weight decay, AdamW with
//! decoupled weight decay, both bias-corrected. (candle-nn's optimizers take a `GradStore`, which
//! cannot be built outside candle, so the rules are written out here.)

use candle_core::{Tensor, Var};
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use rref::{RRef, RRefError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

use crate::engine;
use crate::error::AutogradError;
use crate::tensor::RTensor;

/// A trainable parameter. Keep it where it is used (`RRef::new` on its owner); `to_here` gives
/// a detached copy.
#[derive(Clone, Debug)]
pub struct Parameter(pub Var);

impl Parameter {
    /// A parameter initialized with `t`.
    pub fn new(t: &Tensor) -> candle_core::Result<Self> {
        Ok(Self(Var::from_tensor(t)?))
    }
}

impl Serialize for Parameter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RTensor(self.0.as_tensor().detach()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Parameter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = RTensor::deserialize(d)?;
        Var::from_tensor(&t.0)
            .map(Parameter)
            .map_err(serde::de::Error::custom)
    }
}

/// Owner-local references to a shard's parameters, to return from a remote method and hand to
/// a [`DistributedOptimizer`] (PyTorch's `parameter_rrefs()`). The references share the
/// variables: optimizer steps update the shard's model in place.
///
/// ```
/// # async fn demo(agent: rpc_core::Agent) {
/// let varmap = candle_nn::VarMap::new();
/// let refs = autograd_dist::parameter_rrefs(&agent, varmap.all_vars());
/// # }
/// ```
pub fn parameter_rrefs(agent: &Agent, vars: impl IntoIterator<Item = Var>) -> Vec<RRef<Parameter>> {
    vars.into_iter()
        .map(|v| RRef::new(agent, Parameter(v)))
        .collect()
}

/// The variable behind a parameter reference (on its owner).
pub async fn parameter_var(p: &RRef<Parameter>) -> Result<Var, RRefError> {
    Ok(p.local_value().await?.lock().await.0.clone())
}

/// Which update rule, with its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum OptimizerKind {
    /// `p -= lr * buf`, `buf = momentum * buf + (g + weight_decay * p)`.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0: none).
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// Adam (`decoupled = false`) or AdamW (`decoupled = true`).
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
        /// Weight decay (L2 for Adam, decoupled for AdamW).
        weight_decay: f64,
        /// AdamW's decoupled weight decay.
        decoupled: bool,
    },
}

impl OptimizerKind {
    /// SGD without momentum or weight decay.
    pub fn sgd(lr: f64) -> Self {
        Self::Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }

    /// Adam with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
    pub fn adam(lr: f64) -> Self {
        Self::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }

    /// AdamW with PyTorch's defaults (weight decay 0.01).
    pub fn adamw(lr: f64) -> Self {
        Self::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        }
    }
}

/// One owner's optimizer: its parameters and their state. Lives on the owner; it cannot be
/// copied to another worker.
pub struct LocalOptimizer {
    kind: OptimizerKind,
    params: Vec<RRef<Parameter>>,
    /// Momentum buffer (SGD) or first moment (Adam), per parameter.
    m: Vec<Option<Tensor>>,
    /// Second moment (Adam), per parameter.
    v: Vec<Option<Tensor>>,
    steps: u64,
}

impl Serialize for LocalOptimizer {
    fn serialize<S: Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "an optimizer stays on its owner; it cannot be copied",
        ))
    }
}

impl<'de> Deserialize<'de> for LocalOptimizer {
    fn deserialize<D: Deserializer<'de>>(_d: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "an optimizer stays on its owner; it cannot be copied",
        ))
    }
}

impl LocalOptimizer {
    async fn step(&mut self, agent: &Agent, ctx: u64) -> Result<usize, BoxError> {
        let grads = engine::gradients(agent, ctx);
        self.steps += 1;
        let t = self.steps as i32;
        let mut updated = 0;
        for i in 0..self.params.len() {
            let var = parameter_var(&self.params[i]).await?;
            let Some(g) = grads.get(&var.as_tensor().id()) else {
                continue;
            };
            let p = var.as_tensor().detach();
            let new = update(self.kind, &p, g, &mut self.m[i], &mut self.v[i], t)?;
            var.set(&new)?;
            updated += 1;
        }
        Ok(updated)
    }
}

/// One update of parameter `p` with gradient `g` at step `t` (1-based); `m` and `v` are the
/// parameter's optimizer state, created on first use.
fn update(
    kind: OptimizerKind,
    p: &Tensor,
    g: &Tensor,
    m: &mut Option<Tensor>,
    v: &mut Option<Tensor>,
    t: i32,
) -> candle_core::Result<Tensor> {
    match kind {
        OptimizerKind::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            let g = if weight_decay != 0.0 {
                (g + (p * weight_decay)?)?
            } else {
                g.clone()
            };
            let d = if momentum != 0.0 {
                let buf = match m.take() {
                    Some(b) => ((b * momentum)? + g)?,
                    None => g,
                };
                *m = Some(buf.clone());
                buf
            } else {
                g
            };
            p - (d * lr)?
        }
        OptimizerKind::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => {
            let g = if weight_decay != 0.0 && !decoupled {
                (g + (p * weight_decay)?)?
            } else {
                g.clone()
            };
            let p = if weight_decay != 0.0 && decoupled {
                (p * (1.0 - lr * weight_decay))?
            } else {
                p.clone()
            };
            let m1 = match m.take() {
                Some(m) => ((m * beta1)? + (&g * (1.0 - beta1))?)?,
                None => (&g * (1.0 - beta1))?,
            };
            let v1 = match v.take() {
                Some(v) => ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?,
                None => (g.sqr()? * (1.0 - beta2))?,
            };
            let m_hat = (&m1 / (1.0 - beta1.powi(t)))?;
            let v_hat = (&v1 / (1.0 - beta2.powi(t)))?;
            *m = Some(m1);
            *v = Some(v1);
            p - ((m_hat / (v_hat.sqrt()? + eps)?)? * lr)?
        }
    }
}

/// Creates an owner's local optimizer (runs on the owner).
struct NewLocalOptimizer;

impl RemoteFn for NewLocalOptimizer {
    const NAME: &'static str = "autograd_dist::new_local_optimizer";
    type Args = (OptimizerKind, Vec<RRef<Parameter>>);
    type Output = LocalOptimizer;
    async fn call(
        _cx: CallContext,
        (kind, params): Self::Args,
    ) -> Result<LocalOptimizer, BoxError> {
        let n = params.len();
        Ok(LocalOptimizer {
            kind,
            params,
            m: vec![None; n],
            v: vec![None; n],
            steps: 0,
        })
    }
}

/// Runs one step of an owner's local optimizer with context `ctx`'s gradients.
struct LocalStep;

impl RemoteFn for LocalStep {
    const NAME: &'static str = "autograd_dist::local_step";
    type Args = (RRef<LocalOptimizer>, u64);
    type Output = usize;
    async fn call(cx: CallContext, (opt, ctx): Self::Args) -> Result<usize, BoxError> {
        let local = opt.local_value().await?;
        let mut guard = local.lock().await;
        guard.step(cx.agent(), ctx).await
    }
}

/// Steps parameters on every worker that owns some, from one place.
///
/// ```no_run
/// # async fn demo(agent: rpc_core::Agent, params: Vec<rref::RRef<autograd_dist::Parameter>>,
/// #               ctx: autograd_dist::DistContext) -> Result<(), autograd_dist::AutogradError> {
/// use autograd_dist::{DistributedOptimizer, OptimizerKind};
/// let opt = DistributedOptimizer::new(&agent, OptimizerKind::adam(1e-3), params)?;
/// opt.step(&ctx).await?;
/// # Ok(()) }
/// ```
pub struct DistributedOptimizer {
    agent: Agent,
    locals: Vec<(u32, RRef<LocalOptimizer>)>,
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let owners: Vec<u32> = self.locals.iter().map(|(o, _)| *o).collect();
        f.debug_struct("DistributedOptimizer")
            .field("owners", &owners)
            .finish()
    }
}

impl DistributedOptimizer {
    /// Groups `params` by owner and creates a local optimizer on each owner (returns at once;
    /// creation errors surface at the first step).
    pub fn new(
        agent: &Agent,
        kind: OptimizerKind,
        params: Vec<RRef<Parameter>>,
    ) -> Result<Self, AutogradError> {
        let mut by_owner: BTreeMap<u32, Vec<RRef<Parameter>>> = BTreeMap::new();
        for p in params {
            by_owner.entry(p.owner().0).or_default().push(p);
        }
        let mut locals = Vec::new();
        for (owner, ps) in by_owner {
            let r = rref::remote(agent, owner, NewLocalOptimizer, (kind, ps)).map_err(|e| {
                AutogradError::Optimizer {
                    worker: format!("rank {owner}"),
                    message: e.to_string(),
                }
            })?;
            locals.push((owner, r));
        }
        Ok(Self {
            agent: agent.clone(),
            locals,
        })
    }

    /// One step on every owner, concurrently, with `ctx`'s gradients. Returns the number of
    /// parameters updated (those that received a gradient).
    pub async fn step(&self, ctx: &crate::engine::DistContext) -> Result<usize, AutogradError> {
        let id = ctx.id();
        let calls = self.locals.iter().map(|(owner, opt)| {
            let agent = self.agent.clone();
            let call = rpc_core::with_call_meta(
                crate::engine::CTX_KEY,
                None,
                opt.rpc_async(LocalStep, (id,)),
            );
            async move {
                call.await.map_err(|source| AutogradError::Rpc {
                    worker: agent.name_of(*owner),
                    source: Box::new(source),
                })
            }
        });
        Ok(futures::future::try_join_all(calls)
            .await?
            .into_iter()
            .sum())
    }
}

pub(crate) fn register(
    b: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    b.register(NewLocalOptimizer)?.register(LocalStep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn scalar(x: f64) -> Tensor {
        Tensor::new(&[x], &Device::Cpu).unwrap()
    }

    fn get(t: &Tensor) -> f64 {
        t.to_vec1::<f64>().unwrap()[0]
    }

    #[test]
    fn sgd_with_momentum_and_weight_decay_follows_pytorch() {
        let kind = OptimizerKind::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let (mut m, mut v) = (None, None);
        // Step 1: d = g + wd p = 0.5 + 0.01; buf = d; p = 1 - 0.1 d.
        let p1 = update(kind, &scalar(1.0), &scalar(0.5), &mut m, &mut v, 1).unwrap();
        let d1 = 0.5 + 0.01 * 1.0;
        assert!((get(&p1) - (1.0 - 0.1 * d1)).abs() < 1e-12);
        // Step 2: buf = 0.9 buf + (g + wd p).
        let p2 = update(kind, &p1, &scalar(0.2), &mut m, &mut v, 2).unwrap();
        let buf2 = 0.9 * d1 + (0.2 + 0.01 * get(&p1));
        assert!((get(&p2) - (get(&p1) - 0.1 * buf2)).abs() < 1e-12);
    }

    #[test]
    fn adam_with_l2_penalty_follows_pytorch() {
        let kind = OptimizerKind::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: false,
        };
        let (mut m, mut v) = (None, None);
        let (mut p, mut em, mut ev) = (1.0f64, 0.0f64, 0.0f64);
        let mut pt = scalar(p);
        for (t, g) in [(1, 0.3f64), (2, -0.2), (3, 0.05)] {
            pt = update(kind, &pt, &scalar(g), &mut m, &mut v, t).unwrap();
            let g = g + 0.1 * p;
            em = 0.9 * em + 0.1 * g;
            ev = 0.999 * ev + 0.001 * g * g;
            let (mh, vh) = (em / (1.0 - 0.9f64.powi(t)), ev / (1.0 - 0.999f64.powi(t)));
            p -= 0.01 * mh / (vh.sqrt() + 1e-8);
            assert!((get(&pt) - p).abs() < 1e-12, "step {t}");
        }
    }
}
