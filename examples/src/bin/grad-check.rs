//! Distributed gradients against single-process gradients, over real processes on loopback.
//!
//! `cargo run --release -p examples --bin grad-check` starts two worker processes (this process
//! is the trainer, rank 0) and prints one JSON line per case with `case`, `max_abs_diff` and
//! `ok` (gradients within 1e-6, trained parameters within 1e-5). The exit status is non-zero
//! if any case fails.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use autograd_dist::{DistributedOptimizer, OptimizerKind, Parameter, RTensor};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use rpc_core::{remote, Agent, BoxError, CallContext, Registry};
use rref::RRef;

fn params() -> &'static Mutex<HashMap<String, RRef<Parameter>>> {
    static P: OnceLock<Mutex<HashMap<String, RRef<Parameter>>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// Deterministic initial values.
fn init_value(name: &str, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let salt = name
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    let v: Vec<f64> = (0..n as u64)
        .map(|i| {
            ((i.wrapping_mul(2_654_435_761).wrapping_add(salt) % 1000) as f64 / 1000.0 - 0.5) * 0.6
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("shape matches")
}

async fn var(name: &str) -> Result<Var, BoxError> {
    let p = params()
        .lock()
        .unwrap()
        .get(name)
        .cloned()
        .ok_or_else(|| format!("no parameter {name}"))?;
    Ok(autograd_dist::parameter_var(&p).await?)
}

/// Creates parameter `name` here; returns its reference.
#[remote]
async fn make_param(
    ctx: CallContext,
    name: String,
    shape: Vec<usize>,
) -> Result<RRef<Parameter>, BoxError> {
    let p = RRef::new(ctx.agent(), Parameter::new(&init_value(&name, &shape))?);
    params().lock().unwrap().insert(name, p.clone());
    Ok(p)
}

/// `x @ W` (+ ReLU).
#[remote]
async fn linear(_ctx: CallContext, w: String, x: RTensor, relu: bool) -> Result<RTensor, BoxError> {
    let y = x.matmul(var(&w).await?.as_tensor())?;
    Ok(RTensor(if relu { y.relu()? } else { y }))
}

/// `tanh(x @ W)` here, then worker `next` applies `next_w` (nested call), times 2.
#[remote]
async fn linear_then(
    ctx: CallContext,
    w: String,
    x: RTensor,
    next: u32,
    next_w: String,
) -> Result<RTensor, BoxError> {
    let h = x.matmul(var(&w).await?.as_tensor())?.tanh()?;
    let out = ctx
        .agent()
        .rpc_async(next, linear, (next_w, RTensor(h), false))
        .await?;
    Ok(RTensor((out.0 * 2.0)?))
}

/// Embedding lookup with this worker's table `e`: ids (batch, seq) -> (batch, seq, emb).
#[remote]
async fn embed(_ctx: CallContext, e: String, ids: RTensor) -> Result<RTensor, BoxError> {
    let table = var(&e).await?;
    let (b, s) = ids.dims2()?;
    let flat = table.as_tensor().embedding(&ids.flatten_all()?)?;
    Ok(RTensor(flat.reshape((b, s, ()))?))
}

/// Constructor of a remote activation `x @ W`, kept here.
#[remote]
async fn activation(_ctx: CallContext, w: String, x: RTensor) -> Result<RTensor, BoxError> {
    Ok(RTensor(x.matmul(var(&w).await?.as_tensor())?))
}

/// Gradient of parameter `w` in context `ctx_id`.
#[remote]
async fn grad_of(ctx: CallContext, ctx_id: u64, w: String) -> Result<Option<RTensor>, BoxError> {
    let v = var(&w).await?;
    Ok(autograd_dist::gradients(ctx.agent(), ctx_id)
        .remove(&v.as_tensor().id())
        .map(RTensor))
}

/// Current value of parameter `w`.
#[remote]
async fn value_of(_ctx: CallContext, w: String) -> Result<RTensor, BoxError> {
    Ok(RTensor(var(&w).await?.as_tensor().detach()))
}

/// Drops every parameter of this process.
#[remote]
async fn drop_params(_ctx: CallContext) -> Result<(), BoxError> {
    let all: Vec<_> = params().lock().unwrap().drain().collect();
    drop(all);
    Ok(())
}

fn registry() -> Result<Registry> {
    let b = Registry::builder()
        .register(make_param)?
        .register(linear)?
        .register(linear_then)?
        .register(embed)?
        .register(activation)?
        .register(grad_of)?
        .register(value_of)?
        .register(drop_params)?;
    Ok(autograd_dist::install(rref::install(b)?)?.build())
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    if examples::is_worker() {
        return rt.block_on(examples::serve_until_shutdown(
            registry()?,
            Duration::from_secs(120),
        ));
    }
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!(
                "grad-check: distributed autograd against one process: each case (an MLP split \
                 over three workers, round trips, unused outputs, a parameter server, 20 \
                 optimizer steps) prints a JSON line with its largest gradient difference.\n\n\
                 usage: grad-check (no arguments)"
            );
            return Ok(());
        }
        Some(a) => anyhow::bail!("grad-check takes no arguments, not {a:?}"),
    }
    let workers = examples::Workers::spawn(3)?;
    let all_ok = rt.block_on(async {
        let agent = rpc_core::init(
            workers.rank0_config("trainer", Duration::from_secs(120)),
            registry()?,
        )
        .await?;
        let result = run_cases(&agent).await;
        for w in 0..3u32 {
            agent.rpc_async(w, drop_params, ()).await?;
        }
        let report = agent.shutdown().await;
        anyhow::ensure!(report.is_clean(), "trainer shutdown: {report:?}");
        result
    })?;
    workers.wait_success(Duration::from_secs(60))?;
    anyhow::ensure!(all_ok, "some cases failed");
    Ok(())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

fn report(case: &str, diff: f64, tol: f64, extra: serde_json::Value) -> bool {
    let ok = diff <= tol;
    let mut v =
        serde_json::json!({ "case": case, "max_abs_diff": diff, "tolerance": tol, "ok": ok });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        for (k, x) in e {
            o.insert(k.clone(), x.clone());
        }
    }
    println!("{v}");
    ok
}

