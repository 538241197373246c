//! The small model the data-parallel tests share: a group of in-process workers, a dataset,
//! three layers whose middle weight goes through `grad_once`, and its loss with cuts.

#![allow(dead_code)] // each test file uses its part

use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use rpc_core::testing::start_group;
use rpc_core::{Agent, MemoryNetwork, Registry, Secret, Transport};

pub async fn group(n: u32) -> Vec<Agent> {
    start_group(
        n,
        Transport::Memory(MemoryNetwork::new()),
        Secret::generate(),
        |_| collectives::install(Registry::builder()).unwrap().build(),
        |_, c| c.with_rpc_timeout(Duration::from_secs(20)),
    )
    .await
    .expect("group starts")
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
