//! One pipeline stage's side of a step (`pipeline.rs` drives it from the master): its actions
//! in order, the hand-offs to and from its neighbours, and its saved activations. It knows a
//! module only as a forward function and its parameters, so `module.rs` can serve it.

use rpc_core::trace::Cat;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{DType, Tensor, Var, D};
use futures::channel::oneshot;
use futures::future::BoxFuture;
use rpc_core::ext::AgentExt;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use rref::RRef;
use serde::{Deserialize, Serialize};

use crate::dist_optim::Parameter;
use crate::error::AutogradError;
use crate::record::{container, creator, creator_of};
use crate::tensor::RTensor;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stage's module, as the stage side sees it.
pub(crate) trait StageModule: Send + Sync {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;
    fn parameters(&self) -> Vec<Var>;
}

/// One entry of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// The forward pass of a micro-batch.
    Forward(usize),
    /// Its backward pass.
    Backward(usize),
}

/// The loss the last stage computes from its output and the targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Loss {
    /// Cross-entropy of logits `[rows, classes]` against class indices `[rows]` (an integer
    /// tensor: u32, or u8 / i64; floats are refused).
    CrossEntropy,
    /// Squared error against targets of the output's shape, summed over each row.
    SquaredError,
}

impl Loss {
    /// The loss of `rows` rows of a batch of `batch` rows: the sum over these rows divided by
    /// `batch` (the micro-batches' losses add up to the whole batch's mean).
    pub fn compute(
        self,
        output: &Tensor,
        targets: &Tensor,
        batch: usize,
    ) -> candle_core::Result<Tensor> {
        let scale = 1.0 / batch as f64;
        self.check_targets(targets)
            .map_err(candle_core::Error::Msg)?;
        match self {
            Loss::CrossEntropy => {
                let max = output.max_keepdim(D::Minus1)?.detach();
                let shifted = output.broadcast_sub(&max)?;
                let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
                let logp = shifted.broadcast_sub(&lse)?;
                let idx = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
                logp.gather(&idx, 1)?.sum_all()?.affine(-scale, 0.0)
            }
            Loss::SquaredError => {
                let d = output.sub(&targets.to_dtype(output.dtype())?)?;
                d.sqr()?.sum_all()?.affine(scale, 0.0)
            }
        }
    }
}

impl Loss {
    /// Why `targets` cannot be this loss's targets, if they cannot: cross-entropy's are class
    /// indices, an integer tensor (a float one would be cast, -1 to class 0, 2.7 to 2).
    pub(crate) fn check_targets(self, targets: &Tensor) -> Result<(), String> {
        match self {
            Loss::CrossEntropy if targets.dtype().is_float() => Err(format!(
                "cross-entropy targets are class indices, an integer tensor, not {}",
                targets.dtype().as_str()
            )),
            _ => Ok(()),
        }
    }
}

/// What a [`Pipeline`] needs of a stage (implemented by every [`RemoteModule`]).
pub(crate) trait StageOps: Send + Sync + 'static {
    fn worker(&self) -> String;
    fn rank(&self) -> u32;
    fn run(&self, req: RunReq) -> BoxFuture<'static, Result<RunReply, AutogradError>>;
    fn forget(
        &self,
        pipe: u64,
        abort: Option<u64>,
    ) -> BoxFuture<'static, Result<(), AutogradError>>;
    fn parameters(&self) -> BoxFuture<'static, Result<Vec<RRef<Parameter>>, AutogradError>>;
}

/// One step's work for one stage: its actions, in order, and where its inputs come from and
/// its outputs go.
#[derive(Serialize, Deserialize)]
pub(crate) struct RunReq {
    pub pipe: u64,
    pub stage: u32,
    pub step: u64,
    pub actions: Vec<Action>,
    /// The micro-batches themselves (first stage).
    pub data: Vec<RTensor>,
    /// Last stage, training: the loss, the targets of each micro-batch and the batch's rows.
    pub loss: Option<(Loss, Vec<RTensor>, u64)>,
    /// Training: the context the parameters' gradients accumulate in.
    pub ctx: Option<u64>,
    /// The workers of the previous and the next stage.
    pub prev: Option<u32>,
    pub next: Option<u32>,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct RunReply {
    /// Each action's start and end, microseconds since the Unix epoch.
    pub spans: Vec<(u64, u64)>,
    /// Last stage, training: each micro-batch's loss.
    pub losses: Vec<f64>,
    /// Last stage, evaluation: each micro-batch's output.
    pub outputs: Vec<RTensor>,
    /// The most micro-batches whose activations were kept at once.
    pub live: u32,
}

/// What a stage hands its neighbour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum Kind {
    /// An output, to the next stage.
    Activation,
    /// The gradient of an input, to the previous stage.
    Gradient,
}