/// A parameter `name` of `shape` on `worker`; returns the reference and a local copy.
async fn param(
    agent: &Agent,
    worker: u32,
    name: &str,
    shape: &[usize],
) -> Result<(RRef<Parameter>, Var)> {
    let r = agent
        .rpc_async(worker, make_param, (name.to_string(), shape.to_vec()))
        .await?;
    Ok((r, Var::from_tensor(&init_value(name, shape))?))
}

async fn grad(agent: &Agent, worker: u32, ctx: u64, name: &str) -> Result<Tensor> {
    Ok(agent
        .rpc_async(worker, grad_of, (ctx, name.to_string()))
        .await?
        .with_context(|| format!("no gradient for {name}"))?
        .0)
}

/// Largest difference between distributed and local gradients of `(worker, name, local)`.
async fn compare(
    agent: &Agent,
    ctx: u64,
    local_loss: &Tensor,
    ps: &[(u32, &str, &Var)],
) -> Result<f64> {
    let g = local_loss.backward()?;
    let mut worst = 0f64;
    for (w, name, v) in ps {
        let local = g
            .get(v.as_tensor())
            .with_context(|| format!("no local gradient for {name}"))?;
        worst = worst.max(max_abs_diff(&grad(agent, *w, ctx, name).await?, local)?);
    }
    Ok(worst)
}

fn input(rows: usize, cols: usize) -> Tensor {
    init_value("input", &[rows, cols])
}

