//! The small model the data-parallel tests share: a group of in-process workers, a dataset,
//! three layers whose middle weight goes through `grad_once`, and its loss with cuts.

#![allow(dead_code)] // each test file uses its part

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use collectives::{DistributedDataParallel, Pass};
use integration_tests::{run, shutdown_all};
use rpc_core::{Agent, MemoryNetwork, Transport};

pub async fn group(n: u32) -> Vec<Agent> {
    integration_tests::collective_group(n, Transport::Memory(MemoryNetwork::new())).await
}

pub const ROWS: usize = 32;

/// 32 rows of 6 features and 3 targets.
pub fn dataset() -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..ROWS * 6)
        .map(|i| ((i * 37 % 101) as f64 / 101.0) - 0.5)
        .collect();
    let y: Vec<f64> = (0..ROWS * 3)
        .map(|i| ((i * 53 % 97) as f64 / 97.0) - 0.5)
        .collect();
    (
        Tensor::from_vec(x, (ROWS, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (ROWS, 3), &Device::Cpu).unwrap(),
    )
}

/// Three layers (w0 b0, w1 b1, w2), a scale shared by the first and last segment, and a
/// parameter the model never uses.
pub fn init_params(offset: f64) -> Vec<Var> {
    let mk = |r: usize, c: usize, salt: usize| {
        let v: Vec<f64> = (0..r * c)
            .map(|i| (((i * 31 + salt) % 17) as f64 / 17.0 - 0.5) * 0.5 + offset)
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()).unwrap()
    };
    vec![
        mk(6, 8, 1),
        mk(1, 8, 2),
        mk(8, 8, 3),
        mk(1, 8, 4),
        mk(8, 3, 5),
        mk(1, 1, 6),
        mk(2, 2, 7),
    ]
}

/// The model's forward, with `cut` at the segment ends (identity for one process).
pub fn loss(p: &[Var], x: &Tensor, y: &Tensor, mut cut: impl FnMut(&Tensor) -> Tensor) -> Tensor {
    let scale = p[5].as_tensor();
    let h = x
        .matmul(p[0].as_tensor())
        .unwrap()
        .broadcast_add(p[1].as_tensor())
        .unwrap();
    let h = h.tanh().unwrap().broadcast_mul(scale).unwrap();
    let h = cut(&h);
    // One layer's weight gradient written once (`grad_once`, which the overlapped pass and
    // the replicas' backward collect; one process's plain backward takes candle's path).
    let h = autograd_dist::grad_once::matmul(&h, p[2].as_tensor())
        .unwrap()
        .broadcast_add(p[3].as_tensor())
        .unwrap();
    let h = cut(&h.tanh().unwrap());
    let out = h
        .matmul(p[4].as_tensor())
        .unwrap()
        .broadcast_mul(scale)
        .unwrap();
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

pub fn rows(t: &Tensor, idx: &[usize]) -> Tensor {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    t.index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0)
        .unwrap()
}

/// What each member's pass returned (its gradients, or its error as text), and how long the
/// slower one took.
pub type Outcome = (Vec<Result<Vec<Tensor>, String>>, Duration);

/// A forward pass: the pass (for its cuts), the parameters, the inputs and the targets.
pub type Model = fn(&mut Pass<'_>, &[Var], &Tensor, &Tensor) -> Tensor;

/// The shared model, cut where its segments end.
pub fn model(pass: &mut Pass<'_>, p: &[Var], x: &Tensor, y: &Tensor) -> Tensor {
    loss(p, x, y, |h| pass.cut(h).unwrap())
}

/// Two members run `n` passes; in pass `i`, rank `r` runs `forward(i, r)`.
pub fn passes(n: usize, forward: impl Fn(usize, usize) -> Model) -> Vec<Outcome> {
    run(90, async {
        let a = group(2).await;
        let (x, y) = dataset();
        let ddps = futures::future::join_all(a.iter().map(|w| async move {
            let g = collectives::world(w);
            DistributedDataParallel::with_bucket_bytes(g, init_params(0.0), 200)
                .await
                .unwrap()
        }))
        .await;
        let pass = |r: usize, f: Model| {
            let (ddp, x, y) = (&ddps[r], x.clone(), y.clone());
            async move {
                let mut pass = ddp.pass();
                let l = f(&mut pass, ddp.vars(), &x, &y);
                let got = pass.backward(&l).await.map_err(|e| e.to_string())?;
                Ok(ddp
                    .vars()
                    .iter()
                    .filter_map(|v| got.get(v).cloned())
                    .collect())
            }
        };
        let mut out = Vec::new();
        for i in 0..n {
            let started = Instant::now();
            let (r0, r1) = futures::join!(pass(0, forward(i, 0)), pass(1, forward(i, 1)));
            out.push((vec![r0, r1], started.elapsed()));
        }
        shutdown_all(&a).await;
        out
    })
}

/// The model with parameter 4 moved from the last segment to the first (after its bucket
/// left, from the second pass on: DDP-2 refuses it).
pub fn moved(pass: &mut Pass<'_>, p: &[Var], x: &Tensor, y: &Tensor) -> Tensor {
    let bent = (x.matmul(p[0].as_tensor()).unwrap().sum_all().unwrap()
        * p[4].as_tensor().sum_all().unwrap())
    .unwrap();
    let h = pass.cut(&bent.broadcast_as((1, 1)).unwrap()).unwrap();
    let h = pass.cut(&h).unwrap();
    (h.sum_all().unwrap() + loss(p, x, y, |h| h.clone())).unwrap()
}