/// Addresses one hand-off: pipeline, receiving stage, step, kind, micro-batch.
type Key = (u64, u32, u64, Kind, u32);

enum Slot {
    Arrived(Tensor),
    Awaited(oneshot::Sender<Tensor>),
}

/// Tensors handed to this worker's stages by their neighbours, and the stages' saved
/// activations.
#[derive(Default)]
struct StageState {
    inbox: Mutex<Inbox>,
}

#[derive(Default)]
struct Inbox {
    slots: HashMap<Key, Slot>,
    /// By pipeline: the last step aborted (its hand-offs fail at once).
    aborted: HashMap<u64, u64>,
    /// The masters (`creator` of a pipeline id: rank and incarnation) declared failed: every
    /// step of their pipelines is aborted, and what they left here is dropped.
    failed: HashSet<u64>,
}

impl Inbox {
    fn is_aborted(&self, key: &Key) -> bool {
        self.failed.contains(&creator(key.0))
            || self.aborted.get(&key.0).is_some_and(|&s| key.2 <= s)
    }
}

/// This worker's stage state (created on first use, with the hook that drops what a failed
/// master's pipelines left: a stage's run the master's failure cancelled leaves hand-offs
/// nobody takes).
fn stage_state(agent: &Agent) -> Arc<StageState> {
    let mut created = false;
    let state = agent.extension(|| {
        created = true;
        StageState::default()
    });
    if created {
        let weak = Arc::downgrade(&state);
        agent.on_worker_failed(move |f| {
            if let Some(state) = weak.upgrade() {
                let tag = creator_of(f.rank, f.incarnation);
                let mut inbox = lock(&state.inbox);
                inbox.failed.insert(tag);
                inbox.slots.retain(|k, _| creator(k.0) != tag);
                inbox.aborted.retain(|&pipe, _| creator(pipe) != tag);
            }
        });
    }
    state
}

impl StageState {
    fn deliver(&self, key: Key, t: Tensor) {
        let mut inbox = lock(&self.inbox);
        if inbox.is_aborted(&key) {
            return;
        }
        match inbox.slots.remove(&key) {
            Some(Slot::Awaited(tx)) => {
                let _ = tx.send(t);
            }
            _ => {
                inbox.slots.insert(key, Slot::Arrived(t));
            }
        }
    }

    async fn take(&self, key: Key, timeout: std::time::Duration) -> Result<Tensor, BoxError> {
        let rx = {
            let mut inbox = lock(&self.inbox);
            if inbox.is_aborted(&key) {
                return Err(ABORTED.into());
            }
            match inbox.slots.remove(&key) {
                Some(Slot::Arrived(t)) => return Ok(t),
                _ => {
                    let (tx, rx) = oneshot::channel();
                    inbox.slots.insert(key, Slot::Awaited(tx));
                    rx
                }
            }
        };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(_)) => Err(ABORTED.into()),
            Err(_) => Err(format!(
                "no {:?} from the neighbouring stage within {timeout:?}",
                key.3
            )
            .into()),
        }
    }
}

/// Internal: a tensor from a neighbouring stage.
pub(crate) struct Deliver;

impl RemoteFn for Deliver {
    const NAME: &'static str = "autograd_dist::pipeline_deliver";
    type Args = (u64, u32, u64, Kind, u32, RTensor);
    type Output = ();
    async fn call(
        cx: CallContext,
        (pipe, stage, step, kind, mb, t): Self::Args,
    ) -> Result<(), BoxError> {
        stage_state(cx.agent()).deliver((pipe, stage, step, kind, mb), t.0);
        Ok(())
    }
}

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A micro-batch's saved activations on its stage.
struct Saved {
    /// The input as a leaf variable (`None` for the batch itself).
    input: Option<Tensor>,
    /// The output (the loss on the last stage), with its graph.
    output: Tensor,
}