async fn run_cases(a: &Agent) -> Result<bool> {
    let mut ok = true;
    let t = 1e-6;

    // 1. An MLP split over three workers.
    let (_p0, w0) = param(a, 0, "mlp.w0", &[4, 8]).await?;
    let (_p1, w1) = param(a, 1, "mlp.w1", &[8, 6]).await?;
    let (_p2, w2) = param(a, 2, "mlp.w2", &[6, 3]).await?;
    let x = input(5, 4);
    let ctx = autograd_dist::context(a);
    let loss = ctx
        .run(async {
            let h0 = a
                .rpc_async(0u32, linear, ("mlp.w0".into(), RTensor(x.clone()), true))
                .await?;
            let h1 = a
                .rpc_async(1u32, linear, ("mlp.w1".into(), h0, true))
                .await?;
            let h2 = a
                .rpc_async(2u32, linear, ("mlp.w2".into(), h1, false))
                .await?;
            anyhow::Ok(h2.0.sqr()?.mean_all()?)
        })
        .await?;
    ctx.backward(std::slice::from_ref(&loss)).await?;
    let local = x
        .matmul(w0.as_tensor())?
        .relu()?
        .matmul(w1.as_tensor())?
        .relu()?
        .matmul(w2.as_tensor())?
        .sqr()?
        .mean_all()?;
    let d = compare(
        a,
        ctx.id(),
        &local,
        &[(0, "mlp.w0", &w0), (1, "mlp.w1", &w1), (2, "mlp.w2", &w2)],
    )
    .await?;
    ok &= report("mlp_split_over_3_workers", d, t, serde_json::json!({}));
    ctx.release().await?;

    // 2-4. A→B→A round trip, one tensor sent to two workers, an output unused by the loss.
    let (_q0, v0) = param(a, 0, "rt.w0", &[3, 4]).await?;
    let (_q1, v1) = param(a, 1, "rt.w1", &[4, 4]).await?;
    let (_q2, vv) = param(a, 0, "rt.v", &[4, 2]).await?;
    let (_q3, v2) = param(a, 2, "rt.w2", &[4, 2]).await?;
    let x = input(2, 3);
    for case in [
        "round_trip_a_b_a",
        "one_tensor_to_two_workers",
        "rpc_output_unused_by_loss",
    ] {
        let ctx = autograd_dist::context(a);
        let loss = ctx
            .run(async {
                let h0 = a
                    .rpc_async(0u32, linear, ("rt.w0".into(), RTensor(x.clone()), false))
                    .await?;
                let r = a
                    .rpc_async(
                        1u32,
                        linear_then,
                        ("rt.w1".into(), h0.clone(), 0, "rt.v".into()),
                    )
                    .await?;
                let l = match case {
                    "round_trip_a_b_a" => r.0.sum_all()?,
                    _ => {
                        let s = a
                            .rpc_async(2u32, linear, ("rt.w2".into(), h0.clone(), false))
                            .await?;
                        if case == "rpc_output_unused_by_loss" {
                            let _unused = a
                                .rpc_async(2u32, linear, ("rt.w2".into(), h0, true))
                                .await?;
                        }
                        (r.0 + s.0)?.sum_all()?
                    }
                };
                anyhow::Ok(l)
            })
            .await?;
        tokio::time::timeout(Duration::from_secs(30), ctx.backward(&[loss]))
            .await
            .context("backward hung")??;
        let h0 = x.matmul(v0.as_tensor())?;
        let r = (h0.matmul(v1.as_tensor())?.tanh()?.matmul(vv.as_tensor())? * 2.0)?;
        let (local, mut ps) = match case {
            "round_trip_a_b_a" => (
                r.sum_all()?,
                vec![(0u32, "rt.w0", &v0), (1, "rt.w1", &v1), (0, "rt.v", &vv)],
            ),
            _ => (
                (r + h0.matmul(v2.as_tensor())?)?.sum_all()?,
                vec![(0u32, "rt.w0", &v0), (1, "rt.w1", &v1), (0, "rt.v", &vv)],
            ),
        };
        if case != "round_trip_a_b_a" {
            ps.push((2, "rt.w2", &v2));
        }
        let d = compare(a, ctx.id(), &local, &ps).await?;
        ok &= report(case, d, t, serde_json::json!({}));
        ctx.release().await?;
    }

    // 5. to_here inside a context.
    let (_r1, u1) = param(a, 1, "th.w1", &[3, 3]).await?;
    let x = input(2, 3);
    let ctx = autograd_dist::context(a);
    let act = rref::remote(a, 1u32, activation, ("th.w1".into(), RTensor(x.clone())))?;
    let loss = ctx
        .run(async { anyhow::Ok(act.to_here().await?.0.sqr()?.sum_all()?) })
        .await?;
    ctx.backward(&[loss]).await?;
    let local = x.matmul(u1.as_tensor())?.sqr()?.sum_all()?;
    let d = compare(a, ctx.id(), &local, &[(1, "th.w1", &u1)]).await?;
    ok &= report("to_here_inside_context", d, t, serde_json::json!({}));
    ctx.release().await?;
    drop(act);

    // 6. The shape of PyTorch's rpc/rnn example: embedding table and decoder on a parameter
    // server (rank 1), an LSTM on the trainer (rank 0).
    ok &= rnn_case(a).await?;

    // 7. 20 steps of distributed training against candle-nn's optimizers in one process.
    for (name, kind) in [
        ("train_20_steps_sgd", OptimizerKind::sgd(0.2)),
        ("train_20_steps_adamw", OptimizerKind::adamw(0.01)),
    ] {
        ok &= train_case(a, name, kind).await?;
    }
    Ok(ok)
}

fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// One LSTM over `xs` (batch, seq, emb) with hidden size `h`: returns the last hidden state.
fn lstm(
    xs: &Tensor,
    wih: &Tensor,
    whh: &Tensor,
    b: &Tensor,
    h: usize,
) -> candle_core::Result<Tensor> {
    let (batch, seq, _) = xs.dims3()?;
    let mut hs = Tensor::zeros((batch, h), DType::F64, &Device::Cpu)?;
    let mut cs = hs.clone();
    for s in 0..seq {
        let x = xs.narrow(1, s, 1)?.squeeze(1)?;
        let gates = x.matmul(wih)?.add(&hs.matmul(whh)?)?.broadcast_add(b)?;
        let i = sigmoid(&gates.narrow(1, 0, h)?)?;
        let f = sigmoid(&gates.narrow(1, h, h)?)?;
        let g = gates.narrow(1, 2 * h, h)?.tanh()?;
        let o = sigmoid(&gates.narrow(1, 3 * h, h)?)?;
        cs = ((f * cs)? + (i * g)?)?;
        hs = (o * cs.tanh()?)?;
    }
    Ok(hs)
}

async fn rnn_case(a: &Agent) -> Result<bool> {
    let (vocab, emb, hid) = (20usize, 6usize, 5usize);
    let (_e, e) = param(a, 1, "rnn.emb", &[vocab, emb]).await?;
    let (_d, d) = param(a, 1, "rnn.dec", &[hid, vocab]).await?;
    let wih = Var::from_tensor(&init_value("rnn.wih", &[emb, 4 * hid]))?;
    let whh = Var::from_tensor(&init_value("rnn.whh", &[hid, 4 * hid]))?;
    let bias = Var::from_tensor(&init_value("rnn.b", &[4 * hid]))?;
    let ids = Tensor::from_vec(
        (0..3 * 7)
            .map(|i| (i * 7 % vocab) as u32)
            .collect::<Vec<_>>(),
        (3, 7),
        &Device::Cpu,
    )?;
    let ctx = autograd_dist::context(a);
    let loss = ctx
        .run(async {
            let xs = a
                .rpc_async(1u32, embed, ("rnn.emb".into(), RTensor(ids.clone())))
                .await?;
            let h = lstm(
                &xs.0,
                wih.as_tensor(),
                whh.as_tensor(),
                bias.as_tensor(),
                hid,
            )?;
            let logits = a
                .rpc_async(1u32, linear, ("rnn.dec".into(), RTensor(h), false))
                .await?;
            anyhow::Ok(logits.0.sqr()?.mean_all()?)
        })
        .await?;
    ctx.backward(std::slice::from_ref(&loss)).await?;
    let xs = e
        .as_tensor()
        .embedding(&ids.flatten_all()?)?
        .reshape((3, 7, emb))?;
    let h = lstm(&xs, wih.as_tensor(), whh.as_tensor(), bias.as_tensor(), hid)?;
    let local = h.matmul(d.as_tensor())?.sqr()?.mean_all()?;
    let g = local.backward()?;
    // Trainer-side parameters: the trainer's own gradients in the context.
    let mine = ctx.gradients();
    let mut worst = 0f64;
    for v in [&wih, &whh, &bias] {
        let dist = mine
            .get(&v.as_tensor().id())
            .context("no trainer gradient")?;
        worst = worst.max(max_abs_diff(
            dist,
            g.get(v.as_tensor()).context("no local gradient")?,
        )?);
    }
    for (name, v) in [("rnn.emb", &e), ("rnn.dec", &d)] {
        let local_g = g.get(v.as_tensor()).context("no local gradient")?;
        worst = worst.max(max_abs_diff(&grad(a, 1, ctx.id(), name).await?, local_g)?);
    }
    ctx.release().await?;
    Ok(report(
        "rnn_embedding_decoder_on_parameter_server",
        worst,
        1e-6,
        serde_json::json!({}),
    ))
}