/// One step of one stage, on its worker: its actions in order.
pub(crate) async fn stage_run(
    agent: &Agent,
    module: &dyn StageModule,
    req: RunReq,
) -> Result<RunReply, BoxError> {
    let state = stage_state(agent);
    let timeout = agent.wait_bound();
    let key = |kind, mb: usize| (req.pipe, req.stage, req.step, kind, mb as u32);
    let send = |to: u32, stage: u32, kind, mb: usize, t: Tensor| {
        let args = (req.pipe, stage, req.step, kind, mb as u32, RTensor(t));
        async move {
            agent
                .rpc_async(to, Deliver, args)
                .await
                .map_err(|e| format!("handing over to `{}`: {e}", agent.name_of(to)))
        }
    };
    let mut saved: HashMap<usize, Saved> = HashMap::new();
    let mut reply = RunReply {
        spans: Vec::with_capacity(req.actions.len()),
        losses: vec![
            0.0;
            req.data
                .len()
                .max(req.loss.as_ref().map_or(0, |l| l.1.len()))
        ],
        outputs: Vec::new(),
        live: 0,
    };
    for &action in &req.actions {
        let done: Result<(u64, u64), BoxError> = async {
            match action {
                Action::Forward(j) => {
                    let input = match req.data.get(j) {
                        Some(t) if req.stage == 0 => t.0.clone(),
                        _ => state.take(key(Kind::Activation, j), timeout).await?,
                    };
                    let start = now_us();
                    let mut span = agent.tracer().span(Cat::Pipeline, "forward");
                    span.detail(|| format!("micro-batch {j}, stage {}", req.stage));
                    let train = req.ctx.is_some();
                    let leaf = if train && input.dtype().is_float() {
                        Some(Var::from_tensor(&input)?.as_tensor().clone())
                    } else {
                        None
                    };
                    let y = module.forward(leaf.as_ref().unwrap_or(&input))?;
                    let kept = match (&req.loss, req.next) {
                        (Some((loss, targets, batch)), _) => {
                            let l = loss.compute(&y, &targets[j].0, *batch as usize)?;
                            reply.losses[j] = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                            l
                        }
                        (None, Some(next)) => {
                            send(next, req.stage + 1, Kind::Activation, j, y.detach()).await?;
                            y
                        }
                        (None, None) => {
                            reply.outputs.push(RTensor(y.detach()));
                            y
                        }
                    };
                    if train {
                        saved.insert(
                            j,
                            Saved {
                                input: leaf,
                                output: kept,
                            },
                        );
                        reply.live = reply.live.max(saved.len() as u32);
                    }
                    Ok((start, now_us()))
                }
                Action::Backward(j) => {
                    let ctx = req.ctx.ok_or("a backward pass outside training")?;
                    let grad = match req.next {
                        Some(_) => Some(state.take(key(Kind::Gradient, j), timeout).await?),
                        None => None,
                    };
                    let start = now_us();
                    let mut span = agent.tracer().span(Cat::Pipeline, "backward");
                    span.detail(|| format!("micro-batch {j}, stage {}", req.stage));
                    let s = saved.remove(&j).ok_or("backward before forward")?;
                    let input_grad = backward(agent, module, ctx, s, grad)?;
                    if let (Some(prev), Some(g)) = (req.prev, input_grad) {
                        send(prev, req.stage - 1, Kind::Gradient, j, g).await?;
                    }
                    Ok((start, now_us()))
                }
            }
        }
        .await;
        match done {
            Ok(span) => reply.spans.push(span),
            Err(e) => {
                let (pass, j) = match action {
                    Action::Forward(j) => ("forward", j),
                    Action::Backward(j) => ("backward", j),
                };
                return Err(format!("the {pass} of micro-batch {j}: {e}").into());
            }
        }
    }
    Ok(reply)
}

/// Backward of one micro-batch through `module`: its parameters' gradients add up in context
/// `ctx` on this worker; returns the gradient of its input (if it is a variable).
fn backward(
    agent: &Agent,
    module: &dyn StageModule,
    ctx: u64,
    saved: Saved,
    grad: Option<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let root = match grad {
        None => saved.output.sum_all()?,
        Some(g) => {
            let g = g
                .to_device(saved.output.device())?
                .to_dtype(saved.output.dtype())?;
            (&saved.output * g)?.sum_all()?
        }
    };
    // Weights used through `grad_once::matmul` get their gradients written once.
    let grads = crate::grad_once::backward(&root)?;
    let params = module.parameters();
    container(agent).with(ctx, |st| -> candle_core::Result<()> {
        for v in &params {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            // Without its graph: a parameter's gradient can hold the whole forward pass (a
            // parameter used directly as a product's operand gets `input.t() @ grad`).
            let g = g.detach();
            let acc = match st.grads.remove(&v.id()) {
                Some((_, old)) => (old + g)?,
                None => g,
            };
            st.grads.insert(v.id(), (v.as_tensor().clone(), acc));
        }
        Ok(())
    })?;
    saved
        .input
        .map(|x| grads.get(&x).cloned().map_or_else(|| x.zeros_like(), Ok))
        .transpose()
}

const ABORTED: &str = "the step was aborted (another stage failed)";

/// Drops what pipeline `pipe` has on this worker. With `abort`, that step and those before it
/// are aborted: a stage waiting for a neighbour in them stops, and so does one that would.
pub(crate) fn stage_forget(agent: &Agent, pipe: u64, abort: Option<u64>) {
    let state = stage_state(agent);
    let mut inbox = lock(&state.inbox);
    inbox.slots.retain(|k, _| k.0 != pipe);
    match abort {
        Some(step) => {
            let s = inbox.aborted.entry(pipe).or_insert(step);
            *s = (*s).max(step);
        }
        None => {
            inbox.aborted.remove(&pipe);
        }
    }
}