/// One step of the single-process reference optimizer.
type LocalStep = Box<dyn FnMut(&candle_core::backprop::GradStore) -> candle_core::Result<()>>;

async fn train_case(a: &Agent, case: &str, kind: OptimizerKind) -> Result<bool> {
    let names = [
        (0u32, format!("{case}.w0"), [4usize, 8]),
        (1, format!("{case}.w1"), [8, 6]),
        (2, format!("{case}.w2"), [6, 3]),
    ];
    let mut refs = Vec::new();
    let mut locals = Vec::new();
    for (w, n, s) in &names {
        let (r, v) = param(a, *w, n, s).await?;
        refs.push(r);
        locals.push(v);
    }
    let opt = DistributedOptimizer::new(a, kind, refs)?;
    let mut local_opt: LocalStep = match kind {
        OptimizerKind::Sgd { lr, .. } => {
            let mut o = candle_nn::SGD::new(locals.clone(), lr)?;
            Box::new(move |g| o.step(g))
        }
        OptimizerKind::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } => {
            let p = candle_nn::ParamsAdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            };
            let mut o = candle_nn::AdamW::new(locals.clone(), p)?;
            Box::new(move |g| o.step(g))
        }
        _ => anyhow::bail!("unsupported optimizer in grad-check"),
    };
    let mut updated = usize::MAX;
    for step in 0..20 {
        let x = init_value(&format!("batch{step}"), &[5, 4]);
        let target = init_value(&format!("target{step}"), &[5, 3]);
        let ctx = autograd_dist::context(a);
        let loss = ctx
            .run(async {
                let h0 = a
                    .rpc_async(0u32, linear, (names[0].1.clone(), RTensor(x.clone()), true))
                    .await?;
                let h1 = a
                    .rpc_async(1u32, linear, (names[1].1.clone(), h0, true))
                    .await?;
                let h2 = a
                    .rpc_async(2u32, linear, (names[2].1.clone(), h1, false))
                    .await?;
                anyhow::Ok((h2.0 - &target)?.sqr()?.mean_all()?)
            })
            .await?;
        ctx.backward(&[loss]).await?;
        updated = updated.min(opt.step(&ctx).await?);
        ctx.release().await?;
        let local = x
            .matmul(locals[0].as_tensor())?
            .relu()?
            .matmul(locals[1].as_tensor())?
            .relu()?
            .matmul(locals[2].as_tensor())?;
        let l = (local - &target)?.sqr()?.mean_all()?;
        local_opt(&l.backward()?)?;
    }
    let mut worst = 0f64;
    let mut moved = f64::INFINITY;
    for ((w, n, s), v) in names.iter().zip(&locals) {
        let remote_value = a.rpc_async(*w, value_of, (n.clone(),)).await?;
        worst = worst.max(max_abs_diff(&remote_value.0, v.as_tensor())?);
        moved = moved.min(max_abs_diff(&remote_value.0, &init_value(n, s))?);
    }
    // Training must have moved every parameter (by 10x the tolerance), or matching would
    // prove nothing.
    let trained = moved > 1e-4 && updated == names.len();
    let diff = if trained { worst } else { f64::INFINITY };
    Ok(report(
        case,
        diff,
        1e-5,
        serde_json::json!({
            "steps": 20,
            "min_param_change": moved,
            "params_updated_per_step": updated,
        }),
    ))
}
